"""Eviction cache costs, each against a baseline measured side by side in this process.

- TOVA prefill of 2048 tokens at budget 64 and one decode step at budget 512: the
  vectorized cache against a straightforward per-token, per-head reference loop (the kept
  positions are checked equal before any time is reported).
- Q-Filters (calibrated) prefill of 4096 tokens at budget 512: one-shot against chunked
  prefill (1024, 256, 64); the kept sets are checked identical.
- Per-step decode cost against a plain cache: cache-level (append one token + attention of
  one query) and model-level (the seeded llama's full decode step).

Run: ``python -m benchmarks.eviction`` (writes benchmarks/results/eviction.json).
"""

import math
import os
import time

import mlx.core as mx

import mlxkv
from benchmarks.common import median_seconds, write_result
from mlxkv import KVCache, QFiltersKVCache, TOVAKVCache
from mlxkv.models.seeded import build_model, prompt

B, H, D = 1, 8, 128


def rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.bfloat16)


# -- the reference: per token, per head, one row at a time --------------------------------


def reference_tova_head(keys, values, positions, k_new, v_new, p_new, budget, n_sink):
    """One head, one token: append, and if over budget evict the lowest current-step weight."""
    keys = mx.concatenate([keys, k_new], axis=0)
    values = mx.concatenate([values, v_new], axis=0)
    positions = mx.concatenate([positions, p_new], axis=0)
    if keys.shape[0] > budget:
        k32 = keys.astype(mx.float32)
        w = mx.softmax(k32 @ k32[-1] / math.sqrt(keys.shape[1]))
        w = mx.where(mx.arange(keys.shape[0]) < n_sink, mx.inf, w)
        i = int(mx.argmin(w).item())
        keep = lambda a: mx.concatenate([a[:i], a[i + 1 :]], axis=0)
        keys, values, positions = keep(keys), keep(values), keep(positions)
    return keys, values, positions


def reference_tova(k, v, budget, n_sink, start=None):
    """Feed [1, H, T, D] token by token, head by head; returns per-head state."""
    heads = start or [(k[0, h, :0], v[0, h, :0], mx.zeros((0,), mx.int32)) for h in range(k.shape[1])]
    offset = 0 if start is None else int(max(int(s[2].max().item()) for s in start)) + 1
    out = []
    for h, (hk, hv, hp) in enumerate(heads):
        for t in range(k.shape[2]):
            p = mx.array([offset + t], dtype=mx.int32)
            hk, hv, hp = reference_tova_head(hk, hv, hp, k[0, h, t : t + 1], v[0, h, t : t + 1], p, budget, n_sink)
        mx.eval(hk, hv, hp)
        out.append((hk, hv, hp))
    return out


def tova_prefill(T=2048, budget=64, n_sink=4):
    k, v = rand((B, H, T, D), 1), rand((B, H, T, D), 2)
    mx.eval(k, v)

    def vectorized():
        c = TOVAKVCache(budget, n_sink)
        c.update_and_fetch(k, v)
        mx.eval(c.state)
        return c

    ref_state = reference_tova(k, v, budget, n_sink)
    c = vectorized()
    assert all(c.positions[0, h].tolist() == ref_state[h][2].tolist() for h in range(H)), "TOVA kept sets differ"
    t_vec = median_seconds(vectorized, 3)
    t_ref = median_seconds(lambda: reference_tova(k, v, budget, n_sink), 1, warmup=0)
    return {
        "tokens": T,
        "budget": budget,
        "nSink": n_sink,
        "shape": [B, H, T, D],
        "vectorized_s": t_vec,
        "reference_s": t_ref,
        "speedup": t_ref / t_vec,
    }


