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

With ``--model NAME`` (a fetched real model, ``--dtype``): 16 real chat requests instead, each
a user turn through the model's chat template (questions alone, and questions about a passage
of 1 to 12 paragraphs: SmolLM2 reads 36 to 643 prompt tokens), ``--new`` tokens each (spread over
1x-2x). ``--serial kv4,kv4-start0`` also runs every request alone through ``mlx_lm.generate``'s
``generate_step``, mlxkv's scheme against mlx-lm's own cache of it, which has no batched
form in mlx-lm's engine: ``kv4`` against mlx-lm's ``QuantizedKVCache`` as the prompt cache
(quantized from token zero, the prompt attended quantized), ``kv4-start0`` against
``kv_bits=4, quantized_kv_start=0`` (the prompt attended in the model's dtype, quantized
after it: what mlx-lm's ``kv_bits`` does).

Repeats are interleaved (the scheme order rotates each repeat); medians and min-max are
reported. The machine may be shared: ratios are what to read, taken within one repeat.

Run: ``python -m benchmarks.serving [--repeats 3] [--schemes bf16,kv4,turbo-k8v3,bf16+compiled]
[--model smollm2-135m --dtype float32 --new 32 --serial kv4,kv4-start0]`` (writes
benchmarks/results/serving.json; ``--out`` elsewhere).
"""

import argparse
import math
import re
import time

from mlx_lm.generate import BatchGenerator, generate_step

import mlxkv
from benchmarks.chat import chat_requests
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
    # the offset's shape, never its values: reading them would wait for the step in flight
    # (mlx-lm's engine evaluates each decode step asynchronously), outside every timer, and
    # only for the caches whose offset is the result of a step (mlx-lm's)
    offset = layers[0].offset
    rows = offset.shape[0] if hasattr(offset, "shape") and offset.ndim else 1
    total = sum(c.nbytes for c in layers)
    columns = tokens = 0
    for c in layers:
        if getattr(c, "keys", None) is None:
            continue
        if hasattr(c, "bytes_per_token"):  # an mlxkv attention layout (a bf16-first batch: its target's)
            layout = getattr(c, "target", c)
            per_token, width, widest = c.bytes_per_token(), layout.capacity, c.size()
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


AFFINE = re.compile(r"kv(?P<bits>\d+)(?:-g(?P<group>\d+))?(?:-start(?P<start>\d+))?")


def mlx_lm_serial_options(model, scheme: str) -> dict:
    """``generate_step`` options giving mlx-lm's own cache of an affine ``scheme``:
    ``kv4`` (quantized from token zero: the prompt is attended through the quantized SDPA
    too) is mlx-lm's ``QuantizedKVCache`` given as the prompt cache; ``kv4-start<N>`` is
    ``kv_bits=4, quantized_kv_start=N``, which attends the prompt chunk that reaches N in
    the model's dtype and quantizes after it (``kv4-start0``: the whole first chunk)."""
    from mlx_lm.models.cache import QuantizedKVCache

    m = AFFINE.fullmatch(scheme)
    if m is None:
        raise SystemExit(f"--serial {scheme}: only kv<bits>[-g<group>][-start<N>] schemes have an mlx-lm twin")
    bits, group = int(m["bits"]), int(m["group"] or 64)
    if m["start"] is None:
        return {"prompt_cache": [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]}
    return {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": int(m["start"])}


def serial_run(model, scheme, reqs):
    """Every request alone through ``generate_step``: mlxkv's ``scheme`` (``scheme``) or
    mlx-lm's own cache of it (``mlx-lm:scheme``: ``mlx_lm_serial_options``). Tokens per
    second over the whole run, and the tokens."""
    import mlx.core as mx

    base = scheme.removeprefix(MLX_LM + ":")
    tokens = []
    t0 = time.perf_counter()
    for p, n in reqs:
        if scheme == base:
            options = {"prompt_cache": mlxkv.make_cache(model, scheme)}
        else:
            options = mlx_lm_serial_options(model, base)
        tokens.append([int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n, **options)])
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "tokens": tokens}


def load(args):
    """(model, requests, description) of the seeded llama or of the fetched ``--model``."""
    if args.model:
        import mlx_lm

        from mlxkv.models import fetch

        model, tokenizer = mlx_lm.load(str(fetch(args.model, dtype=args.dtype)))
        return model, chat_requests(tokenizer, args.new, args.requests), {"name": args.model, "dtype": args.dtype}
    shape = WIDE if args.wide else {}
    return build_model("llama", **shape), requests(args.requests), {"arch": "llama", **shape}


def serial_table(model, reqs, schemes, repeats):
    """Per scheme of ``--serial``: mlxkv's serial runs against mlx-lm's own cache, interleaved."""
    out = {}
    for scheme in schemes:
        pair = [MLX_LM + ":" + scheme, scheme]
        runs = {s: [] for s in pair}
        for r in range(repeats):
            for s in pair[r % 2 :] + pair[: r % 2]:
                runs[s].append(serial_run(model, s, reqs))
                print(f"serial repeat {r} {s:22} {runs[s][-1]['tokens_per_s']:8.1f} tok/s", flush=True)
        mine, theirs = ([x["tokens_per_s"] for x in runs[s]] for s in (scheme, pair[0]))
        out[scheme] = {
            "tokens_per_s": summary(mine),
            "mlx_lm_tokens_per_s": summary(theirs),
            "vs_mlx_lm": ratios(mine, theirs),
            "same_tokens": runs[scheme][0]["tokens"] == runs[pair[0]][0]["tokens"],
        }
        t = out[scheme]
        print(
            f"serial {scheme}: {t['tokens_per_s']['median']:.1f} tok/s, mlx-lm's own "
            f"{t['mlx_lm_tokens_per_s']['median']:.1f}: {t['vs_mlx_lm']['median']:.2f} "
            f"[{t['vs_mlx_lm']['min']:.2f}-{t['vs_mlx_lm']['max']:.2f}]; same tokens: {t['same_tokens']}"
        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", default="bf16,kv4,turbo-k8v3")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--wide", action="store_true", help="the wider seeded llama")
    ap.add_argument("--model", help="a fetched real model (mlxkv.models.fetch) instead of the seeded llama")
    ap.add_argument("--dtype", default="float32", help="with --model: the weights' dtype")
    ap.add_argument("--new", type=int, default=32, help="with --model: new tokens per request (up to 2x)")
    ap.add_argument("--serial", default="", help="schemes also run request by request against mlx-lm's own cache")
    ap.add_argument("--out", help="default: benchmarks/results/serving.json")
    args = ap.parse_args(argv)
    schemes = [MLX_LM] + [s for s in args.schemes.split(",") if s]
    model, reqs, described = load(args)
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
                f"repeat {r} {s:22} {res['tokens_per_s']:8.1f} tok/s  {res['peak_bytes_per_row'] / 2**20:7.2f} MiB/row",
                flush=True,
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
    serial = serial_table(model, reqs, [s for s in args.serial.split(",") if s], args.repeats)
    result = {
        "model": described,
        "requests": [(len(p), n) for p, n in reqs],
        "repeats": args.repeats,
        "tokens_equal_mlx_lm": same,
        "results": table,
        "serial": serial,
    }
    print(write_result("serving", result, args.out))


if __name__ == "__main__":
    main()
