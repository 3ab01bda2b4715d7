"""The ``mlxkv`` command: ``demo``, ``inspect``, ``verify``, ``convert``, ``serve``.

``demo`` runs a seeded generation per architecture and scheme, checkpoints it mid-way,
restores every checkpoint in a fresh process (``python -m mlxkv.cli _resume``), continues
there, and prints whether the continued tokens and logits equal those of the run that never
stopped. Errors are mlxkv's own messages on stderr with exit code 1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter

from .errors import MLXKVError
from .formats.snapshot import human_bytes
from .serve.options import add_arguments as add_serve_arguments

QUICK_SCHEMES = ("bf16", "kv4", "kv4-start16")
# make_cache options per demo scheme: Q-Filters' key-SVD fallback freezes after 16 keys
# (default 128) so the demo's 48 positions include evictions
DEMO_OPTIONS = {"qfilters-b32-s4-r8": {"calib_tokens": 16}}
LARGE_FILE = 64 << 20  # progress is shown for files this large even when stderr is not a tty


# -- output helpers ---------------------------------------------------------------------


def print_table(headers: list[str], rows: list[list[str]], out=sys.stdout) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    print(line(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


class Progress:
    """A ``progress(done, total)`` callback drawing a bar on stderr when stderr is a
    terminal or the transfer is large; silent otherwise."""

    def __init__(self, label: str, stream=None, force: bool | None = None, interval: float = 0.1):
        self.label, self.stream = label, stream or sys.stderr
        self.force, self.interval = force, interval
        self.shown = False
        self._last = 0.0

    def _enabled(self, total: int) -> bool:
        if self.force is not None:
            return self.force
        isatty = getattr(self.stream, "isatty", lambda: False)()
        return isatty or total >= LARGE_FILE

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled(total):
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {pct:5.1f}% ({human_bytes(done)} of {human_bytes(total)})")
        self.shown = True
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def layers_by_kind(kinds: list[str]) -> str:
    """``["kv:plain", "ssm", "kv:plain"]`` -> ``"2 kv:plain + 1 ssm"`` (first-seen order)."""
    counts = Counter(kinds)
    return " + ".join(f"{counts[k]} {k}" for k in dict.fromkeys(kinds))


# -- inspect / verify / convert ---------------------------------------------------------


def cmd_inspect(args) -> int:
    from .formats.table import describe

    general, headers, rows = describe(args.file)  # one file, however the path is renamed over
    width = max(len(k) for k, _ in general)
    for k, v in general:
        print(f"{k.ljust(width)}  {v}")
    print()
    print_table(headers, rows, out=sys.stdout)
    return 0


def cmd_verify(args) -> int:
    from .formats.table import verify

    size = os.path.getsize(args.file) if os.path.exists(args.file) else 0
    header = verify(args.file, progress=Progress("verifying"))
    n = sum(len(e["tensors"]) for e in header["caches"])
    fmt = f"mlx-bun format v{header['formatVersion']}, " if header.get("codecProvider") == "mlx-bun" else ""
    print(f"ok: {args.file}: {fmt}{n} tensors in {len(header['caches'])} layers, {size} bytes, every checksum matches")
    return 0


def cmd_convert(args) -> int:
    from .formats.mlxlm import parse_tokens
    from .formats.table import convert
    from .state.identity import RECORDED

    tokens = parse_tokens(args.tokens) if args.tokens is not None else None
    identity = {k: getattr(args, k) for k in RECORDED if getattr(args, k) is not None}
    header = convert(args.src, args.dst, to=args.to, tokens=tokens, progress=Progress("writing"), **identity)
    kinds = [e["kind"] for e in header["caches"]]
    print(
        f"wrote {args.dst} ({args.to}): {len(kinds)} layers ({layers_by_kind(kinds)}), "
        f"{len(header['tokens'])} tokens, {os.path.getsize(args.dst)} bytes"
    )
    return 0


# -- demo -----------------------------------------------------------------------------


def _scheme_available(scheme: str) -> bool:
    from .caches.schemes import parse_scheme
    from .errors import SchemeError

    try:
        parse_scheme(scheme)
        return True
    except SchemeError:
        return False


def _demo_run(arch, model, scheme, workdir, prompt_len, before, after, sampler, seed):
    """Run, checkpoint after ``before`` tokens, continue ``after`` more; returns the row
    data and the reference continuation."""
    import mlx.core as mx
    import numpy as np

    from .models.seeded import prompt
    from .session import Session

    session = Session.start(
        model, prompt(prompt_len, seed=seed + 1), scheme, sampler=sampler, seed=seed, **DEMO_OPTIONS.get(scheme, {})
    )
    session.generate(before)
    path = os.path.join(workdir, f"{arch}-{scheme}.safetensors")
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
        "tokens": tokens,
        "logits": np.stack(logits),
    }


def cmd_demo(args) -> int:
    import numpy as np

    from .models.seeded import ARCHITECTURES, SCHEMES, build_model
    from .state.sampler import Sampler

    warnings.filterwarnings("ignore", message=".*sliding-window layers stay.*")
    schemes = QUICK_SCHEMES if args.quick else SCHEMES
    if args.schemes:
        schemes = tuple(args.schemes.split(","))
    archs = tuple(args.archs.split(",")) if args.archs else ARCHITECTURES
    before, after = (12, 6) if args.quick else (args.before, args.after)
    sampler = Sampler(
        temp=args.temperature,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )
    t_start = time.perf_counter()

    keep = args.keep
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="mlxkv-demo-")
    workdir = keep or tmp.name
    os.makedirs(workdir, exist_ok=True)
    try:
        runs, rows = [], []
        for arch in archs:
            model = build_model(arch, seed=args.seed)
            for scheme in schemes:
                if not _scheme_available(scheme):
                    rows.append((arch, scheme, None, "not available"))
                    continue
                try:
                    run = _demo_run(arch, model, scheme, workdir, args.prompt, before, after, sampler, args.seed)
                except Exception as e:  # a broken scheme is a row of the table, not a crash
                    rows.append((arch, scheme, None, f"error: {type(e).__name__}: {e}"))
                    continue
                run.update(arch=arch, scheme=scheme, steps=after, out=run["path"] + ".npz")
                runs.append(run)
                rows.append((arch, scheme, run, None))

        resumed = _resume_in_fresh_process(runs, workdir, args.seed) if runs else {}

        table, failures = [], 0
        for arch, scheme, run, note in rows:
            if run is None:
                table.append([arch, scheme, note, "", "", "", "", ""])
                failures += note.startswith("error")
                continue
            got = resumed.get(run["path"])
            if got is None or "error" in got:
                failures += 1
                msg = got["error"] if got else "no result from the fresh process"
                table.append(
                    [arch, scheme, layers_by_kind(run["kinds"]), run["bytes"], f"{run['save_ms']:.1f}", "", "no", msg]
                )
                continue
            theirs = np.load(run["out"])["logits"]
            same_tokens = got["tokens"] == run["tokens"]
            diff = (
                float(np.max(np.abs(theirs - run["logits"]))) if theirs.shape == run["logits"].shape else float("inf")
            )
            failures += not (same_tokens and diff == 0.0)
            table.append(
                [
                    arch,
                    scheme,
                    layers_by_kind(run["kinds"]),
                    run["bytes"],
                    f"{run['save_ms']:.1f}",
                    f"{got['load_ms']:.1f}",
                    "yes" if same_tokens else "no",
                    f"{diff:g}",
                ]
            )
        print(
            f"mlxkv demo: prompt {args.prompt} tokens, checkpoint after {before} generated, "
            f"{after} more continued in a fresh process; sampler {json.dumps(sampler.to_policy())} seed={args.seed}"
        )
        print_table(
            [
                "architecture",
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


def _resume_in_fresh_process(runs, workdir, seed) -> dict:
    manifest = os.path.join(workdir, "manifest.json")
    with open(manifest, "w") as f:
        json.dump([{k: r[k] for k in ("arch", "scheme", "path", "steps", "out")} for r in runs] + [{"seed": seed}], f)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    from .models.seeded import build_model
    from .session import Session

    warnings.filterwarnings("ignore", message=".*sliding-window layers stay.*")
    with open(args.manifest) as f:
        entries = json.load(f)
    seed = entries.pop()["seed"]
    models, results = {}, []
    for i, e in enumerate(entries):
        try:
            model = models.get(e["arch"]) or models.setdefault(e["arch"], build_model(e["arch"], seed=seed))
            if i == 0:
                Session.restore(e["path"], model)  # warm-up: first-call costs out of the timing
            t0 = time.perf_counter()
            session = Session.restore(e["path"], model)
            load_ms = (time.perf_counter() - t0) * 1000
            logits = _collected_logits(session, e["steps"])
            tokens = logits.pop()
            np.savez(e["out"], logits=np.stack(logits))
            results.append({"path": e["path"], "tokens": tokens, "load_ms": load_ms})
        except Exception as err:  # reported in the parent's table
            results.append({"path": e["path"], "error": f"{type(err).__name__}: {err}"})
    print(json.dumps(results))
    return 0


# -- entry point ------------------------------------------------------------------------


def cmd_serve(args) -> int:
    from .serve.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxkv", description="Snapshots of MLX key/value caches.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="generate, checkpoint, resume in a fresh process, compare")
    d.add_argument("--quick", action="store_true", help="fewer schemes and tokens (for tests)")
    d.add_argument("--schemes", help="comma-separated schemes (default: the demo list)")
    d.add_argument("--archs", help="comma-separated seeded architectures (default: all)")
    d.add_argument("--prompt", type=int, default=24, help="prompt length in tokens")
    d.add_argument("--before", type=int, default=24, help="tokens generated before the checkpoint")
    d.add_argument("--after", type=int, default=16, help="tokens continued after it")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--top-p", type=float, default=0.95)
    d.add_argument("--min-p", type=float, default=0.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--repetition-penalty", type=float, default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--keep", metavar="DIR", help="keep the snapshots in DIR")
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="print a snapshot's header (reads no tensor)")
    i.add_argument("file")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check every checksum of a snapshot")
    v.add_argument("file")
    v.set_defaults(func=cmd_verify)

    c = sub.add_parser(
        "convert", help="mlx-lm prompt-cache file, mlxkv snapshot or mlx-bun cache file -> mlxkv or mlx-bun"
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument(
        "--to",
        choices=("mlxkv", "mlx-bun"),
        default="mlxkv",
        help="the format to write: an mlxkv snapshot (default) or an mlx-bun cache file (docs/mlx-bun.md)",
    )
    c.add_argument(
        "--tokens",
        help="the token ids the cache covers: '1,2,3', '1 2 3', a JSON list, or @file "
        "(required unless the file's metadata has a 'tokens' JSON list)",
    )
    c.add_argument("--model-id", dest="model_id", help="default: the file's 'model' metadata")
    c.add_argument("--config-fingerprint", dest="config_fingerprint")
    c.add_argument("--tokenizer-hash", dest="tokenizer_hash")
    c.add_argument("--ns")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="mlx-lm's OpenAI-compatible server on mlxkv caches of one scheme")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("_resume")  # internal, used by demo
    r.add_argument("manifest")
    r.set_defaults(func=cmd_resume)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MLXKVError as e:
        print(f"mlxkv {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
