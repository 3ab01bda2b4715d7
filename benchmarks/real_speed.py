"""Prompt and generation speed of the fetched real models per weight dtype, with MLX's own BLAS
and with OpenBLAS preloaded (docs/models.md, "Speed on Linux CPUs").

Each measurement runs in a fresh process (``LD_PRELOAD`` takes effect at process start), and
the configurations are interleaved round by round, so a machine that slows down slows all of
them alike; medians and ranges over the rounds are reported.

    python -m benchmarks.real_speed [--models smollm2-135m,gemma3-270m] [--dtypes float32,bfloat16,q4]
        [--prompt 1024] [--generate 16] [--rounds 3] [--blas ref,openblas]
"""

import argparse
import json
import os
import subprocess
import sys
import time

from .common import summary, write_result

OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def measure(name: str, dtype: str, prompt_tokens: int, generate: int) -> dict:
    """In this process: prompt tokens/s (mlx-lm's prefill of ``prompt_tokens`` text tokens:
    all but the last into the cache, then the last one's logits) and generation tokens/s
    (``generate`` greedy steps)."""
    import mlx.core as mx
    import mlx_lm

    from mlxkv.models import fetch

    model, tokenizer = mlx_lm.load(str(fetch(name, dtype=dtype)))
    words = " ".join(f"Line {i}: the box holds {i * 7 % 100} stones." for i in range(prompt_tokens))
    ids = tokenizer.encode(words)[:prompt_tokens]
    cache = mlx_lm.models.cache.make_prompt_cache(model)
    mx.eval(model(mx.array([ids[:8]]))[:, -1])  # warm-up, its own cache
    t0 = time.perf_counter()
    model(mx.array([ids[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    y = model(mx.array([ids[-1:]]), cache=cache)[:, -1]
    mx.eval(y)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(generate):
        y = model(mx.argmax(y, -1, keepdims=True), cache=cache)[:, -1]
        mx.eval(y)
    decode = time.perf_counter() - t0
    return {"prompt_tok_s": len(ids) / prefill, "generate_tok_s": generate / decode, "prompt_tokens": len(ids)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--dtypes", default="float32,bfloat16,q4")
    p.add_argument("--blas", default="ref,openblas")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--generate", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="result file (default: benchmarks/results/real_speed.json)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.prompt, args.generate)))
        return 0

    from mlxkv.models.registry import MODELS

    configs = [
        (m, d, b)
        for m in args.models.split(",")
        for d in args.dtypes.split(",")
        if d in MODELS[m].dtypes
        for b in args.blas.split(",")
    ]
    runs = {c: [] for c in configs}
    for r in range(args.rounds):
        for m, d, b in configs:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if b == "openblas":
                env["LD_PRELOAD"] = OPENBLAS_PATH
            cmd = [sys.executable, "-m", "benchmarks.real_speed", "--child", m, d]
            cmd += ["--prompt", str(args.prompt), "--generate", str(args.generate)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            runs[(m, d, b)].append({**json.loads(done.stdout.strip().splitlines()[-1]), "load": os.getloadavg()[0]})
            print(f"round {r + 1}: {m} {d} {b}: {runs[(m, d, b)][-1]}", file=sys.stderr, flush=True)
    table = []
    for (m, d, b), rs in runs.items():
        row = {"model": m, "dtype": d, "blas": b, "runs": rs}
        row.update({k: summary(x[k] for x in rs) for k in ("prompt_tok_s", "generate_tok_s")})
        table.append(row)
        print(
            f"{m:14} {d:9} {b:9} prompt {row['prompt_tok_s']['median']:7.1f} tok/s "
            f"[{row['prompt_tok_s']['min']:.1f}-{row['prompt_tok_s']['max']:.1f}]  "
            f"generate {row['generate_tok_s']['median']:6.2f} tok/s "
            f"[{row['generate_tok_s']['min']:.2f}-{row['generate_tok_s']['max']:.2f}]"
        )
    print(write_result("real_speed", {"prompt": args.prompt, "generate": args.generate, "rows": table}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
