"""Compiled decode against the eager step: tokens per second per scheme, side by side.

For every (model, scheme) two cache lists are prefilled with the same prompt; then rounds
alternate: ``--steps`` greedy decode steps through the model (eager), then the same number
through ``mlxkv.CompiledDecoder`` (compiled), each step evaluated before the next (as
``mlx_lm.generate`` does). Each round gives one tokens/s figure per mode and one ratio
(compiled / eager); the report is the median over rounds and the range of the ratio. Warm-up
steps (the first trace, and the compiler's kernel builds) are excluded and reported apart.

Batched (``--batch-sizes``): the same, over mlxkv's batched layouts (what mlx-lm's
``BatchGenerator`` decodes over, ``BatchGenerator(mlxkv.compiled_model(model), ...)``): B serial
cache lists prefilled with prompts of different lengths, merged into one batch per layer
(``mlxkv.merge_rows``), then B rows decoded per step; tokens/s counts every row's token.

Models: the seeded llama, gemma3 and hybrid (4 layers, 128 hidden: per-step overhead
dominates), and a synthetic llama of 8 layers, 1024 hidden, 8 heads of 128 (weights
dominate). ``--model NAME`` runs a fetched real model instead (``--dtype``; its prompt a real
text through its chat template; ``--schemes``, default bf16 and turbo-k8v3). The machine's
load is not controlled: read the ranges.

``--split`` also times, in the same rounds, the model's matrix products alone: every
``nn.Linear`` (and a tied embedding's output product) applied to a ``[B, 1, in]`` input, all
in one graph evaluated per step, as the eager step runs them. Their share of the eager step
bounds what compiling can save: ``mx.compile`` fuses the elementwise work between the
products and removes per-operation dispatch, it does not make a product faster, so compiled
/ eager is at most 1 / (matmul share). It also times each attention layer's cache work alone
(the append of one position and mlx-lm's attention over the cache's read, ``attention_reads``):
compiling cannot shorten that either, so compiled / eager is at most 1 / (matmul share +
attention share), the ``compiled_ceiling``. And it counts the primitives of one eager and one
compiled step's graph (``mx.export_to_dot``: views, matrix products, the rest), times one
primitive of each kind on this backend every round (``primitive_seconds``: a chain of small
ones, their dispatch and not their arithmetic), and predicts compiled / eager from them: the
eager step over the eager step less what the primitives compiling removed cost
(``predicted_ratio``, from the medians).

Usage: python -m benchmarks.compiled_decode [--rounds 7 --steps 8 --prompt 200 --large-prompt 480
       --batch-sizes 1,4,8 --only-batched] [--model smollm2-135m --dtype float32 --split]
"""

import argparse
import io
import re
import statistics
import time
import warnings

import mlx.core as mx
import mlx.nn as nn

import mlxkv
from benchmarks.chat import text_tokens
from benchmarks.common import ratios, summary, timed, write_result
from mlxkv.models.seeded import build_model, prompt

SCHEMES = [
    ("bf16", {}),
    ("kv4", {}),
    ("kv8-g32", {}),
    ("turbo-k8v3", {}),
    ("turbo-k4v2", {}),
    ("tova-b128-s4", {}),
    ("qfilters-b128-s4-r16", {"calib_tokens": 64}),
    ("bf16", {"max_kv_size": 128}),
]
BATCHED_SCHEMES = [("bf16", {}), ("kv4", {}), ("turbo-k8v3", {})]
LARGE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 2816,
}


def label(scheme, options):
    return scheme + "".join(f" {k}={v}" for k, v in options.items())


def prefilled(model, scheme, options, tokens):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = mlxkv.make_cache(model, scheme, **options)
    logits = model(mx.array(tokens)[None], cache=caches)[:, -1]
    mx.eval(logits, [c.state for c in caches])
    return caches, mx.argmax(logits, axis=-1)[:, None]


def decode(step, caches, y, n):
    """``n`` greedy steps, each evaluated; returns (seconds, next token)."""

    def steps(y):
        for _ in range(n):
            y = mx.argmax(step(y, caches)[:, -1], axis=-1)[:, None]
            mx.eval(y)
        return y

    return timed(steps, y)


