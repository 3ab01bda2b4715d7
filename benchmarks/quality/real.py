"""What each cache scheme costs on the real models (``python -m benchmarks.quality --model
smollm2-135m`` or ``--model gemma3-270m``; docs/choosing-a-scheme.md, docs/qfilters.md).

Parts, in this order (``--parts`` picks some; each writes the JSON table when done, the grid
after every candidate, and ``--resume`` keeps what a table already holds):

1. ``qfilters``: Q-Filters calibrated on the model's own queries (the calibration text,
   ``benchmarks/quality/texts.py``), the recipe checked against a plain uncentered SVD, and
   the method document's per-head figures measured on held-out queries: the share of heads
   with a positive mean projection on the filter, the leading component's energy share and
   its mean projection against the other components'; then, on the full-attention layers,
   how well each key score (calibrated filter, key-SVD fallback, key norm, recency) ranks
   the attention a key receives (Spearman, per kv head);
2. ``passkey``: pass-key retrieval (``mlxkv.quality.passkey_retrieval``) at the model's
   length, where its full-precision cache finds the keys, for the schemes that change
   something at that length;
3. ``text0``: the grid (``mlxkv.quality.compare_schemes``) on the first evaluation text at
   the model's contexts (``MODEL_CONTEXTS``; 1,024, 2,048 and 4,096 unless said);
4. ``text1``: the grid on the second evaluation text at 1,024 and 2,048 (a repeat).

Rows also carry ``bf16_held_bytes_per_token`` / ``bf16_marginal_bytes_per_token``: the same
caches holding bfloat16 keys and values (``mlxkv.quality.cache_bytes``), what a user of the
default bfloat16 weights holds; the run itself may use float32 weights (the default here:
with OpenBLAS preloaded they read prompts ~10x faster than bfloat16 on a Linux CPU).
"""

import json
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.common import RESULTS, machine
from mlxkv.caches.qfilters_calibration import (
    DEFAULT_MAX_SAMPLES,
    QFiltersCalibration,
    average_gqa_filters,
    collect_query_activations,
    compute_qfilters,
)
from mlxkv.caches.schemes import attention_geometry, make_cache
from mlxkv.formats.qfilters_artifact import load_qfilters, save_qfilters
from mlxkv.math.qfilters import key_svd_filter
from mlxkv.quality import (
    attention_rank_correlation,
    cache_bytes,
    compare_schemes,
    full_attention_layers,
    passkey_retrieval,
    query_anisotropy,
)

from . import texts

PARTS = ("qfilters", "passkey", "text0", "text1")


@dataclass
class RealSettings:
    dtype: str = "float32"
    contexts: tuple = (1024, 2048, 4096)
    repeat_contexts: tuple = (1024, 2048)  # the second text's
    chunk: int = 128
    window: int = 512
    continuation: int = 128
    calib_batches: int = 4
    calib_length: int = 2048
    heldout_length: int = 2048
    attention_last: int = 256
    passkey_length: int = 480
    passkey_trials: int = 3
    kv_bits: tuple = (2, 4, 8)
    turbo_pairs: tuple = ((2, 2), (4, 2), (4, 4))
    budgets: tuple = (64, 256, 1024)
    passkey_quantizers: tuple = ("kv2", "kv4", "turbo-k2v2", "turbo-k4v2")
    families: tuple = ()  # the grid's families to run (bf16, the reference, always); () = all
    extra: dict = field(default_factory=dict)


# Where each model's full-precision cache finds the key (docs/models.md; measured for Gemma
# with benchmarks.real_passkey): SmolLM2 3/3 up to ~490 tokens, Gemma 3/3 at 512 and 1,024.
PASSKEY_LENGTH = {"smollm2-135m": 480, "gemma3-270m": 1024}
# Gemma's grid stops at 2,048: its 262,144-token output head makes every scored position and
# decode step ~2.5x SmolLM2's, and the run had to fit a shared 2-core machine's evening.
MODEL_CONTEXTS = {"gemma3-270m": (1024, 2048)}


def model_id(name: str, directory: Path) -> str:
    record = json.loads((directory / "mlxkv-model.json").read_text())
    return f"mlxkv/{name}@{record['sha256'][:12]}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip()
    except OSError:
        return ""


