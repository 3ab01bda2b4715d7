"""Plots of the quality benchmark's JSON tables: quality against cache bytes per token.

The toy model's table (``quality.json``): one PNG per metric (recall, relative perplexity, KL)
at the largest context, one line per scheme family, plus recall against context length per
family at one budget. A real model's table (``quality-<model>.json``, rows with ``agreement``):
relative perplexity, KL and greedy agreement against the bytes a bfloat16 cache of that scheme
holds per token, one PNG per metric at the largest context (``real-<model>-<metric>.png``).

Usage: python -m benchmarks.quality.plot [benchmarks/results/quality.json] [--out docs/img]
       python -m benchmarks.quality.plot [benchmarks/results/quality.json] --markdown [CONTEXT ...]
"""

import argparse
import json
import os
import sys

from benchmarks.common import RESULTS

DOCS_IMG = RESULTS.parent.parent / "docs" / "img"

STYLE = {
    "bf16": ("black", "*"),
    "kv": ("tab:blue", "o"),
    "turbo": ("tab:orange", "s"),
    "tova": ("tab:green", "^"),
    "qfilters-calibrated": ("tab:red", "v"),
    "qfilters-fallback": ("tab:purple", "D"),
    "window": ("tab:gray", "x"),
}
LABEL = {
    "bf16": "bf16 (reference)",
    "kv": "kv<bits> (affine, group 64)",
    "turbo": "turbo-k<k>v<v>",
    "tova": "tova-b<budget>-s4",
    "qfilters-calibrated": "qfilters calibrated (r = budget/4)",
    "qfilters-fallback": "qfilters key-SVD fallback",
    "window": "rotating window (max_kv_size)",
}
METRICS = {
    "recall": ("recall: answer letters right (teacher-forced top-1)", False),
    "rel_ppl": ("perplexity / bf16 perplexity", True),
    "kl": ("KL(bf16 || scheme), nats per token", True),
}


def _rows(table, context):
    return [r for r in table["rows"] if r["context"] == context]


def _family_lines(ax, rows, x: str, metric: str):
    """One line per scheme family: ``metric`` against ``x`` (KL's 0 lifted onto a log axis)."""
    for family, (color, marker) in STYLE.items():
        pts = sorted((r[x], r[metric]) for r in rows if r["family"] == family)
        if not pts:
            continue
        xs, ys = zip(*pts)
        if metric == "kl":
            ys = [max(y, 1e-6) for y in ys]  # bf16's 0 on a log axis
        ax.plot(xs, ys, color=color, marker=marker, ms=8 if family == "bf16" else 5, lw=1.4, label=LABEL[family])


