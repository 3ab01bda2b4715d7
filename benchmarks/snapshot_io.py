"""Snapshot save and load against mlx-lm's, the way a user saves, side by side in one run.

Every round builds fresh caches for both sides the way a prefill fills them
(``update_and_fetch`` into mlx-lm's ``KVCache`` and mlxkv's, every array evaluated before
the clock starts), then times, in a shuffled order within each pair:

- save, the target file absent (a new snapshot) and present (the previous round's file is
  overwritten, as a session saving again does): mlx-lm's ``save_prompt_cache`` plus an
  fsync of the file, against ``mlxkv.save`` (atomic: temporary file, fsync, rename, fsync of
  the directory; every tensor's CRC-32 taken);
- load from the page cache (the file just saved): ``load_prompt_cache`` against
  ``mlxkv.load`` (every CRC-32 verified, and once not), every restored array evaluated; then the same
  followed by the first decode append; and from the disk (the file evicted from the page
  cache first, posix_fadvise), as a resume on a fresh machine.

Each pair's result is the per-round ratio mlxkv / mlx-lm (median and range over rounds:
both sides of a round see the same machine), of wall time and of the process's CPU time
(user + system, every thread), which the other jobs of a shared machine disturb far less.

``--idle S`` sleeps S seconds before each timed save and load: on a VM, a thread woken on
an idle virtual CPU starts late, which a load with more thread handoffs pays more for
(docs/sessions.md).

``--reused`` measures the way this benchmark used to: each side's caches built once by
assigning the arrays (sized exactly, no ``update_and_fetch``) and saved again every round.

Targets (issue 23, point 4): save <= 1.0x, verified load from the page cache <= 1.2x,
the file = logical bytes + header.

Usage: python -m benchmarks.snapshot_io [--layers 16 --tokens 4096 --repeats 11 --dir DIR]
"""

import argparse
import os
import random
import resource
import tempfile
import time

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

import mlxkv
from benchmarks.common import fresh_memory, ratios, summary, write_result
from mlxkv.io.safetensors import read_safetensors_header


def build_arrays(layers, heads, tokens, dim):
    keys = mx.random.split(mx.random.key(0), 2 * layers)
    out = []
    for i in range(layers):
        k = mx.random.normal((1, heads, tokens, dim), key=keys[2 * i]).astype(mx.bfloat16)
        v = mx.random.normal((1, heads, tokens, dim), key=keys[2 * i + 1]).astype(mx.bfloat16)
        mx.eval(k, v)
        out.append((k, v))
    return out


def assigned_caches(cls, arrays):
    """Caches holding ``arrays`` themselves, sized exactly (``--reused``)."""
    caches = []
    for k, v in arrays:
        c = cls()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        caches.append(c)
    return caches