# -- part 1: Q-Filters on the model's own activations -------------------------------------------


def _kv_group(model) -> int:
    cfg = model.args
    return cfg.num_attention_heads // cfg.num_key_value_heads


def calibrate_with_activations(model, tokenizer, name, directory, settings):
    """The calibration (``qfilters_calibration``'s three steps, as ``calibrate`` runs them) and
    the query activations it was computed from."""
    batches = texts.calibration_batches(tokenizer, settings.calib_batches, settings.calib_length)
    acts = collect_query_activations(model, [mx.array(b) for b in batches])
    n_kv = attention_geometry(model)[0]
    per_head = [None if a is None else compute_qfilters(a) for a in acts]
    filters = [None if f is None else average_gqa_filters(f, n_kv) for f in per_head]
    mx.eval([f for f in filters if f is not None])
    cal = QFiltersCalibration(
        filters,
        model_id=model_id(name, directory),
        n_samples=min(settings.calib_batches * settings.calib_length, DEFAULT_MAX_SAMPLES),
        dataset=f"{texts.calibration_text().name}: {settings.calib_batches} x {settings.calib_length} tokens",
    )
    return cal, acts, per_head


def _recipe_check(acts, per_head) -> dict:
    """The calibrated per-head filters against numpy's SVD of every calibration query:
    uncentered top right singular vector signed by sgn(1ᵀu1) (the document's recipe), and the
    centered top vector (what the recipe must not compute)."""
    cos_uncentered, cos_centered, positive = [], [], []
    for a, f in zip(acts, per_head):
        if a is None:
            continue
        x = np.asarray(a, np.float64)
        fn = np.asarray(f, np.float64)
        for h in range(x.shape[0]):
            _, _, vt = np.linalg.svd(x[h], full_matrices=False)
            v = vt[0] * np.sign(np.sum(x[h] @ vt[0]))
            _, _, vc = np.linalg.svd(x[h] - x[h].mean(axis=0), full_matrices=False)
            cos_uncentered.append(float(v @ fn[h]))
            cos_centered.append(float(abs(vc[0] @ fn[h])))
            positive.append(bool((x[h] @ fn[h]).mean() > 0))
    return {
        "heads": len(positive),
        "cosine_to_uncentered_svd": _spread(cos_uncentered),
        "abs_cosine_to_centered_svd": _spread(cos_centered),
        "positive_mean_projection_share": float(np.mean(positive)),
    }


def _spread(values) -> dict:
    v = np.asarray(values, np.float64)
    return {
        "median": float(np.median(v)),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "p10": float(np.percentile(v, 10)),
        "p90": float(np.percentile(v, 90)),
        "max": float(v.max()),
        "n": len(v),
    }


