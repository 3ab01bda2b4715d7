"""TurboQuant: codec throughput, decode-step time against bf16, bytes per token, logit KL.

Measured in one run, side by side:
  1. encode and decode throughput of the codec for every (kBits, vBits) on [1, H, T, D]
     bf16 keys and values (tokens/s; MB/s counts the bf16 K+V bytes encoded or decoded;
     median and range of the repeats);
  2. one decode step of one attention layer (append one position + attention over the
     window) at 1k/4k/16k context, through mlx-lm's own attention
     (``update_and_fetch``, then ``mlx_lm.models.base.scaled_dot_product_attention`` with the
     cache, as every mlx-lm attention module calls it): plain bf16 ``KVCache`` against
     TurboQuant's exact read (``codes=False``: the window decoded, then the dense kernel) and
     its codes read (the default: no decoded window); and the deferred named read
     (``append_decode(...).attend``). Repeats are interleaved; each round gives every
     contender's ratio to the bf16 step of the same round, reported as the median and the
     range over rounds. The cache is trimmed back after every step so each repeat sees the
     same context;
  3. stored bytes per token and kv head, against bf16's 4*D;
  4. the KL divergence KL(bf16 || turbo) of the next-token distributions on the seeded
     models (bf16-first schemes ``turbo-k<k>v<v>``: prefill attended in bf16, then teacher-forced
     decode steps reading the TurboQuant storage). The seeded models have random weights: the
     numbers rank the configurations, they do not predict a trained model's quality.

  5. logits of the codes read against the exact read on the seeded models (teacher-forced
     decode steps through mlx-lm's own attention): the largest difference, and whether the
     greedy tokens agree.

Usage: python -m benchmarks.turboquant [--heads 8 --q-heads 32 --dim 128 --contexts 1024 4096 16384
                                        --repeats 9 --codec-tokens 2048 --kl-prefill 32 --kl-steps 32]
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from benchmarks.common import median_seconds, write_result
from mlxkv import KVCache, TurboQuantKVCache
from mlxkv.caches.schemes import make_cache
from mlxkv.math import turboquant as tq
from mlxkv.models.seeded import build_model, prompt
from mlxkv.quality import greedy_flips, teacher_forced_logprobs

PAIRS = [(k, v) for k in tq.K_BITS for v in tq.V_BITS]
STEP_PAIRS = [(8, 3), (4, 2)]
SECTIONS = ("codec", "decode_step", "bytes_per_token", "kl", "codes")


def normal(shape, seed, dtype=mx.bfloat16):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# -- 1. codec throughput --------------------------------------------------------------------


def codec_throughput(heads, dim, tokens, repeats):
    k, v = normal((1, heads, tokens, dim), 1), normal((1, heads, tokens, dim), 2)
    mx.eval(k, v)
    mb = 2 * k.nbytes / 1e6  # bf16 K + V
    rows = []
    for kb, vb in PAIRS:
        stored = tq.encode(k, v, kb, vb)
        mx.eval(stored)
        enc = median_seconds(lambda kb=kb, vb=vb: mx.eval(tq.encode(k, v, kb, vb)), repeats)
        dec = median_seconds(lambda s=stored, kb=kb, vb=vb: mx.eval(tq.decode(s, kb, vb)), repeats)
        rows.append(
            {
                "kBits": kb,
                "vBits": vb,
                "encode_tokens_per_s": tokens / enc,
                "encode_MB_per_s": mb / enc,
                "decode_tokens_per_s": tokens / dec,
                "decode_MB_per_s": mb / dec,
            }
        )
    return {"heads": heads, "head_dim": dim, "tokens": tokens, "rows": rows}


# -- 2. decode step against bf16 ----------------------------------------------------------


CONTENDERS = ("bf16", "eager", "deferred", "codes")


def step_contenders(heads, q_heads, dim, context, kb, vb):
    k, v = normal((1, heads, context, dim), 3), normal((1, heads, context, dim), 4)
    k1, v1 = normal((1, heads, 1, dim), 5), normal((1, heads, 1, dim), 6)
    q = normal((1, q_heads, 1, dim), 7)
    scale = dim**-0.5

    def filled(make):
        src = KVCache()
        src.update_and_fetch(k, v)
        return make(src)

    caches = {
        "bf16": filled(lambda c: c),
        "eager": filled(lambda c: TurboQuantKVCache.from_cache(c, kb, vb, codes=False)),
        "deferred": filled(lambda c: TurboQuantKVCache.from_cache(c, kb, vb, deferred=True, codes=False)),
        "codes": filled(lambda c: TurboQuantKVCache.from_cache(c, kb, vb)),
    }
    mx.eval([c.state for c in caches.values()])

    def mlx_lm_step(cache):
        def step():  # what an mlx-lm attention module does with its cache
            keys, values = cache.update_and_fetch(k1, v1)
            mx.eval(scaled_dot_product_attention(q, keys, values, cache=cache, scale=scale, mask=cache.make_mask(1)))
            cache.trim(1)

        return step

    def named_step(cache):
        def step():
            mx.eval(cache.append_decode(k1, v1).attend(q, scale))
            cache.trim(1)

        return step

    return {name: (named_step if name == "deferred" else mlx_lm_step)(c) for name, c in caches.items()}


def decode_steps(heads, q_heads, dim, contexts, repeats):
    rows = []
    for context in contexts:
        for kb, vb in STEP_PAIRS:
            fns = step_contenders(heads, q_heads, dim, context, kb, vb)
            for fn in fns.values():
                fn()  # warm-up
            times = {name: [] for name in fns}
            for _ in range(repeats):  # interleaved
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            row = {"context": context, "kBits": kb, "vBits": vb}
            for name, t in times.items():
                row[f"{name}_ms"] = statistics.median(t) * 1e3
                if name != "bf16":
                    ratios = [a / b for a, b in zip(t, times["bf16"])]
                    row[f"{name}_vs_bf16"] = statistics.median(ratios)
                    row[f"{name}_vs_bf16_range"] = [min(ratios), max(ratios)]
            rows.append(row)
            print(
                f"  {context:>6} k{kb}v{vb}: " + "  ".join(f"{n} {row[n + '_vs_bf16']:.2f}x" for n in CONTENDERS[1:]),
                flush=True,
            )
    return {"heads": heads, "q_heads": q_heads, "head_dim": dim, "repeats": repeats, "rows": rows}


# -- 3. bytes per token ---------------------------------------------------------------------


def bytes_table(dims=(64, 128)):
    return [
        {
            "head_dim": d,
            "kBits": kb,
            "vBits": vb,
            "bytes_per_token_per_head": tq.bytes_per_head(d, kb, vb),
            "bf16_bytes": 4 * d,
            "ratio_to_bf16": tq.bytes_per_head(d, kb, vb) / (4 * d),
        }
        for d in dims
        for kb, vb in PAIRS
    ]


# -- 4. logit KL on the seeded models ------------------------------------------------------


def kl_rows(prefill, steps):
    rows = []
    for arch in ("llama", "gemma3"):
        model = build_model(arch)
        tokens = prompt(prefill + steps, seed=11)

        def trace(scheme, model=model, tokens=tokens):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                caches = make_cache(model, scheme)
            model(mx.array(tokens[:prefill])[None], cache=caches)
            out = []
            for t in tokens[prefill:]:
                logits = model(mx.array([[t]]), cache=caches)[0, -1].astype(mx.float32)
                out.append(logits - mx.logsumexp(logits))
            mx.eval(out)
            return mx.stack(out)

        ref = trace("bf16")
        p = mx.exp(ref)
        for kb, vb in PAIRS:
            lq = trace(f"turbo-k{kb}v{vb}")
            kl = mx.sum(p * (ref - lq), axis=-1)
            rows.append(
                {"model": arch, "kBits": kb, "vBits": vb, "kl_mean": mx.mean(kl).item(), "kl_max": mx.max(kl).item()}
            )
    return {"prefill": prefill, "steps": steps, "rows": rows}


# -- 5. the codes read against the exact read on the seeded models -----------------------


def turbo_caches(model, kb, vb, codes):
    """TurboQuant from token zero on the full-attention layers, read by mlx-lm's own
    attention: the exact read (``codes=False``) or the codes read."""
    caches = []
    for c in make_cache(model, "bf16"):
        if c.kind == "kv:plain":
            t = TurboQuantKVCache(kb, vb, codes=codes)
            t.masks = c.masks
            c = t
        caches.append(c)
    return caches


def codes_rows(prefill, steps):
    """Teacher-forced decode steps, exact read against codes read (TurboQuant from token
    zero on the full-attention layers): the largest log-probability difference, how many
    steps pick a different greedy token and the exact read's largest top-two gap among them,
    in the seeded models' bfloat16 and in float32."""
    rows = []
    tokens = prompt(prefill + steps, seed=12)
    for dtype in ("bfloat16", "float32"):
        for arch in ("llama", "gemma3", "hybrid"):
            model = build_model(arch, dtype=getattr(mx, dtype))
            for kb, vb in STEP_PAIRS:
                exact, fast = (
                    teacher_forced_logprobs(model, turbo_caches(model, kb, vb, c), tokens, prefill)
                    for c in (False, True)
                )
                gaps = greedy_flips(exact, fast)
                rows.append(
                    {
                        "dtype": dtype,
                        "model": arch,
                        "kBits": kb,
                        "vBits": vb,
                        "max_abs_logprob_diff": mx.abs(exact - fast).max().item(),
                        "greedy_differs": len(gaps),
                        "largest_margin_where_differs": max(gaps, default=None),
                    }
                )
    return {"prefill": prefill, "steps": steps, "rows": rows}