def tova_decode(budget=512, n_sink=4, steps=20):
    T = budget + steps * 3
    k, v = rand((B, H, T, D), 3), rand((B, H, T, D), 4)
    c = TOVAKVCache(budget, n_sink)
    c.update_and_fetch(k[:, :, :budget], v[:, :, :budget])
    mx.eval(c.state)
    start = [(c.keys[0, h], c.values[0, h], c.positions[0, h]) for h in range(H)]
    plain = KVCache()
    plain.update_and_fetch(k[:, :, :budget], v[:, :, :budget])
    t_idx = [budget]

    def vec_step():
        i = t_idx[0] = t_idx[0] + 1
        rk, rv = c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        mx.eval(rk, rv, c.state)

    def ref_step():
        nonlocal start
        i = t_idx[0] = t_idx[0] + 1
        start = reference_tova(k[:, :, i : i + 1], v[:, :, i : i + 1], budget, n_sink, start)

    def plain_step():
        i = t_idx[0] = t_idx[0] + 1
        rk, rv = plain.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        mx.eval(rk, rv)

    t_vec = median_seconds(vec_step, steps, warmup=2)
    t_ref = median_seconds(ref_step, steps // 2)
    t_plain = median_seconds(plain_step, steps, warmup=2)
    return {
        "budget": budget,
        "shape": [B, H, budget, D],
        "vectorized_step_s": t_vec,
        "reference_step_s": t_ref,
        "speedup": t_ref / t_vec,
        "plain_append_step_s": t_plain,
        "vs_plain_append": t_vec / t_plain,
    }


def qfilters_prefill(T=4096, budget=512, n_sink=4):
    k, v = rand((B, H, T, D), 6), rand((B, H, T, D), 7)
    f = mx.random.normal((H, D), key=mx.random.key(8))
    f = f / mx.linalg.norm(f, axis=-1, keepdims=True)
    mx.eval(k, v, f)

    def run(chunk):
        c = QFiltersKVCache(budget, n_sink, filters=f)
        for s in range(0, T, chunk):
            c.update_and_fetch(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
            mx.eval(c.state)
        return c

    one = run(T)
    rows = []
    for chunk in (T, 1024, 256, 64):
        c = run(chunk)
        same = bool(mx.array_equal(c.positions, one.positions).item() and mx.array_equal(c.keys, one.keys).item())
        rows.append(
            {
                "chunk": chunk,
                "eviction_calls": math.ceil(max(0, T - budget) / chunk) if chunk < T else 1,
                "seconds": median_seconds(lambda chunk=chunk: run(chunk), 3),
                "identical_to_one_shot": same,
            }
        )
    base = rows[0]["seconds"]
    for r in rows:
        r["vs_one_shot"] = r["seconds"] / base
    return {"tokens": T, "budget": budget, "shape": [B, H, T, D], "rows": rows}


def cache_decode_vs_plain(budget=512, context=2048, steps=30):
    """Append one token + one query's attention over what the cache returns."""
    k, v = rand((B, H, context + steps * 4, D), 9), rand((B, H, context + steps * 4, D), 10)
    q = rand((B, H * 2, 1, D), 11)
    f = mx.random.normal((H, D), key=mx.random.key(12))
    caches = {
        f"plain@{budget}": (KVCache(), budget),
        f"plain@{context}": (KVCache(), context),
        f"tova-b{budget}": (TOVAKVCache(budget, 4), context),
        f"qfilters-b{budget}": (QFiltersKVCache(budget, 4, budget // 4, filters=f), context),
    }
    out = {}
    for name, (c, fill) in caches.items():
        c.update_and_fetch(k[:, :, :fill], v[:, :, :fill])
        mx.eval(c.dense_window())
        pos = [fill]

        def step(c=c, pos=pos):
            i = pos[0] = pos[0] + 1
            rk, rv = c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            o = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=D**-0.5, mask=None)
            mx.eval(o, c.dense_window())

        out[name] = median_seconds(step, steps, warmup=3)
    base = out[f"plain@{budget}"]
    return {
        "budget": budget,
        "context": context,
        "step_s": out,
        "vs_plain_same_rows": {n: s / base for n, s in out.items()},
    }


def model_decode_vs_plain(context=1024, budget=512, steps=20):
    model = build_model("llama")
    toks = prompt(context + steps + 5, 13)
    out = {}
    for scheme in ("bf16", f"tova-b{budget}-s4", f"qfilters-b{budget}-s4-r{budget // 4}"):
        caches = mlxkv.make_cache(model, scheme)
        mx.eval(model(mx.array(toks[:context])[None], cache=caches))
        pos = [context]

        def step(caches=caches, pos=pos):
            i = pos[0] = pos[0] + 1
            mx.eval(model(mx.array([[toks[i % len(toks)]]]), cache=caches))

        out[scheme] = median_seconds(step, steps, warmup=3)
    return {
        "model": "seeded/llama@0 (4 layers, 2 kv heads, head_dim 64, bf16)",
        "context": context,
        "step_s": out,
        "vs_plain": {n: s / out["bf16"] for n, s in out.items()},
    }


def main():
    t0 = time.time()
    results = {
        "tova_prefill": tova_prefill(),
        "tova_decode": tova_decode(),
        "qfilters_prefill": qfilters_prefill(),
        "cache_decode_vs_plain": cache_decode_vs_plain(),
        "model_decode_vs_plain": model_decode_vs_plain(),
    }
    results["wall_s"] = time.time() - t0
    out = write_result("eviction", results)

    ms = lambda s: f"{s * 1e3:9.2f} ms"
    tp, td = results["tova_prefill"], results["tova_decode"]
    print(f"eviction benchmarks on {mx.default_device()} (mlx {mx.__version__}), B={B} H={H} D={D}")
    print(
        f"TOVA prefill {tp['tokens']} tok @ budget {tp['budget']}: vectorized {ms(tp['vectorized_s'])} | "
        f"reference loop {ms(tp['reference_s'])} | x{tp['speedup']:.1f}"
    )
    print(
        f"TOVA decode step @ budget {td['budget']}:        vectorized {ms(td['vectorized_step_s'])} | "
        f"reference loop {ms(td['reference_step_s'])} | x{td['speedup']:.1f} | "
        f"plain append {ms(td['plain_append_step_s'])}"
    )
    q = results["qfilters_prefill"]
    print(f"Q-Filters prefill {q['tokens']} tok @ budget {q['budget']} (calibrated):")
    for r in q["rows"]:
        label = "one-shot" if r["chunk"] == q["tokens"] else f"chunk {r['chunk']}"
        print(
            f"  {label:>10}: {ms(r['seconds'])}  x{r['vs_one_shot']:.2f} of one-shot  "
            f"identical={r['identical_to_one_shot']}"
        )
    c = results["cache_decode_vs_plain"]
    print(f"Cache decode step (append + 1-query attention), eviction caches hold {c['budget']} of {c['context']}:")
    for n, s in c["step_s"].items():
        print(f"  {n:>16}: {ms(s)}  x{c['vs_plain_same_rows'][n]:.2f} of plain@{c['budget']}")
    m = results["model_decode_vs_plain"]
    print(f"Model decode step ({m['model']}, context {m['context']}):")
    for n, s in m["step_s"].items():
        print(f"  {n:>22}: {ms(s)}  x{m['vs_plain'][n]:.2f} of bf16")
    print(f"wall {results['wall_s']:.0f} s -> {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