def plot_metric(table: dict, metric: str, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    context = max(r["context"] for r in table["rows"])
    rows = _rows(table, context)
    ylabel, logy = METRICS[metric]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    _family_lines(ax, rows, "bytes_per_token", metric)
    if metric == "recall":
        chance = table["chance"]["recall"]
        ax.axhline(chance, color="k", ls=":", lw=1)
        ax.text(ax.get_xlim()[0], chance, f" chance 1/{round(1 / chance)}", va="bottom", fontsize=8)
        ax.set_ylim(0, None)
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("cache bytes per token held at the context length (all layers)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{metric} vs cache size, context {context} tokens, quality model")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_recall_vs_context(table: dict, budget: int, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for family, (color, marker) in STYLE.items():
        pts = sorted(
            (r["context"], r["recall"])
            for r in table["rows"]
            if r["family"] == family and (r["budget"] in (None, budget))
        )
        if family == "kv":
            pts = sorted((r["context"], r["recall"]) for r in table["rows"] if r["scheme"] == "kv4")
            label = "kv4"
        elif family == "turbo":
            pts = sorted((r["context"], r["recall"]) for r in table["rows"] if r["scheme"] == "turbo-k4v4")
            label = "turbo-k4v4"
        else:
            label = LABEL[family] + ("" if family == "bf16" else f", budget {budget}")
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, marker=marker, lw=1.4, label=label)
    ax.axhline(table["chance"]["recall"], color="k", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, None)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(METRICS["recall"][0])
    ax.set_title(f"recall vs context length, eviction budget {budget}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


REAL_METRICS = {
    "rel_ppl": ("perplexity / bf16 perplexity (512 positions before the context length)", True),
    "kl": ("KL(bf16 || scheme), nats per token", True),
    "agreement": ("share of bf16's 128 greedy tokens reproduced", False),
}


def is_real(table: dict) -> bool:
    return bool(table["rows"]) and "agreement" in table["rows"][0]


def plot_real_metric(table: dict, metric: str, path: str, text: int = 0) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    context = max(r["context"] for r in table["rows"] if r["text"] == text)
    rows = [r for r in table["rows"] if r["context"] == context and r["text"] == text]
    ylabel, logy = REAL_METRICS[metric]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    _family_lines(ax, rows, "bf16_held_bytes_per_token", metric)
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if metric == "agreement":
        ax.set_ylim(0, 1.02)
    ax.set_xlabel("cache bytes per token held at the context length (bfloat16 rows, all layers)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{table['model']}: {metric} vs cache size, context {context} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def real_markdown(table: dict, context: int | None = None, text: int = 0) -> str:
    """A real model's rows at ``context`` (default: the largest) of text ``text``, with the
    pass-key counts where measured."""
    rows = [r for r in table["rows"] if r["text"] == text]
    context = context or max(r["context"] for r in rows)
    passkey = {r["label"]: r for r in table.get("passkey", [])}
    lines = [
        "| scheme | B/token (bf16) | x bf16 | rel. ppl | KL | decode KL | agreement | first miss | pass key |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in rows if r["context"] == context]
    ref = next(r for r in rows if r["family"] == "bf16")["bf16_held_bytes_per_token"]
    for r in rows:
        pk = passkey.get(r["label"])
        key = "" if pk is None else f"{pk['found']}/{pk['trials']}"
        lines.append(
            f"| {r['label']} | {r['bf16_held_bytes_per_token']:.0f} | {r['bf16_held_bytes_per_token'] / ref:.3f} "
            f"| {r['rel_ppl']:.3f} ± {r['rel_ppl_se']:.3f} | {r['kl']:.3f} | {r['decode_kl']:.3f} "
            f"| {r['agreement']:.2f} | {r['first_divergence']} | {key} |".replace("± nan", "")
        )
    return "\n".join(lines)


def plot_all(table: dict, out_dir: str, budget: int = 256) -> list:
    os.makedirs(out_dir, exist_ok=True)
    if is_real(table):
        name = table["model"]
        return [
            plot_real_metric(table, m, os.path.join(out_dir, f"real-{name}-{m.replace('_', '-')}.png"))
            for m in REAL_METRICS
        ]
    paths = [plot_metric(table, m, os.path.join(out_dir, f"quality-{m.replace('_', '-')}.png")) for m in METRICS]
    paths.append(plot_recall_vs_context(table, budget, os.path.join(out_dir, "quality-recall-context.png")))
    return paths


def markdown_table(table: dict, context: int | None = None) -> str:
    """The rows at ``context`` (default: the largest) as a markdown table."""
    context = context or max(r["context"] for r in table["rows"])
    lines = [
        "| family | setting | bytes/token | x bf16 | recall | exact | rel. ppl | KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = next(r for r in _rows(table, context) if r["family"] == "bf16")["bytes_per_token"]
    for r in _rows(table, context):
        lines.append(
            f"| {r['family']} | {r['setting']} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / ref:.3f} "
            f"| {r['recall']:.3f} | {r['recall_exact']:.3f} | {r['rel_ppl']:.4f} | {r['kl']:.2e} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", nargs="?", default=str(RESULTS / "quality.json"))
    ap.add_argument("--out", default=str(DOCS_IMG))
    ap.add_argument(
        "--markdown",
        type=int,
        nargs="*",
        metavar="CONTEXT",
        help="print the table at these contexts (none given: the largest) instead of plotting",
    )
    args = ap.parse_args(argv)
    with open(args.table) as f:
        table = json.load(f)
    measured = sorted({r["context"] for r in table["rows"]})
    show = real_markdown if is_real(table) else markdown_table
    missing = [c for c in args.markdown or [] if c not in measured]
    if missing:
        ap.error(f"{args.table} has no rows at context {missing}: it measured {measured}")
    if args.markdown is not None:
        for c in args.markdown or [None]:
            print(show(table, c), end="\n\n")
        return 0
    for p in plot_all(table, args.out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