# -- report ---------------------------------------------------------------------------------


def print_tables(res):
    if "codec" in res:
        print_codec(res)
    if "decode_step" in res:
        print_steps(res)
    if "bytes_per_token" in res:
        print_bytes(res)
    if "kl" in res:
        print_kl(res)
    if "codes" in res:
        print_codes(res)


def print_codec(res):
    print(
        f"\nCodec throughput ([1, {res['codec']['heads']}, {res['codec']['tokens']}, "
        f"{res['codec']['head_dim']}] bf16 K+V)"
    )
    print(f"{'k/v':>5} {'enc tok/s':>11} {'enc MB/s':>9} {'dec tok/s':>11} {'dec MB/s':>9}")
    for r in res["codec"]["rows"]:
        print(
            f"{r['kBits']}/{r['vBits']:<3} {r['encode_tokens_per_s']:11.0f} {r['encode_MB_per_s']:9.1f} "
            f"{r['decode_tokens_per_s']:11.0f} {r['decode_MB_per_s']:9.1f}"
        )


def print_steps(res):
    s = res["decode_step"]
    print(
        f"\nDecode step, one layer ({s['heads']} kv heads, {s['q_heads']} q heads, D={s['head_dim']}), through "
        f"mlx-lm's attention (deferred: the named read): median ms over {s['repeats']} interleaved rounds; "
        "ratio to bf16 median [min-max over rounds]"
    )
    print(
        f"{'ctx':>6} {'k/v':>5} "
        + " ".join(f"{n:>8}" for n in CONTENDERS)
        + "".join(f" {n + '/bf16':>20}" for n in CONTENDERS[1:])
    )
    for r in s["rows"]:
        ms = " ".join(f"{r[n + '_ms']:8.1f}" for n in CONTENDERS)
        ratios = "".join(
            f" {r[n + '_vs_bf16']:6.2f} [{r[n + '_vs_bf16_range'][0]:.2f}-{r[n + '_vs_bf16_range'][1]:.2f}]"
            for n in CONTENDERS[1:]
        )
        print(f"{r['context']:>6} {r['kBits']}/{r['vBits']:<3} {ms}{ratios}")