def qfilters_study(model, tokenizer, name, directory, settings, evaluation, log) -> tuple[QFiltersCalibration, dict]:
    t0 = time.perf_counter()
    cal, acts, per_head = calibrate_with_activations(model, tokenizer, name, directory, settings)
    log(f"calibrated in {time.perf_counter() - t0:.0f} s")
    recipe = _recipe_check(acts, per_head)
    group = _kv_group(model)
    del acts
    heldout = np.asarray(tokenizer.encode(evaluation[0].text)[: settings.heldout_length], np.int64)[None]
    q_acts = collect_query_activations(model, [mx.array(heldout)])
    caches = make_cache(model, "bf16")
    model(mx.array(heldout), cache=caches)
    mx.eval([c.state for c in caches])
    full = full_attention_layers(model)
    energy, ratio, pos_head, pos_kv, spearman = [], [], [], [], {}
    per_layer = []
    for i, q in enumerate(q_acts):
        if q is None:
            continue
        kv_filters = mx.repeat(cal.filters[i], group, axis=0)  # each query head's kv filter
        own = query_anisotropy(q, per_head[i])
        shared = query_anisotropy(q, kv_filters)
        energy += own["energy_share"].tolist()
        ratio += own["mean_ratio"].tolist()
        pos_head += own["positive"].tolist()
        pos_kv += shared["positive"].tolist()
        layer = {
            "layer": i,
            "full_attention": i in full,
            "energy_share": own["energy_share"].tolist(),
            "mean_ratio": own["mean_ratio"].tolist(),
            "positive_own_filter": own["positive"].tolist(),
            "positive_kv_filter": shared["positive"].tolist(),
        }
        if i in full:
            c = caches[i]
            keys = c.keys[0, :, : heldout.shape[1]]
            filt = cal.filters[i]
            fallback = key_svd_filter(keys[None, :, :128])[0]
            scorers = {
                "calibrated": lambda k, p, f=filt: mx.sum(k * f[:, None, :], axis=-1),
                "fallback": lambda k, p, f=fallback: mx.sum(k * f[:, None, :], axis=-1),
                "neg_key_norm": lambda k, p: -mx.linalg.norm(k, axis=-1),
                "recency": lambda k, p: mx.broadcast_to(p.astype(mx.float32), k.shape[:2]),
            }
            scale = model.layers[i].self_attn.scale
            rho = attention_rank_correlation(q, keys, scale, scorers, settings.attention_last)
            layer["spearman"] = {k: v.tolist() for k, v in rho.items()}
            for k, v in rho.items():
                spearman.setdefault(k, []).extend(v.tolist())
        per_layer.append(layer)
    study = {
        "calibration": {"model_id": cal.model_id, "dataset": cal.dataset, "n_samples": cal.n_samples},
        "recipe_check": recipe,
        "heldout": {
            "text": evaluation[0].name,
            "tokens": int(heldout.shape[1]),
            "query_heads": len(energy),
            "positive_share_own_filter": float(np.mean(pos_head)),
            "positive_share_kv_filter": float(np.mean(pos_kv)),
            "energy_share": _spread(energy),
            "mean_ratio": _spread(ratio),
            "spearman": {
                k: {**_spread(v), "positive_share": float(np.mean(np.asarray(v) > 0))} for k, v in spearman.items()
            },
            "spearman_last_queries": settings.attention_last,
        },
        "layers": per_layer,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return cal, study


# -- the grid -------------------------------------------------------------------------------------


def grid_candidates(settings, calibration) -> list:
    """The grid as candidates, the reference first, then in tiers so that a run cut short has
    measured every family: the middle setting of each (4-bit kv, turbo-k4v4, the middle
    budget), then the other bit settings and the smallest budget, then the largest budget."""
    from .__main__ import grid

    cases = grid(kv_bits=settings.kv_bits, pairs=settings.turbo_pairs, budgets=settings.budgets)
    if settings.families:
        cases = [c for c in cases if c.family == "bf16" or c.family in settings.families]
    budgets = sorted(settings.budgets)
    middle = budgets[len(budgets) // 2]

    def tier(c) -> int:
        if c.family == "bf16":
            return 0
        if c.setting in ("4-bit", "k4v4") or c.budget == middle:
            return 1
        return 3 if c.budget is not None and c.budget == budgets[-1] else 2

    cases.sort(key=tier)  # stable: grid order within a tier
    return [c.candidate(calibration) for c in cases]


def _with_bf16_bytes(model, cand, rows, contexts, chunk):
    measured = cache_bytes(model, cand, contexts, mx.bfloat16, chunk)
    for r in rows:
        held, marginal = measured[r["context"]]
        r["bf16_held_bytes_per_token"] = held / r["context"]
        r["bf16_marginal_bytes_per_token"] = marginal
    return rows


def run_text(model, tokenizer, table, candidates, settings, log, save, text_index, text, contexts):
    tokens = np.asarray(tokenizer.encode(text.text), np.int64)[: contexts[-1]]
    table["texts"][text_index] = text.record(len(tokens))
    done = {r["label"] for r in table["rows"] if r["text"] == text_index}
    todo = [candidates[0]] + [c for c in candidates[1:] if c.label not in done]
    log(f"text {text_index} ({text.name}): {len(todo) - 1} candidates to run, {len(done)} done")
    ref_done = candidates[0].label in done

    def store(rows, cand):
        if cand is candidates[0] and ref_done:
            return
        for r in rows:
            r["text"] = text_index
        table["rows"].extend(_with_bf16_bytes(model, cand, rows, contexts, settings.chunk))
        save()

    compare_schemes(
        model,
        [tokens],
        todo,
        contexts=contexts,
        chunk=settings.chunk,
        window=settings.window,
        continuation=settings.continuation,
        log=log,
        on_candidate=store,
    )


def run_passkey(model, tokenizer, table, candidates, settings, log, save, length):
    chosen = passkey_candidates(candidates, settings, length)
    done = {r["label"] for r in table["passkey"]}
    todo = [chosen[0]] + [c for c in chosen[1:] if c.label not in done]
    table["passkey"] = [r for r in table["passkey"] if r["label"] != chosen[0].label]

    def store(rows, cand):
        table["passkey"].extend(rows)
        save()

    passkey_retrieval(
        model, tokenizer, todo, [length], settings.passkey_trials, settings.chunk, log=log, on_candidate=store
    )


def passkey_candidates(candidates, settings, length) -> list:
    keep = [candidates[0]]
    for c in candidates[1:]:
        budget = c.tags.get("budget")
        if (budget is not None and budget < length) or c.scheme in settings.passkey_quantizers:
            keep.append(c)
    return keep


def _open_table(out: Path, resume: bool) -> dict:
    table = json.loads(out.read_text()) if resume and out.exists() else {}
    table.pop("machine", None)
    table.setdefault("rows", [])
    table.setdefault("passkey", [])
    table["texts"] = {int(k): v for k, v in table.get("texts", {}).items()}
    return table


def run(name: str, settings: RealSettings, out: Path, parts=PARTS, resume: bool = False, log=print) -> dict:
    """Run ``parts`` on model ``name``, writing the table to ``out`` as it goes."""
    import mlx_lm

    from mlxkv.models import fetch

    directory = Path(fetch(name, dtype=settings.dtype))
    model, tokenizer = mlx_lm.load(str(directory))
    evaluation, calibration_text = texts.evaluation_texts(), texts.calibration_text()
    table = _open_table(out, resume)
    table.update(
        model=name,
        model_id=model_id(name, directory),
        dtype=settings.dtype,
        settings=asdict(settings),
        commit=git_commit(),
        calibration_text={k: v for k, v in calibration_text.record(0).items() if k != "tokens"},
        shared_passages_with_calibration={t.name: texts.shared_passages(t, calibration_text) for t in evaluation},
    )
    table.setdefault("machine_at_start", machine())

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"machine": machine(), **table}, indent=1))
        tmp.replace(out)

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # make_cache: Gemma's sliding-window layers stay plain rings
        artifact = out.with_suffix(".qfilters.safetensors")
        if resume and artifact.exists() and "qfilters" not in parts:
            cal = load_qfilters(str(artifact), expect_model_id=model_id(name, directory), model=model)
            log(f"calibration loaded from {artifact}")
        else:
            cal, table["qfilters"] = qfilters_study(model, tokenizer, name, directory, settings, evaluation, log)
            save_qfilters(cal, str(artifact))
            save()
        candidates = grid_candidates(settings, cal)
        grid_args = (model, tokenizer, table, candidates, settings, log, save)
        if "passkey" in parts:
            run_passkey(*grid_args, PASSKEY_LENGTH.get(name, settings.passkey_length))
        if "text0" in parts:
            run_text(*grid_args, 0, evaluation[0], list(settings.contexts))
        if "text1" in parts:
            run_text(*grid_args, 1, evaluation[1], list(settings.repeat_contexts))
    table["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    return table


def default_out(name: str) -> Path:
    return RESULTS / f"quality-{name}.json"


def main(name: str, argv_settings: dict, out: str | None, parts, resume: bool) -> int:
    given = {k: v for k, v in argv_settings.items() if v is not None}
    if name in MODEL_CONTEXTS:
        given.setdefault("contexts", MODEL_CONTEXTS[name])
        given.setdefault("repeat_contexts", MODEL_CONTEXTS[name][:1])
    settings = RealSettings(**given)
    path = Path(out) if out else default_out(name)
    table = run(name, settings, path, parts, resume, log=lambda s: print(s, flush=True))
    print(f"wrote {path} ({len(table['rows'])} rows, {len(table['passkey'])} pass-key rows, {table['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit("run it as python -m benchmarks.quality --model NAME")
