"""Where a fetched model's own context limit is: a 5-digit pass key hidden in filler text, asked
for at the end, at a few prompt lengths (docs/models.md, "Context").

The prompt is ``mlxkv.quality.passkey_prompt``'s (as benchmarks/quality's pass-key part). Each
trial hides a different key at a different depth of the filler ("The grass is green. The
sky is blue. ..."), asks in the model's chat template (plain text without one), and decodes
greedily on full-precision caches (mlx-lm's own); a trial passes when the key's digits appear
in the answer.

    python -m benchmarks.real_passkey [--model smollm2-135m] [--dtype bfloat16]
        [--lengths 256,512,768,1024] [--trials 3]
"""

import argparse
import random
import sys
import time

from .common import write_result


def main(argv=None) -> int:
    import mlx_lm

    from mlxkv.models import fetch
    from mlxkv.quality import passkey_prompt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", default="256,512,768,1024")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", help="result file (default: benchmarks/results/real_passkey.json)")
    args = p.parse_args(argv)
    model, tokenizer = mlx_lm.load(str(fetch(args.model, dtype=args.dtype)))
    rng = random.Random(0)
    rows = []
    for length in map(int, args.lengths.split(",")):
        found, trials = 0, []
        for t in range(args.trials):
            key, depth = rng.randrange(10000, 100000), (t + 0.5) / args.trials
            ids = passkey_prompt(tokenizer, length, key, depth)
            t0 = time.perf_counter()
            answer = mlx_lm.generate(model, tokenizer, ids, max_tokens=10)
            ok = str(key) in answer.replace(" ", "")
            found += ok
            trials.append({"tokens": len(ids), "key": key, "depth": depth, "answer": answer, "found": ok})
            print(
                f"{length}: {len(ids)} tokens, depth {depth:.2f}: {answer!r} {'ok' if ok else 'miss'} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        rows.append({"length": length, "found": found, "trials": trials})
        print(f"{args.model} {args.dtype}: ~{length} tokens: {found}/{args.trials}")
    print(write_result("real_passkey", {"model": args.model, "dtype": args.dtype, "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