_ROWS: dict = {}  # (model id, scheme, prompt) -> prefilled rows, reused across batch sizes and modes


def batch_prefilled(model, scheme, options, tokens, B):
    """One batch per layer of B rows, row i prefilled with the last ``len(tokens) - 7 i``
    tokens (rows of different lengths: left padding, as in serving). The serial rows are
    prefilled once; every call merges fresh batches from them (merging copies)."""
    rows = _ROWS.setdefault((id(model), label(scheme, options), len(tokens)), [])
    while len(rows) < B:
        rows.append(prefilled(model, scheme, options, tokens[min(7 * len(rows), len(tokens) - 1) :]))
    batch = [mlxkv.merge_rows(list(layer)) for layer in zip(*(c for c, _ in rows[:B]))]
    return batch, mx.concatenate([y for _, y in rows[:B]], axis=0)


def matrix_products(model, B):
    """A function doing one step's matrix products of ``model`` alone, for ``B`` rows: every
    ``nn.Linear``, and the tied embedding's output product when no Linear produces the
    vocabulary, each on a ``[B, 1, in]`` input, evaluated together."""
    modules = [m for _, m in model.named_modules()]
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    outs = {m.weight.shape[0] for m in linears}
    tied = [m for m in modules if isinstance(m, nn.Embedding) and m.weight.shape[0] not in outs]
    products = [(m, m.weight.shape[1]) for m in linears] + [(m.as_linear, m.weight.shape[1]) for m in tied]
    dtype = linears[0].weight.dtype
    inputs = {n: mx.random.normal((B, 1, n)).astype(dtype) for n in {n for _, n in products}}
    mx.eval(inputs)

    def step():
        mx.eval([f(inputs[n]) for f, n in products])

    return step


def attention_reads(model, caches, B):
    """A function doing one step's cache work of ``model`` alone, for ``B`` rows: each
    attention layer's ``update_and_fetch`` of one new position and mlx-lm's
    ``scaled_dot_product_attention`` over what it returns (the scores and weighted values,
    from whatever the cache's read is: a bf16 window, TurboQuant codes), all layers
    evaluated together, then the position trimmed again. Neither is work ``mx.compile``
    can fuse away: the append is a copy into the cache, the attention its products."""
    from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

    layers = [(layer.self_attn, c) for layer, c in zip(model.layers, caches) if hasattr(layer, "self_attn")]
    attn = layers[0][0]
    dtype = attn.q_proj.weight.dtype  # as the model's projections give them
    q = mx.random.normal((B, attn.n_heads, 1, attn.head_dim)).astype(dtype)
    kv = mx.random.normal((B, attn.n_kv_heads, 1, attn.head_dim)).astype(dtype)
    h = mx.zeros((B, 1, model.args.hidden_size), dtype)
    mx.eval(q, kv, h)

    def step():
        mask = create_attention_mask(h, layers[0][1])
        outs = []
        for a, cache in layers:
            keys, values = cache.update_and_fetch(kv, kv)
            outs.append(scaled_dot_product_attention(q, keys, values, cache=cache, scale=a.scale, mask=mask))
        mx.eval(outs)
        for _, cache in layers:
            cache.trim(1)

    return step


#: primitives that make a view of their input (no arithmetic, no copy)
VIEWS = frozenset(
    {"AsStrided", "Broadcast", "ExpandDims", "Flatten", "Reshape", "Slice", "Squeeze", "Transpose", "Unflatten"}
)
PRODUCTS = frozenset({"Matmul", "QuantizedMatmul", "GatherMM", "GatherQMM"})


def graph_primitives(out: mx.array) -> dict:
    """The primitives of the graph that evaluates ``out`` (not yet evaluated), by class."""
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    names = re.findall(r'label ="([A-Za-z_]+)"', dot.getvalue())
    views = sum(n in VIEWS for n in names)
    products = sum(n in PRODUCTS for n in names)
    return {"views": views, "products": products, "other": len(names) - views - products}


