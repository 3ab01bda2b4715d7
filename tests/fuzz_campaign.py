"""The fuzz suite at full size: seeded damaged and crafted snapshots, outcomes classified.

    python tests/fuzz_campaign.py [--cases 50000 --seed 0 --workers 2] [--container mlx-bun]

Cases are tests/fuzzing.py's (every persisted kind, the three seeded architectures; bit
flips, truncations, appended bytes, valid-JSON edits of both headers, crafted headers with
recomputed checksums, hostile sizes). They run in worker processes, each case in-process
under a watchdog; a worker that dies (a crash) or stops answering (a hang the watchdog could
not interrupt) is replaced and the case it was on is recorded as that defect. Prints the
table of outcomes per mutation and exits 1 if any case is a defect. ``--container mlx-bun``
runs tests/fuzzing_mlxbun.py's cases instead: mlx-bun cache files (formats 3, 4, 5) bit
flipped, cut, crafted, hostile, JSON bombs, damaged blocks.

    python tests/fuzz_campaign.py --parity 5000

reads the first cases with mlxkv and with the independent TypeScript reader of
fixtures/ts (built with ``npm ci --prefix fixtures/ts && npm run build --prefix fixtures/ts``)
and counts the files on which they disagree (one loads, the other refuses): docs/format.md
is meant to make every reader refuse the same files.
"""

import argparse
import collections
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STALL_SECONDS = 120.0  # a worker silent this long on one case is hung beyond the watchdog
CONTAINERS = ("mlxkv", "mlx-bun")


class Suite:
    """The cases of one container: mlxkv snapshots (tests/fuzzing.py) or mlx-bun files
    (tests/fuzzing_mlxbun.py), each in a working directory of its own."""

    def __init__(self, container: str, directory: str):
        import fuzzing

        self.bun = container == "mlx-bun"
        os.makedirs(directory, exist_ok=True)
        if self.bun:
            import fuzzing_mlxbun

            self.module, self.corpus = fuzzing_mlxbun, fuzzing_mlxbun.BunCorpus(directory)
        else:
            self.module, self.corpus = fuzzing, fuzzing.Corpus()
        self.path = os.path.join(directory, f"case-{os.getpid()}.safetensors")

    def case(self, seed: int, i: int) -> tuple:
        """(base, mutation, bytes, expectation, block edits)."""
        if self.bun:
            return self.module.make_case(self.corpus, seed, i)
        return (*self.module.make_case(self.corpus, seed, i), {})

    def run(self, name, data, expect, edits, with_model) -> tuple[str, str]:
        if self.bun:
            return self.module.run_bun_case(self.corpus, name, data, expect, edits, with_model)
        return self.module.run_case(self.corpus, self.path, name, data, expect, with_model)


def worker(seed: int, start: int, stop: int, directory: str, container: str = "mlxkv") -> int:
    suite = Suite(container, os.path.join(directory, f"w{os.getpid()}"))
    for i in range(start, stop):
        print(json.dumps({"start": i}), flush=True)
        name, mutation, data, expect, edits = suite.case(seed, i)
        outcome, detail = suite.run(name, data, expect, edits, with_model=i % 4 == 0)
        print(
            json.dumps({"i": i, "base": name, "mutation": mutation, "outcome": outcome, "detail": detail}), flush=True
        )
    return 0


class Worker:
    """A worker process; a thread forwards each line it prints (then None at its end)."""

    def __init__(self, seed, start, stop, directory, lines: queue.Queue, container="mlxkv"):
        self.stop = stop
        self.current = None
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--seed", str(seed), "--start", str(start), "--stop", str(stop)]
            + ["--dir", directory, "--container", container],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.last = time.monotonic()
        threading.Thread(target=self._forward, args=(lines,), daemon=True).start()

    def _forward(self, lines):
        for line in self.proc.stdout:
            lines.put((self, line))
        lines.put((self, None))


