"""``mlxkv demo``: generate under every scheme, checkpoint mid-way, restore every checkpoint in
a fresh process (``python -m mlxkv.cli _resume``), continue there, and print whether the
continued tokens and logits equal those of the run that never stopped.

Plain ``demo`` runs the seeded models of three mlx-lm architectures (built in code: fast, no
download). ``demo --model smollm2-135m`` (or ``gemma3-270m``) runs a real model fetched with
``mlxkv.models.fetch``: one chat turn (the model's chat template, or the plain text for a
model without one) answered under each scheme, checkpointed inside the answer.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

from ..errors import MLXKVError
from .output import layers_by_kind, print_table

QUICK_SCHEMES = ("bf16", "kv4", "kv4-start16")
# make_cache options per demo scheme: Q-Filters' key-SVD fallback freezes after 16 keys
# (default 128) so the demo's 48 positions include evictions
DEMO_OPTIONS = {"qfilters-b32-s4-r8": {"calib_tokens": 16}}
#: the real-model demo's question (long enough an answer that the checkpoint falls inside it)
QUESTION = "Explain in a few sentences why the sky is blue."
SLIDING_WARNING = ".*sliding-window layers stay.*"


def _scheme_available(scheme: str) -> bool:
    from ..caches.schemes import parse_scheme
    from ..errors import SchemeError

    try:
        parse_scheme(scheme)
        return True
    except SchemeError:
        return False


# -- what runs: a seeded architecture or a fetched model directory -------------------------


def _load(spec: dict):
    """The model of a manifest's model spec (without its tokenizer: Gemma 3's 262,144-piece
    tokenizer takes longer to load than its weights)."""
    if "dir" in spec:
        from pathlib import Path

        from mlx_lm.utils import load_model

        return load_model(Path(spec["dir"]))[0]
    from ..models.seeded import build_model

    return build_model(spec["seeded"], seed=spec["seed"])


def _subjects(args) -> list[dict]:
    """What the demo runs, per model: its ``label``, the ``spec`` a fresh process loads it by,
    the ``prompt`` tokens, the ``stop`` tokens (and the real model's tokenizer, ``tok``, and the
    ``model`` it was loaded with, so the weights load once)."""
    if args.model:
        import mlx_lm

        from ..models import fetch

        directory = str(fetch(args.model, dtype=args.dtype))
        spec = {"dir": directory}
        model, tokenizer = mlx_lm.load(directory)
        question = args.question or QUESTION
        prompt = (
            tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
            if tokenizer.chat_template
            else tokenizer.encode(question)
        )
        stop = sorted(tokenizer.eos_token_ids)
        subject = {"label": args.model, "spec": spec, "prompt": prompt, "stop": stop, "q": question}
        return [{**subject, "tok": tokenizer, "model": model}]
    from ..models.seeded import ARCHITECTURES, prompt

    archs = tuple(args.archs.split(",")) if args.archs else ARCHITECTURES
    tokens = prompt(args.prompt, seed=args.seed + 1)
    return [{"label": a, "spec": {"seeded": a, "seed": args.seed}, "prompt": tokens, "stop": []} for a in archs]


# -- the run that never stops, and the one resumed ----------------------------------------


def _demo_run(model, subject, scheme, workdir, before, after, sampler, seed):
    """Run, checkpoint after ``before`` tokens, continue ``after`` more; returns the row data
    and the reference continuation."""
    import mlx.core as mx
    import numpy as np

    from ..session import Session

    session = Session.start(
        model,
        subject["prompt"],
        scheme,
        sampler=sampler,
        seed=seed,
        stop_tokens=subject["stop"] or None,
        **DEMO_OPTIONS.get(scheme, {}),
    )
    first = session.generate(before)
    path = os.path.join(workdir, f"{subject['label']}-{scheme}.safetensors")
    t0 = time.perf_counter()
    session.save(path)
    save_ms = (time.perf_counter() - t0) * 1000
    kinds = [c.kind for c in session.caches]
    logits = []
    tokens = session.generate(after, lambda _, row: logits.append(np.array(row.astype(mx.float32))))
    return {
        "path": path,
        "kinds": kinds,
        "bytes": os.path.getsize(path),
        "save_ms": save_ms,
        "before": first,
        "tokens": tokens,
        "logits": np.stack(logits) if logits else np.zeros((0,)),
    }


def _resume_in_fresh_process(runs, workdir) -> dict:
    manifest = os.path.join(workdir, "manifest.json")
    with open(manifest, "w") as f:
        json.dump([{k: r[k] for k in ("spec", "path", "steps", "out")} for r in runs], f)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", "_resume", manifest],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise MLXKVError(f"the fresh resume process failed:\n{proc.stderr.strip()}")
    return {r["path"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def _collected_logits(session, steps: int) -> list:
    """Generate ``steps`` tokens; the float32 logits after each, then the token list last."""
    import mlx.core as mx
    import numpy as np

    logits = []
    tokens = session.generate(steps, lambda _, row: logits.append(np.array(row.astype(mx.float32))))
    return [*logits, tokens]


def cmd_resume(args) -> int:
    """Internal: restore every checkpoint of a demo manifest, continue, write logits."""
    import numpy as np

    from ..session import Session

    warnings.filterwarnings("ignore", message=SLIDING_WARNING)
    with open(args.manifest) as f:
        entries = json.load(f)
    models, results = {}, []
    for i, e in enumerate(entries):
        try:
            key = json.dumps(e["spec"], sort_keys=True)
            if key not in models:
                models[key] = _load(e["spec"])
            model = models[key]
            if i == 0:
                Session.restore(e["path"], model)  # warm-up: first-call costs out of the timing
            t0 = time.perf_counter()
            session = Session.restore(e["path"], model)
            load_ms = (time.perf_counter() - t0) * 1000
            logits = _collected_logits(session, e["steps"])
            tokens = logits.pop()
            np.savez(e["out"], logits=np.stack(logits) if logits else np.zeros((0,)))
            results.append({"path": e["path"], "tokens": tokens, "load_ms": load_ms})
        except Exception as err:  # reported in the parent's table
            results.append({"path": e["path"], "error": f"{type(err).__name__}: {err}"})
    print(json.dumps(results))
    return 0


# -- the command -----------------------------------------------------------------------------


def _table_row(label, scheme, run, got):
    """``(cells, failed)`` for one run and what the fresh process made of it."""
    import numpy as np

    kinds = layers_by_kind(run["kinds"])
    if got is None or "error" in got:
        msg = got["error"] if got else "no result from the fresh process"
        return [label, scheme, kinds, run["bytes"], f"{run['save_ms']:.1f}", "", "no", msg], True
    theirs = np.load(run["out"])["logits"]
    same_tokens = got["tokens"] == run["tokens"]
    diff = float(np.max(np.abs(theirs - run["logits"]), initial=0.0)) if theirs.shape == run["logits"].shape else np.inf
    cells = [label, scheme, kinds, run["bytes"], f"{run['save_ms']:.1f}", f"{got['load_ms']:.1f}"]
    return [*cells, "yes" if same_tokens else "no", f"{diff:g}"], not (same_tokens and diff == 0.0)


def _print_conversation(subject, runs):
    """The real model's answer per scheme, ``|`` where the checkpoint is."""
    tok = subject["tok"]
    print(f"user: {subject['q']}")
    for run in runs:
        if run["subject"] is subject:
            before, after = (tok.decode(run[k], skip_special_tokens=True) for k in ("before", "tokens"))
            print(f"  {run['scheme']:>20}: {' '.join((before + ' | ' + after).split())}")
    print()