def fresh_caches(cls, arrays):
    """New caches holding ``arrays`` as a prefill fills them, every array evaluated."""
    caches = []
    for k, v in arrays:
        c = cls()
        c.update_and_fetch(k, v)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path):
    """Drop ``path`` from the page cache: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evaluated(caches):
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def append_one(caches):
    """The first decode write after a restore: one position into every layer."""
    k = caches[0].keys
    x = mx.zeros((1, k.shape[1], 1, k.shape[3]), mx.bfloat16)
    mx.eval([c.update_and_fetch(x, x) for c in caches])


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Side:
    """One contender: how it builds caches, saves, loads (``load(verify)``: mlx-lm has no
    checksums to verify)."""

    def __init__(self, name, cache_class, save, load, path):
        self.name, self.cache_class, self.save, self.load, self.path = name, cache_class, save, load, path


def sides(workdir, tokens):
    lm = os.path.join(workdir, "mlx_lm.safetensors")
    kv = os.path.join(workdir, "mlxkv.safetensors")

    def lm_save(caches):
        mlx_cache.save_prompt_cache(lm, caches)
        fsync_path(lm)

    return {
        "mlx_lm": Side("mlx_lm", mlx_cache.KVCache, lm_save, lambda verify: mlx_cache.load_prompt_cache(lm), lm),
        "mlxkv": Side(
            "mlxkv",
            mlxkv.KVCache,
            lambda caches: mlxkv.save(kv, caches, tokens),
            lambda verify: mlxkv.load(kv, verify=verify).caches,
            kv,
        ),
    }


def measured(fn, prepare=lambda: None, idle=0.0):
    """(wall, cpu) seconds of ``fn(prepare())``; ``prepare()`` runs before the clock, then the
    process sleeps ``idle`` seconds (a load after a pause, as a resumed session's)."""
    arg = prepare()
    time.sleep(idle)
    fresh_memory()  # both sides allocate afresh: no reuse of freed blocks
    os.sync()  # nobody's earlier writeback lands inside this measurement
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0, cpu_seconds() - c0


def run(args):
    arrays = build_arrays(args.layers, args.heads, args.tokens, args.dim)
    logical = sum(k.nbytes + v.nbytes for k, v in arrays)
    tokens = list(range(args.tokens))
    workdir = tempfile.mkdtemp(prefix="mlxkv-bench-", dir=args.dir)
    contenders = sides(workdir, tokens)
    reused = {name: assigned_caches(s.cache_class, arrays) for name, s in contenders.items()} if args.reused else None

    def save_task(side, present):
        def prepare():
            caches = reused[side.name] if reused else fresh_caches(side.cache_class, arrays)
            if not present and os.path.exists(side.path):
                os.unlink(side.path)
            return caches

        return lambda: measured(side.save, prepare, args.idle)

    def load_task(side, then_append=False, cold=False, verify=True):
        def fn(_):
            caches = evaluated(side.load(verify))
            if then_append:
                append_one(caches)

        return lambda: measured(fn, (lambda: evict(side.path)) if cold else (lambda: None), args.idle)

    pairs = {
        "save, file absent": lambda s: save_task(s, False),
        "save, file present": lambda s: save_task(s, True),
        "load, page cache": lambda s: load_task(s),
        "load, page cache, checksums not verified": lambda s: load_task(s, verify=False),
        "load then first append, page cache": lambda s: load_task(s, then_append=True),
        "load, from disk": lambda s: load_task(s, cold=True),
    }
    wall = {(p, s): [] for p in pairs for s in contenders}
    cpu = {(p, s): [] for p in pairs for s in contenders}
    order = random.Random(0)
    try:
        for s in contenders.values():  # a file to overwrite and to load in the first round
            s.save(fresh_caches(s.cache_class, arrays))
        for r in range(args.repeats):
            for pair, task in pairs.items():
                names = list(contenders)
                order.shuffle(names)
                for name in names:
                    w, c = task(contenders[name])()
                    wall[(pair, name)].append(w)
                    cpu[(pair, name)].append(c)
            print(f"round {r + 1}/{args.repeats} done, load average {os.getloadavg()[0]:.1f}", flush=True)
        loaded = contenders["mlxkv"].load(True)
        same = all(
            mx.array_equal(c.keys[..., : c.offset, :], k).item()
            and mx.array_equal(c.values[..., : c.offset, :], v).item()
            for c, (k, v) in zip(loaded, arrays)
        )
        header = read_safetensors_header(contenders["mlxkv"].path).data_start
        sizes = {name: os.path.getsize(s.path) for name, s in contenders.items()}
    finally:
        for s in contenders.values():
            if os.path.exists(s.path):
                os.unlink(s.path)
        os.rmdir(workdir)

    rows = {}
    for pair in pairs:
        kv, lm = (pair, "mlxkv"), (pair, "mlx_lm")
        rows[pair] = {
            "mlxkv_seconds": summary(wall[kv]),
            "mlx_lm_seconds": summary(wall[lm]),
            "wall_ratio": ratios(wall[kv], wall[lm]),
            "cpu_ratio": ratios(cpu[kv], cpu[lm]),
            "mlxkv_cpu_seconds": summary(cpu[kv]),
            "mlx_lm_cpu_seconds": summary(cpu[lm]),
        }
    targets = {
        "save <= 1.0x (file absent)": rows["save, file absent"]["wall_ratio"]["median"] <= 1.0,
        "save <= 1.0x (file present)": rows["save, file present"]["wall_ratio"]["median"] <= 1.0,
        "verified load <= 1.2x (page cache)": rows["load, page cache"]["wall_ratio"]["median"] <= 1.2,
        "file = logical bytes + header": sizes["mlxkv"] == logical + header,
    }
    return {
        "cache": {"layers": args.layers, "shape": [1, args.heads, args.tokens, args.dim], "dtype": "bfloat16"},
        "logical_bytes": logical,
        "file_bytes": sizes,
        "mlxkv_header_bytes": header,
        "repeats": args.repeats,
        "idle_seconds": args.idle,
        "caches": "assigned once and reused (--reused)" if args.reused else "fresh every round (update_and_fetch)",
        "rows": rows,
        "targets_met": targets,
        "roundtrip_identical": bool(same),
        "all_wall_seconds": {f"{p} / {s}": v for (p, s), v in wall.items()},
    }


def print_result(res):
    c = res["cache"]
    print(
        f"\n{c['layers']} layers x K,V {c['shape']} bf16 = {res['logical_bytes'] / 2**20:.0f} MiB, caches "
        f"{res['caches']}; {res['repeats']} rounds; per-round ratio mlxkv / mlx-lm: median [min-max]"
    )
    print(f"{'':42} {'mlx-lm ms':>10} {'mlxkv ms':>10} {'wall ratio':>20} {'cpu ratio':>20}")
    for pair, r in res["rows"].items():
        w, cr = r["wall_ratio"], r["cpu_ratio"]
        print(
            f"{pair:42} {r['mlx_lm_seconds']['median'] * 1e3:10.1f} {r['mlxkv_seconds']['median'] * 1e3:10.1f} "
            f"{w['median']:8.2f} [{w['min']:.2f}-{w['max']:.2f}] {cr['median']:8.2f} [{cr['min']:.2f}-{cr['max']:.2f}]"
        )
    print(
        f"file bytes {res['file_bytes']}; mlxkv header {res['mlxkv_header_bytes']} bytes; "
        f"round trip identical: {res['roundtrip_identical']}"
    )
    for k, v in res["targets_met"].items():
        print(f"  {'met ' if v else 'MISS'}  {k}")


def cache_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of the benchmarks that save and load one cache: its geometry, the rounds
    and where the files go."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--dir", default=None, help="where the files are written (default: the system's temp dir)")
    return p


def main(argv=None):
    p = cache_arguments(__doc__.split("\n")[0], repeats=11)
    p.add_argument("--reused", action="store_true", help="caches assigned once and saved again every round")
    p.add_argument(
        "--idle", type=float, default=0.0, help="seconds of sleep before each timed save or load (default 0)"
    )
    p.add_argument("--out", default=None, help="default: benchmarks/results/snapshot_io.json")
    args = p.parse_args(argv)
    res = run(args)
    out = write_result("snapshot_io", res, args.out)
    print_result(res)
    print(f"wrote {out} (a shared machine: see the load average in it and the ranges)")
    return 0 if all(res["targets_met"].values()) and res["roundtrip_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