def run(cases: int, seed: int, workers: int, directory: str, log=print, container="mlxkv"):
    import fuzzing

    per = -(-cases // workers)
    lines = queue.Queue()
    active = {
        Worker(seed, k * per, min(cases, (k + 1) * per), directory, lines, container)
        for k in range(workers)
        if k * per < cases
    }
    table = collections.Counter()
    defects = []
    done, t0 = 0, time.monotonic()

    def record(i, mutation, outcome, detail, base=""):
        nonlocal done
        table[(mutation, outcome)] += 1
        done += 1
        if outcome in fuzzing.DEFECTS:
            defects.append({"i": i, "base": base, "mutation": mutation, "outcome": outcome, "detail": detail})
        if done % 5000 == 0:
            log(f"  {done}/{cases} cases, {time.monotonic() - t0:.0f} s, {len(defects)} defects", file=sys.stderr)

    suite = None
    while active:
        try:
            w, line = lines.get(timeout=5.0)
        except queue.Empty:
            w, line = None, None
        if w is not None and line:
            w.last = time.monotonic()
            msg = json.loads(line)
            if "start" in msg:
                w.current = msg["start"]
            else:
                record(msg["i"], msg["mutation"], msg["outcome"], msg["detail"], msg["base"])
                w.current = None
            continue
        ended = [(w, False)] if w is not None else []  # a worker's output ended: it exited
        ended += [(x, True) for x in active if time.monotonic() - x.last > STALL_SECONDS and x is not w]
        for x, stalled in ended:
            if x not in active:  # the end of a worker already killed as hung
                continue
            if stalled:  # silent on one case beyond the watchdog: hung
                x.proc.kill()
            x.proc.wait()
            active.discard(x)
            if x.current is not None:  # the case it was on killed it, or hung it
                suite = suite or Suite(container, os.path.join(directory, "parent"))
                mutation = suite.case(seed, x.current)[1]
                why = "hang" if stalled else "crash"
                record(x.current, mutation, why, f"worker {'stalled' if stalled else f'exit {x.proc.returncode}'}")
                if x.current + 1 < x.stop:
                    active.add(Worker(seed, x.current + 1, x.stop, directory, lines, container))
    return table, defects, time.monotonic() - t0


def print_table(table, defects, cases, seconds, seed, container="mlxkv"):
    import fuzzing
    import fuzzing_mlxbun

    mutations = fuzzing_mlxbun.MUTATIONS if container == "mlx-bun" else fuzzing.MUTATIONS
    columns = list(fuzzing.OUTCOMES) + list(fuzzing.DEFECTS)
    rows = [[m] + [str(table[(m, c)]) for c in columns] + [str(sum(table[(m, c)] for c in columns))] for m in mutations]
    totals = ["total"] + [str(sum(table[(m, c)] for m in mutations)) for c in columns]
    totals.append(str(sum(table.values())))
    headers = ["mutation"] + columns + ["cases"]
    widths = [max(len(r[k]) for r in [headers, *rows, totals]) for k in range(len(headers))]
    line = lambda cells: "  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(cells, widths)))
    print(f"fuzz ({container} files): {cases} cases, seed {seed}, {seconds:.0f} s")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print(line(totals))
    print(f"defects: {len(defects)}")
    for d in defects[:20]:
        print(f"  case {d['i']} ({d['base']}, {d['mutation']}): {d['outcome']}: {d['detail']}")


def parity(cases: int, seed: int, directory: str) -> int:
    import fuzzing

    import mlxkv

    corpus = fuzzing.Corpus()
    ours = {}
    for i in range(cases):
        _, mutation, data, _ = fuzzing.make_case(corpus, seed, i)
        path = os.path.join(directory, f"case-{i:06d}.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        try:
            mlxkv.load(path)
            ours[path] = (mutation, True, "")
        except mlxkv.SnapshotError as e:
            ours[path] = (mutation, False, f"{type(e).__name__}: {str(e)[len(path) + 2 :][:200]}")
    check = os.path.join(ROOT, "fixtures", "ts", "dist", "check.js")
    out = subprocess.run(["node", check, "--dir", directory], capture_output=True, text=True, check=True).stdout
    theirs = {v["file"]: v for v in map(json.loads, out.splitlines())}
    differ = [(p, ours[p], theirs[p]) for p in sorted(ours) if ours[p][1] != theirs[p]["ok"]]
    foreign = [p for p, v in theirs.items() if v.get("reason") == "foreign"]
    both_ok = sum(1 for p in ours if ours[p][1] and theirs[p]["ok"])
    both_refuse = sum(1 for p in ours if not ours[p][1] and not theirs[p]["ok"])
    print(
        f"parity: {cases} cases (seed {seed}): both refuse {both_refuse}, "
        f"both load {both_ok}, disagree {len(differ)}, TypeScript foreign errors {len(foreign)}"
    )
    for p, (mutation, ok, msg), t in differ[:20]:
        print(
            f"  {os.path.basename(p)} ({mutation}): mlxkv {'loads' if ok else 'refuses: ' + msg}; "
            f"TypeScript {'loads' if t['ok'] else 'refuses: ' + t.get('message', '')[:200]}"
        )
    return 1 if differ or foreign else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=50000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--container", choices=CONTAINERS, default="mlxkv", help="which files to fuzz")
    p.add_argument("--json", help="also write the table and defects here")
    p.add_argument("--parity", type=int, default=0, metavar="N", help="compare N cases with the TypeScript reader")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.seed, args.start, args.stop, args.dir, args.container)
    if args.parity:
        with tempfile.TemporaryDirectory(prefix="mlxkv-parity-") as d:
            return parity(args.parity, args.seed, d)
    with tempfile.TemporaryDirectory(prefix="mlxkv-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        table, defects, seconds = run(args.cases, args.seed, args.workers, d, container=args.container)
    print_table(table, defects, args.cases, seconds, args.seed, args.container)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": {f"{m}/{o}": n for (m, o), n in table.items()}, "defects": defects}, f, indent=1)
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
