"""Continuous batching through mlx-lm's ``BatchGenerator``: mlxkv caches of each scheme side by
side with mlx-lm's own caches (``KVCache`` rows batched as ``BatchKVCache``) in one run.

16 requests (prompt lengths 32 to 2,048, spread log-uniformly; 64 to 256 new tokens) arrive
in four waves, one every 16 engine steps, so rows join while others decode and retire at
different times. Per scheme:

- generated tokens per second over the whole run (prefill included) and over the decode
  steps alone (mlx-lm's ``decode_tps``);
- peak cache bytes per row: the largest ``sum(nbytes) / rows`` of the engine's batches
  (prompt batch + decode batch), sampled after every engine step, against
  ``bytes_per_token x columns`` (the columns the batch holds, padding and slack
  included: ``storage`` is the ratio, 1.0 = no byte beside the scheme's own storage) and
  against ``bytes_per_token x tokens`` of the widest row (``layout``: what left padding and
  the 256-column growth steps add, the same for mlx-lm's ``BatchKVCache``);
- mlxkv ``bf16`` (and ``bf16+compiled``) must give mlx-lm's tokens (checked, not timed).

Repeats are interleaved (the scheme order rotates each repeat); medians and min-max are
reported. The machine may be shared: ratios are what to read, taken within one repeat.

Run: ``python -m benchmarks.serving [--repeats 3] [--schemes bf16,kv4,turbo-k8v3,bf16+compiled]``
(writes benchmarks/results/serving.json).
"""

import argparse
import math
import time

from mlx_lm.generate import BatchGenerator

import mlxkv
from benchmarks.common import ratios, summary, write_result
from mlxkv.models.seeded import build_model, prompt

MLX_LM = "mlx-lm"
COMPILED = "+compiled"  # a scheme with this suffix runs the engine on mlxkv.compiled_model
#: the seeded llama (4 layers, 2 kv heads of 64: 512 bytes of bf16 keys and values per token
#: and layer); --wide runs a wider one (hidden 256, 4 query heads) where the model's own work weighs more
WIDE = dict(hidden_size=256, num_attention_heads=4, intermediate_size=512)


def requests(n=16, seed=0):
    """(prompt, max_tokens) pairs: prompt lengths log-uniform in [32, 2048], 64-256 new tokens."""
    out = []
    for i in range(n):
        length = round(math.exp(math.log(32) + (math.log(2048) - math.log(32)) * i / (n - 1)))
        new = 64 + (i * 37) % 193
        out.append((prompt(length, seed=seed + i), new))
    order = [(i * 7) % n for i in range(n)]  # arrivals mix long and short prompts
    return [out[i] for i in order]


def batches(gen):
    return [gen._prompt_batch.prompt_cache, gen._generation_batch.prompt_cache]


def cache_bytes(layers) -> tuple[int, int, int, int]:
    """(bytes, rows, bytes if every allocated column cost bytes_per_token, ... of the widest row's tokens)."""
    if not layers:
        return 0, 0, 0, 0
    rows = len(layers[0].offset.tolist()) if hasattr(layers[0].offset, "tolist") else 1
    total = sum(c.nbytes for c in layers)
    columns = tokens = 0
    for c in layers:
        if getattr(c, "keys", None) is None:
            continue
        if isinstance(c.keys, tuple):  # an mlxkv attention layout
            per_token, width, widest = c.bytes_per_token(), c.capacity, c.size()
        else:  # mlx-lm's BatchKVCache
            per_token = (c.keys.nbytes + c.values.nbytes) // (c.keys.shape[0] * c.keys.shape[2])
            width, widest = c.keys.shape[2], c._idx
        columns += per_token * width * rows
        tokens += per_token * widest * rows
    return total, rows, columns, tokens