def counted_step(step, caches, y):
    """One greedy decode step, its graph's primitives counted before it is evaluated:
    (counts, next token)."""
    logits = step(y, caches)[:, -1]
    counts = graph_primitives(logits)
    y = mx.argmax(logits, axis=-1)[:, None]
    mx.eval(y)
    return counts, y


def primitive_seconds(width: int, n: int = 500) -> dict:
    """Seconds this backend takes per primitive on a ``[1, 1, width]`` array: ``n`` chained
    adds (an elementwise primitive: its dispatch, output allocation and a few hundred
    flops) and ``n`` chained reshapes (a view), each chain evaluated alone."""
    x = mx.ones((1, 1, width))
    mx.eval(x)
    chains = {
        "other": lambda y: y + 1.0,
        "views": lambda y: y.reshape(1, width, 1) if y.shape[1] == 1 else y.reshape(1, 1, width),
    }
    out = {}
    for kind, op in chains.items():
        y = x
        for _ in range(n):
            y = op(y)
        out[kind] = timed(mx.eval, y)[0] / n
    return out


def compare(model, scheme, options, tokens, rounds, steps, B=None, split=False):
    if B is None:
        eager_caches, ye = prefilled(model, scheme, options, tokens)
        comp_caches, yc = prefilled(model, scheme, options, tokens)
    else:
        eager_caches, ye = batch_prefilled(model, scheme, options, tokens, B)
        comp_caches, yc = batch_prefilled(model, scheme, options, tokens, B)
    decoder = mlxkv.CompiledDecoder(model)
    eager = lambda y, c: model(y, cache=c)
    warm_eager, ye = decode(eager, eager_caches, ye, 2)
    warm_comp, yc = decode(decoder, comp_caches, yc, 2)  # the first trace and kernel builds
    primitives = {}
    if split:
        primitives["eager"], ye = counted_step(eager, eager_caches, ye)
        primitives["compiled"], yc = counted_step(decoder, comp_caches, yc)
    products = matrix_products(model, B or 1) if split else None
    reads = attention_reads(model, eager_caches, B or 1) if split else None
    te, tc, share, attention, costs = [], [], [], [], []
    for _ in range(rounds):
        t, ye = decode(eager, eager_caches, ye, steps)
        te.append(steps * (B or 1) / t)
        if products is not None:  # the products alone, right after the eager steps they are part of
            tm, _ = timed(lambda: [products() for _ in range(steps)])
            share.append(tm / t)
            ta, _ = timed(lambda: [reads() for _ in range(steps)])
            attention.append(ta / t)
            costs.append(primitive_seconds(model.args.hidden_size))
        t, yc = decode(decoder, comp_caches, yc, steps)
        tc.append(steps * (B or 1) / t)
    ratio = ratios(tc, te)
    split_row = {}
    if share:  # compiling can remove at most what is neither: compiled / eager <= 1 / (their sum)
        ceiling = [1 / (m + a) for m, a in zip(share, attention)]
        cost = {kind: statistics.median(c[kind] for c in costs) for kind in ("views", "other")}
        removed = sum(
            (primitives["eager"][kind] - primitives["compiled"][kind]) * cost[kind] for kind in ("views", "other")
        )
        eager_step = (B or 1) / statistics.median(te)
        split_row = {
            "matmul_share_of_eager_step": summary(share),
            "attention_share_of_eager_step": summary(attention),
            "compiled_ceiling": summary(ceiling),
            "primitives": primitives,
            "primitive_seconds": cost,
            "predicted_ratio": eager_step / (eager_step - removed),
        }
    return {
        "scheme": label(scheme, options),
        "eager_tok_s": statistics.median(te),
        "compiled_tok_s": statistics.median(tc),
        "ratio": ratio["median"],
        "ratio_range": [ratio["min"], ratio["max"]],
        "rounds": {"eager_tok_s": te, "compiled_tok_s": tc},  # per round, in order: the spread's source
        "warmup_s": {"eager": warm_eager, "compiled": warm_comp},
        "traces": decoder.traces,
        "eager_steps": decoder.eager_steps,
        "context_end": int(mx.array(comp_caches[-1].offset).max().item()),
        "same_tokens": mx.array_equal(ye, yc).item(),
        **split_row,
    }


