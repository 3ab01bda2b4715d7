"""What each cache scheme costs in quality, measured on the toy model (``mlxkv.models.toy``).

For every scheme of the grid and every context length, in one run:
  - recall: teacher-forced top-1 accuracy on the answer letters of associative-recall queries
    (pairs defined right after BOS, corpus text, then one query per pair at the end of the
    context; the context up to the first query is prefilled in chunks, then each query with its
    answer is one block through the cache); recall_exact: all three letters right;
  - rel_ppl: perplexity on held-out corpus text divided by bf16's, and kl: the mean
    KL(bf16 || scheme) of the next-token distributions, both over the positions after the
    first prefill chunk (the text is prefilled in chunks of ``--chunk`` tokens);
  - bytes_per_token: the caches' own ``nbytes`` summed over layers once the ``context`` text
    tokens are in (the last one as a decode step), divided by batch rows and ``context`` (held
    bytes: an eviction cache or a window holds at most its budget); ``marginal_bytes_per_token``
    sums ``bytes_per_token()``, what one more token costs.

Eviction budgets at or above the context evict nothing and are not run at that context.

Usage:
  python -m benchmarks.quality [--contexts 512 2048] [--jobs 2] [--out benchmarks/results/quality.json]
                               [--plot docs/img]
  python -m benchmarks.quality --reduced        # the CI grid, seconds
"""

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from benchmarks.common import RESULTS, write_result
from mlxkv.models import toy
from mlxkv.models.toy import data
from mlxkv.quality import Candidate, held_bytes, marginal_bytes, prefill_logprobs, text_scores

OUT = RESULTS / "quality.json"

KV_BITS = (2, 4, 8)
TURBO_PAIRS = ((2, 2), (4, 2), (4, 4), (8, 3), (8, 8))
BUDGETS = (64, 128, 256, 512, 1024)
SINKS = 4
FAMILIES = ("bf16", "kv", "turbo", "tova", "qfilters-calibrated", "qfilters-fallback", "window")


@dataclass(frozen=True)
class Case:
    """One scheme of the grid: ``family``, the ``make_cache`` scheme string, its ``setting``
    (bits, bit pair or budget) and, for budgeted families, the ``budget``."""

    family: str
    scheme: str
    setting: str
    budget: int | None = None

    def candidate(self, calibration=None) -> Candidate:
        """The case as ``mlxkv.quality.Candidate`` (labelled ``family:setting``)."""
        options = {}
        if self.family == "window":
            options = {"max_kv_size": self.budget}
        elif self.family == "qfilters-calibrated":
            options = {"qfilters_calibration": calibration}
        scheme = "bf16" if self.family == "window" else self.scheme
        tags = {"family": self.family, "setting": self.setting, "budget": self.budget}
        return Candidate(f"{self.family}:{self.setting}", scheme, options, tags)

    def caches(self, model, calibration=None) -> list:
        return self.candidate(calibration).caches(model)


def qfilters_scheme(budget: int) -> str:
    """Q-Filters with 4 sinks and a trailing window of a quarter of the budget."""
    return f"qfilters-b{budget}-s{SINKS}-r{budget // 4}"


FAMILIES = ("kv", "turbo", "tova", "qfilters-calibrated", "qfilters-fallback", "window")


def grid(reduced: bool = False, kv_bits=KV_BITS, pairs=TURBO_PAIRS, budgets=BUDGETS) -> list[Case]:
    """bf16 first (the reference), then each family over its settings; budgets in the order
    given, the four budgeted families side by side at each."""
    if reduced:
        kv_bits, pairs, budgets = (4, 8), ((8, 3),), (64,)
    cases = [Case("bf16", "bf16", "bf16")]
    cases += [Case("kv", f"kv{b}", f"{b}-bit") for b in kv_bits]
    cases += [Case("turbo", f"turbo-k{k}v{v}", f"k{k}v{v}") for k, v in pairs]
    for b in budgets:
        cases.append(Case("tova", f"tova-b{b}-s{SINKS}", str(b), b))
        cases.append(Case("qfilters-calibrated", qfilters_scheme(b), str(b), b))
        cases.append(Case("qfilters-fallback", qfilters_scheme(b), str(b), b))
        cases.append(Case("window", f"bf16 max_kv_size={b}", str(b), b))
    return cases