def cmd_demo(args) -> int:
    from ..models.seeded import SCHEMES
    from ..state.sampler import Sampler

    warnings.filterwarnings("ignore", message=SLIDING_WARNING)
    schemes = QUICK_SCHEMES if args.quick else SCHEMES
    if args.schemes:
        schemes = tuple(args.schemes.split(","))
    before, after = (12, 6) if args.quick else (args.before, args.after)
    sampler = Sampler(
        temp=args.temperature,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )
    t_start = time.perf_counter()
    subjects = _subjects(args)

    keep = args.keep
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="mlxkv-demo-")
    workdir = keep or tmp.name
    os.makedirs(workdir, exist_ok=True)
    try:
        runs, rows = [], []
        for subject in subjects:
            model = subject["model"] if "model" in subject else _load(subject["spec"])
            for scheme in schemes:
                if not _scheme_available(scheme):
                    rows.append((subject["label"], scheme, None, "not available"))
                    continue
                try:
                    run = _demo_run(model, subject, scheme, workdir, before, after, sampler, args.seed)
                except Exception as e:  # a broken scheme is a row of the table, not a crash
                    rows.append((subject["label"], scheme, None, f"error: {type(e).__name__}: {e}"))
                    continue
                run.update(spec=subject["spec"], subject=subject, scheme=scheme, steps=after, out=run["path"] + ".npz")
                runs.append(run)
                rows.append((subject["label"], scheme, run, None))

        resumed = _resume_in_fresh_process(runs, workdir) if runs else {}

        table, failures = [], 0
        for label, scheme, run, note in rows:
            if run is None:
                table.append([label, scheme, note, "", "", "", "", ""])
                failures += note.startswith("error")
                continue
            cells, failed = _table_row(label, scheme, run, resumed.get(run["path"]))
            table.append(cells)
            failures += failed
        if args.model:
            print(f"mlxkv demo: {args.model} ({args.dtype}), one chat turn per scheme")
            _print_conversation(subjects[0], runs)
            what = f"{len(subjects[0]['prompt'])} prompt tokens"
        else:
            what = f"prompt {args.prompt} tokens"
        print(
            f"mlxkv demo: {what}, checkpoint after {before} generated, {after} more continued in a fresh process; "
            f"sampler {json.dumps(sampler.to_policy())} seed={args.seed}"
        )
        print_table(
            [
                "model" if args.model else "architecture",
                "scheme",
                "layers by kind",
                "snapshot bytes",
                "save ms",
                "load ms",
                "identical tokens",
                "max |logit diff|",
            ],
            table,
        )
        print(f"({time.perf_counter() - t_start:.1f} s)")
        return 1 if failures else 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def add_arguments(d) -> None:
    """The ``demo`` command's options."""
    d.add_argument("--model", help="a real model to fetch and run (smollm2-135m, gemma3-270m); default: seeded models")
    d.add_argument("--dtype", default="bfloat16", help="the real model's weights: float32, bfloat16 (default), q4")
    d.add_argument("--question", help=f"the real model's chat turn (default: {QUESTION!r})")
    d.add_argument("--quick", action="store_true", help="fewer schemes and tokens (for tests)")
    d.add_argument("--schemes", help="comma-separated schemes (default: the demo list)")
    d.add_argument("--archs", help="comma-separated seeded architectures (default: all)")
    d.add_argument("--prompt", type=int, default=24, help="seeded models: prompt length in tokens")
    d.add_argument("--before", type=int, default=24, help="tokens generated before the checkpoint")
    d.add_argument("--after", type=int, default=16, help="tokens continued after it")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--top-p", type=float, default=0.95)
    d.add_argument("--min-p", type=float, default=0.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--repetition-penalty", type=float, default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--keep", metavar="DIR", help="keep the snapshots in DIR")