def split_text(row) -> str:
    """The ``--split`` figures of a result row, as printed."""
    share = "{median:.2f} [{min:.2f}-{max:.2f}]"
    e, c, cost = row["primitives"]["eager"], row["primitives"]["compiled"], row["primitive_seconds"]
    return (
        f"  matmul share {share.format(**row['matmul_share_of_eager_step'])}"
        f"  attention share {share.format(**row['attention_share_of_eager_step'])}"
        f"  ceiling {share.format(**row['compiled_ceiling'])}"
        f"\n        primitives eager {e['other']} + {e['views']} views, compiled {c['other']} + {c['views']} views;"
        f" {cost['other'] * 1e6:.1f} us each, {cost['views'] * 1e6:.1f} us a view:"
        f" predicted x{row['predicted_ratio']:.2f}"
    )


def run(models, rounds, steps, B=None, split=False):
    out = []
    for name, model, tokens, schemes in models:
        for scheme, options in schemes:
            row = {
                "model": name,
                "prompt": len(tokens),
                **compare(model, scheme, options, tokens, rounds, steps, B, split),
            }
            if B is not None:
                row["batch"] = B
            out.append(row)
            print(
                f"{name:>7} {'' if B is None else f'B={B} '}{row['scheme']:<28} "
                f"eager {row['eager_tok_s']:7.1f} tok/s  compiled "
                f"{row['compiled_tok_s']:7.1f} tok/s  x{row['ratio']:.2f} "
                f"[{row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}]  traces {row['traces']}"
                + (split_text(row) if split else ""),
                flush=True,
            )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--large-prompt", type=int, default=480)
    ap.add_argument("--batch-sizes", default="1,4,8", help="batched rows: batch sizes ('' for none)")
    ap.add_argument("--only-batched", action="store_true", help="skip the serial rows")
    ap.add_argument("--model", help="a fetched real model (mlxkv.models.fetch) instead of the seeded ones")
    ap.add_argument("--dtype", default="float32", help="with --model: the weights' dtype")
    ap.add_argument("--schemes", default="bf16,turbo-k8v3", help="with --model: the schemes")
    ap.add_argument("--split", action="store_true", help="also time the products and the attention alone")
    ap.add_argument("--out", help="default: benchmarks/results/compiled_decode.json")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    if a.model:
        import mlx_lm

        from mlxkv.models import fetch

        model, tokenizer = mlx_lm.load(str(fetch(a.model, dtype=a.dtype)))
        schemes = [(s, {}) for s in a.schemes.split(",")]
        models = [(a.model, model, text_tokens(tokenizer, a.prompt), schemes)]
        batched = models
    else:
        seeded = ("llama", "gemma3", "hybrid")
        models = [(arch, build_model(arch), prompt(a.prompt, seed=21), SCHEMES) for arch in seeded]
        large = build_model("llama", **LARGE)
        large_schemes = [s for s in SCHEMES if s[0] in ("bf16", "kv4", "turbo-k8v3")]
        models.append(("large", large, prompt(a.large_prompt, seed=21), large_schemes))
        batched = [(name, m, tokens, list(BATCHED_SCHEMES)) for name, m, tokens, _ in (models[0], models[-1])]
    res = {
        "model": {"name": a.model, "dtype": a.dtype} if a.model else {"seeded": True, "large_config": LARGE},
        "rounds": a.rounds,
        "steps_per_round": a.steps,
        "rows": [] if a.only_batched else run(models, a.rounds, a.steps, split=a.split),
        "batched_rows": [],
    }
    for B in [int(b) for b in a.batch_sizes.split(",") if b]:
        res["batched_rows"] += run(batched, a.rounds, a.steps, B, a.split)
    res["seconds"] = time.perf_counter() - t0
    out = write_result("compiled_decode", res, a.out)
    print(f"\n{res['seconds']:.0f} s; written {out} (the machine's load is not controlled: see the ranges)")


if __name__ == "__main__":
    main()