# -- measurements -------------------------------------------------------------------------


def calibrate(model, reduced: bool):
    """Q-Filters calibration on training-split sequences (a fixed seed, not the eval text)."""
    from mlxkv.caches.qfilters_calibration import calibrate as qf_calibrate

    n, length = (2, 256) if reduced else (4, 1024)
    x, _, _ = data.training_batch(np.random.default_rng(1234), n, length, data.corpus_split("train"))
    return qf_calibrate(model, [mx.array(x)], model_id=model.mlxkv_model_id, dataset="quality train split")


# -- the run ------------------------------------------------------------------------------


@dataclass
class Settings:
    contexts: tuple = (512, 2048)
    chunk: int = 128
    n_text: int = 2
    n_recall: int = 4
    n_pairs: int = 16
    seed: int = 0


REDUCED = Settings(contexts=(256,), chunk=64, n_text=2, n_recall=4, n_pairs=8)


def measure(model, cases: list[Case], settings: Settings, calibration=None, log: Callable = print) -> list:
    """One row per case and context; ``cases[0]`` must be bf16 (the reference)."""
    if cases[0].family != "bf16":
        raise ValueError("the first case must be bf16: the reference")
    text = data.corpus_split("eval")
    rows = []
    for L in settings.contexts:
        tokens = mx.array(data.text_batch(settings.n_text, L, text))
        recall = data.recall_batch(settings.seed + L, settings.n_recall, L, settings.n_pairs, text)
        ref_lp = ref_nll = None
        for case in cases:
            if case.budget is not None and case.budget >= L:
                continue
            t0 = time.perf_counter()
            caches = case.caches(model, calibration)
            lp = prefill_logprobs(model, caches, tokens, settings.chunk)
            ref_lp = lp if ref_lp is None else ref_lp
            nll, kl = text_scores(lp, ref_lp, tokens, settings.chunk)
            ref_nll = nll if ref_nll is None else ref_nll
            row = {
                **asdict(case),
                "context": L,
                "bytes_per_token": held_bytes(caches) / (settings.n_text * L),
                "marginal_bytes_per_token": marginal_bytes(caches),
                "ppl": math.exp(nll),
                "rel_ppl": math.exp(nll - ref_nll),
                "kl": kl,
                "seconds": 0.0,
            }
            row["recall"], row["recall_exact"] = data.recall_accuracy(
                model, case.caches(model, calibration), recall, settings.chunk
            )
            row["seconds"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            log(
                f"L={L:5d} {case.family:20s} {case.setting:6s} B/tok {row['bytes_per_token']:8.1f} "
                f"recall {row['recall']:.3f} rel_ppl {row['rel_ppl']:.4f} kl {row['kl']:.2e} {row['seconds']:.1f}s"
            )
    return rows


def _measure_in_process(reduced: bool, settings: Settings, cases: list[Case], model_dir) -> list:
    model = toy.load(model_dir)
    calibration = calibrate(model, reduced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure(model, cases, settings, calibration, log=lambda s: print(s, flush=True))


def run(
    reduced: bool = False,
    settings: Settings | None = None,
    log: Callable = print,
    model_dir=toy.MODEL_DIR,
    jobs: int = 1,
) -> dict:
    """Load the quality model, calibrate Q-Filters, evaluate the grid (reduced: the CI grid)
    and return the JSON table. ``jobs`` > 1 splits the grid over that many processes (each
    runs the bf16 reference itself; the arithmetic is the same as in one process)."""
    settings = settings or (REDUCED if reduced else Settings())
    cases = grid(reduced)
    t0 = time.perf_counter()
    if jobs <= 1:
        model = toy.load(model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = measure(model, cases, settings, calibrate(model, reduced), log)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        shares = [[cases[0]] + cases[1 + i :: jobs] for i in range(jobs)]
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_measure_in_process, [reduced] * jobs, [settings] * jobs, shares, [model_dir] * jobs))
        order = {c: i for i, c in enumerate(cases)}
        seen, rows = set(), []
        for r in sorted(
            (r for part in parts for r in part),
            key=lambda r: (r["context"], order[Case(r["family"], r["scheme"], r["setting"], r["budget"])]),
        ):
            key = (r["context"], r["family"], r["setting"])
            if key not in seen:
                seen.add(key)
                rows.append(r)
    return {
        "model": toy.model_id(model_dir),
        "config": toy.config(model_dir),
        "corpus": data.CORPUS_NAME,
        "corpus_sha256": data.corpus_sha256(),
        "settings": {
            **asdict(settings),
            "queries_per_context": settings.n_recall * settings.n_pairs,
            "sinks": SINKS,
            "qfilters_recent": "budget // 4",
            "scored_positions": "chunk .. context-2",
            "jobs": jobs,
        },
        "chance": {"recall": 1 / len(data.ALPHABET), "recall_exact": len(data.ALPHABET) ** -data.VALUE_LEN},
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a real model (smollm2-135m, gemma3-270m): benchmarks/quality/real.py's run")
    ap.add_argument("--dtype", help="--model's weights (default float32; the JSON records the BLAS)")
    ap.add_argument("--parts", nargs="+", help="--model: some of qfilters text0 passkey text1 (default: all)")
    ap.add_argument("--resume", action="store_true", help="--model: keep the rows the output file holds")
    ap.add_argument("--reduced", action="store_true", help="the reduced CI grid")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--kv-bits", type=int, nargs="+", help="--model: the kv schemes' bits (default: 2 4 8)")
    ap.add_argument("--turbo-pairs", nargs="+", metavar="K,V", help="--model: TurboQuant pairs (2,2 4,2 4,4)")
    ap.add_argument("--budgets", type=int, nargs="+", help="--model: eviction budgets (default: 64 256 1024)")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, help="--model: only these (and bf16, the reference)")
    ap.add_argument("--n-text", type=int)
    ap.add_argument("--n-recall", type=int)
    ap.add_argument("--jobs", type=int, default=1, help="processes to split the grid over")
    ap.add_argument("--out", help=f"default: {OUT.name}, or quality-reduced.json with --reduced (beside it)")
    ap.add_argument("--plot", metavar="DIR", help="also write PNG plots there (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.model:
        from benchmarks.quality import real

        overrides = {"dtype": args.dtype, "chunk": args.chunk}
        if args.contexts:
            overrides["contexts"] = tuple(args.contexts)
        if args.kv_bits:
            overrides["kv_bits"] = tuple(args.kv_bits)
        if args.turbo_pairs:
            overrides["turbo_pairs"] = tuple(tuple(int(b) for b in p.split(",")) for p in args.turbo_pairs)
        if args.budgets:
            overrides["budgets"] = tuple(args.budgets)
        if args.families:
            overrides["families"] = tuple(args.families)
        return real.main(args.model, overrides, args.out, tuple(args.parts or real.PARTS), args.resume)
    settings = REDUCED if args.reduced else Settings()
    overrides = {
        "contexts": tuple(args.contexts) if args.contexts else None,
        "chunk": args.chunk,
        "n_text": args.n_text,
        "n_recall": args.n_recall,
    }
    settings = Settings(**{**asdict(settings), **{k: v for k, v in overrides.items() if v is not None}})
    table = run(args.reduced, settings, log=lambda s: print(s, flush=True), jobs=args.jobs)
    out = write_result("quality-reduced" if args.reduced else "quality", table, args.out)
    print(f"wrote {out} ({len(table['rows'])} rows, {table['seconds']} s)")
    if args.plot:
        from benchmarks.quality import plot

        for path in plot.plot_all(table, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