def run(model, scheme, reqs, wave=4, every=16):
    """One run of ``reqs``; ``scheme`` is mlx-lm's caches, an mlxkv scheme, or an mlxkv
    scheme + ``COMPILED`` (the engine decodes through ``mlxkv.compiled_model``)."""
    base = scheme.removesuffix(COMPILED)
    make = None if scheme == MLX_LM else (lambda: mlxkv.make_cache(model, base))
    engine_model = mlxkv.compiled_model(model) if scheme.endswith(COMPILED) else model
    gen = BatchGenerator(engine_model, completion_batch_size=16, prefill_batch_size=8)
    pending, uids, tokens, step = list(reqs), [], {}, 0
    peak = {"per_row": 0.0, "storage": 0.0, "layout": 0.0}
    sampling = 0.0
    t0 = time.perf_counter()
    with gen.stats() as stats:
        while True:
            if pending and step % every == 0:
                now, pending = pending[:wave], pending[wave:]
                caches = None if make is None else [make() for _ in now]
                uids += gen.insert([p for p, _ in now], [n for _, n in now], caches=caches)
            _, responses = gen.next()
            step += 1
            for r in responses:
                tokens.setdefault(r.uid, []).append(r.token)
            t_sample = time.perf_counter()  # measuring bytes is not serving: its time is left out
            for layers in batches(gen):
                total, rows, columns, widest = cache_bytes(layers)
                if rows and total / rows > peak["per_row"]:
                    peak = {"per_row": total / rows, "storage": total / columns, "layout": columns / widest}
            sampling += time.perf_counter() - t_sample
            busy = len(gen._generation_batch) or len(gen._prompt_batch) or gen._unprocessed_sequences
            if not pending and not busy:
                break
    wall = time.perf_counter() - t0 - sampling
    gen.close()
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens_per_s": generated / wall,
        "decode_tokens_per_s": stats.decode_tps,
        "prompt_s": stats.prompt_time,  # mlx-lm's partition of the engine's time
        "decode_s": stats.decode_time,
        "peak_bytes_per_row": peak["per_row"],
        "storage_ratio": peak["storage"],
        "layout_ratio": peak["layout"],
        "generated": generated,
        "tokens": [tokens[u] for u in uids],
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", default="bf16,kv4,turbo-k8v3")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--wide", action="store_true", help="the wider seeded llama")
    args = ap.parse_args(argv)
    schemes = [MLX_LM] + args.schemes.split(",")
    shape = WIDE if args.wide else {}
    model = build_model("llama", **shape)
    reqs = requests(args.requests)
    run(model, MLX_LM, reqs[:2])  # warm up
    samples = {s: [] for s in schemes}
    reference = None
    for r in range(args.repeats):
        order = schemes[r % len(schemes) :] + schemes[: r % len(schemes)]
        for s in order:
            res = run(model, s, reqs)
            if s == MLX_LM:
                reference = res["tokens"]
            samples[s].append(res)
            print(
                f"repeat {r} {s:22} {res['tokens_per_s']:8.1f} tok/s  {res['peak_bytes_per_row'] / 2**20:7.2f} MiB/row"
            )
    # bf16 rows, eager or compiled, must give mlx-lm's tokens
    same = {s: samples[s][0]["tokens"] == reference for s in schemes if s.removesuffix(COMPILED) == "bf16"}

    def of(s, key):
        return summary(x[key] for x in samples[s])

    def ratio(s, key):
        """Per repeat: scheme / mlx-lm in the same repeat; median and range."""
        return ratios([x[key] for x in samples[s]], [y[key] for y in samples[MLX_LM]])

    table = {
        s: {
            "tokens_per_s": of(s, "tokens_per_s"),
            "decode_tokens_per_s": of(s, "decode_tokens_per_s"),
            "throughput_vs_mlx_lm": ratio(s, "tokens_per_s"),
            "decode_vs_mlx_lm": ratio(s, "decode_tokens_per_s"),
            "peak_bytes_per_row": of(s, "peak_bytes_per_row"),
            "bytes_per_row_vs_mlx_lm": ratio(s, "peak_bytes_per_row"),
            "storage_ratio": of(s, "storage_ratio"),
            "layout_ratio": of(s, "layout_ratio"),
            "prompt_s": of(s, "prompt_s"),
            "decode_s": of(s, "decode_s"),
            "runs": [{k: v for k, v in x.items() if k != "tokens"} for x in samples[s]],
        }
        for s in schemes
    }
    print(f"\nmlx-lm's tokens: {same}")
    print(
        f"{'scheme':22} {'tok/s':>8} {'vs mlx-lm':>16} {'decode tok/s':>13} {'vs mlx-lm':>16} "
        f"{'MiB/row':>8} {'vs mlx-lm':>9} {'storage':>8} {'layout':>7} {'prefill s':>9} {'decode s':>8}"
    )
    for s in schemes:
        t = table[s]
        rng = lambda d: f"{d['median']:.2f} [{d['min']:.2f}-{d['max']:.2f}]"
        print(
            f"{s:22} {t['tokens_per_s']['median']:8.1f} {rng(t['throughput_vs_mlx_lm']):>16} "
            f"{t['decode_tokens_per_s']['median']:13.1f} {rng(t['decode_vs_mlx_lm']):>16} "
            f"{t['peak_bytes_per_row']['median'] / 2**20:8.2f} {t['bytes_per_row_vs_mlx_lm']['median']:9.3f} "
            f"{t['storage_ratio']['median']:8.3f} {t['layout_ratio']['median']:7.3f} "
            f"{t['prompt_s']['median']:9.1f} {t['decode_s']['median']:8.1f}"
        )
    write_result(
        "serving",
        {
            "model": {"arch": "llama", **shape},
            "requests": [(len(p), n) for p, n in reqs],
            "repeats": args.repeats,
            "tokens_equal_mlx_lm": same,
            "results": table,
        },
    )


if __name__ == "__main__":
    main()