def print_bytes(res):
    print("\nBytes per token and kv head (D=128; bf16 = 512)")
    print(
        "  "
        + "  ".join(
            f"k{r['kBits']}v{r['vBits']}={r['bytes_per_token_per_head']}"
            for r in res["bytes_per_token"]
            if r["head_dim"] == 128
        )
    )


def print_kl(res):
    k = res["kl"]
    print(f"\nKL(bf16 || turbo) per decode step, seeded models ({k['prefill']} prefill, {k['steps']} steps)")
    print(f"{'k/v':>5} {'llama mean':>11} {'llama max':>10} {'gemma3 mean':>12} {'gemma3 max':>11}")
    by = {(r["model"], r["kBits"], r["vBits"]): r for r in k["rows"]}
    for kb, vb in PAIRS:
        a, b = by[("llama", kb, vb)], by[("gemma3", kb, vb)]
        print(f"{kb}/{vb:<3} {a['kl_mean']:11.2e} {a['kl_max']:10.2e} {b['kl_mean']:12.2e} {b['kl_max']:11.2e}")


def print_codes(res):
    c = res["codes"]
    print(
        f"\nCodes read against the exact read, seeded models ({c['prefill']} prefill, "
        f"{c['steps']} teacher-forced steps)"
    )
    print(f"{'dtype':>9} {'model':>7} {'k/v':>5} {'max |dlogprob|':>15} {'greedy differs':>15} {'at top-2 gap':>13}")
    for r in c["rows"]:
        gap = r["largest_margin_where_differs"]
        print(
            f"{r['dtype']:>9} {r['model']:>7} {r['kBits']}/{r['vBits']:<3} {r['max_abs_logprob_diff']:15.2e} "
            f"{r['greedy_differs']:>15} {'-' if gap is None else f'{gap:.3f}':>13}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--codec-tokens", type=int, default=2048)
    ap.add_argument("--kl-prefill", type=int, default=32)
    ap.add_argument("--kl-steps", type=int, default=32)
    ap.add_argument("--codes-steps", type=int, default=32)
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="sections to run")
    ap.add_argument("--out", help="default: benchmarks/results/turboquant.json")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    run = {
        "codec": lambda: codec_throughput(a.heads, a.dim, a.codec_tokens, a.repeats),
        "decode_step": lambda: decode_steps(a.heads, a.q_heads, a.dim, a.contexts, a.repeats),
        "bytes_per_token": bytes_table,
        "kl": lambda: kl_rows(a.kl_prefill, a.kl_steps),
        "codes": lambda: codes_rows(a.kl_prefill, a.codes_steps),
    }
    res = {name: run[name]() for name in SECTIONS if name in a.only}
    res["seconds"] = time.perf_counter() - t0
    out = write_result("turboquant", res, a.out)
    print_tables(res)
    print(f"\n{res['seconds']:.0f} s; written {out} (the machine's load is not controlled: see the ranges)")


if __name__ == "__main__":
    main()
