"""Snapshot save/load throughput against two baselines measured side by side in one run.

A multi-layer bf16 cache (default 16 layers of [1, 8, 4096, 128] K and V = 256 MiB) is
written and read back by
  (a) raw numpy: the same bytes with ``ndarray.tofile`` / ``np.fromfile`` + ``mx.array``,
  (b) mlx-lm: ``save_prompt_cache`` (+ fsync of the file) / ``load_prompt_cache`` + mx.eval,
  (c) mlxkv: ``mlxkv.save`` (atomic, fsync) / ``mlxkv.load`` (every CRC-32 verified) + mx.eval.
Each is repeated, interleaved, and the medians are compared as ratios. Every load follows the
matching save, so it reads from the page cache (the comparison is of CPU work), except the
``*_cold`` loads, which first evict their file from the page cache (posix_fadvise) and so
read from the disk, as a resume on a fresh machine does.

Targets (issue 2, point 11): mlxkv save <= 1.0x mlx-lm save; mlxkv verified load <= 1.5x
mlx-lm load + eval; mlxkv file <= logical bytes + header.

``--independent`` measures the other way, closer to use: every repeat builds fresh caches
of both kinds with ``update_and_fetch`` (their own memory, mlx-lm's and mlxkv's step
growth), unlinks both files before saving, and evaluates every restored array; it reports
the ratio of each repeat (median, quartiles, range), not only the ratio of medians.

Usage: python -m benchmarks.snapshot_io [--layers 16 --tokens 4096 --repeats 5 --dir DIR] [--independent]
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

import mlxkv
from benchmarks.common import RESULTS, machine
from mlxkv.io.safetensors import read_safetensors_header
from mlxkv.io.tensor_reader import TensorReader


def build_arrays(layers, heads, tokens, dim):
    keys = mx.random.split(mx.random.key(0), 2 * layers)
    out = []
    for i in range(layers):
        k = mx.random.normal((1, heads, tokens, dim), key=keys[2 * i]).astype(mx.bfloat16)
        v = mx.random.normal((1, heads, tokens, dim), key=keys[2 * i + 1]).astype(mx.bfloat16)
        mx.eval(k, v)
        out.append((k, v))
    return out


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the three contenders -------------------------------------------------------------------


def numpy_save(path, arrays):
    with open(path, "wb") as f:
        for k, v in arrays:
            for a in (k, v):
                np.asarray(a.view(mx.uint16)).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def numpy_load(path, arrays):
    out = []
    with open(path, "rb") as f:
        for k, v in arrays:
            pair = []
            for a in (k, v):
                raw = np.fromfile(f, dtype=np.uint16, count=a.size)
                pair.append(mx.array(raw).view(mx.bfloat16).reshape(a.shape))
            out.append(pair)
    mx.eval(out)
    return out


def mlx_lm_caches(arrays):
    caches = []
    for k, v in arrays:
        c = mlx_cache.KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]  # exactly full: no 256-row slack
        caches.append(c)
    return caches


def mlx_lm_save(path, caches):
    mlx_cache.save_prompt_cache(path, caches)
    fsync_path(path)


def mlx_lm_load(path):
    caches = mlx_cache.load_prompt_cache(path)
    mx.eval([c.state for c in caches])
    return caches


def mlxkv_caches(arrays):
    caches = []
    for k, v in arrays:
        c = mlxkv.KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        caches.append(c)
    return caches


def mlxkv_save(path, caches, tokens):
    mlxkv.save(path, caches, tokens)


def mlxkv_load(path, verify=True):
    snap = mlxkv.load(path, verify=verify)
    mx.eval([c.state for c in snap.caches])
    return snap


def exact_load(path):
    """The alternative the design rejected: the same validation and verified reads, plain
    KV restored position-exact (no slack), so the first append copies the cache instead."""
    header = mlxkv.read_header(path)
    caches = []
    with TensorReader(read_safetensors_header(path)) as reader:
        for entry in header["caches"]:
            t = {s["slot"]: reader.read(s["name"], s["crc32"]) for s in entry["tensors"]}
            c = mlxkv.KVCache()
            c.keys, c.values, c.offset = t["keys"], t["values"], entry["offset"]
            caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def append_one(caches):
    """The first decode write after a restore: one position into every layer."""
    k = mx.zeros((1,) + tuple(caches[0].keys.shape[1:2]) + (1, caches[0].keys.shape[3]), mx.bfloat16)
    mx.eval([c.update_and_fetch(k, k) for c in caches])


def cold(load, path, *args):
    """``load`` after evicting ``path`` from the page cache: the read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return load(path, *args)


def then_append(load, *args):
    caches = load(*args)
    caches = caches.caches if hasattr(caches, "caches") else caches
    append_one(caches)


PAUSE = 0.0  # seconds of rest before each measurement (set by --pause)


def timed(fn, *args, **kw):
    os.sync()  # nobody's earlier writeback lands inside this measurement
    time.sleep(PAUSE)  # this VM's disk throttles bursts: let it recover between contenders
    t0 = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t0


def fresh_caches(cls, arrays):
    """New caches holding ``arrays`` the way a prefill fills them (update_and_fetch)."""
    caches = []
    for k, v in arrays:
        c = cls()
        c.update_and_fetch(k, v)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def evaluated(caches):
    """Every restored array evaluated (slack rows included), then a first decode append."""
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs)}


def independent(args):
    arrays = build_arrays(args.layers, args.heads, args.tokens, args.dim)
    tokens = list(range(args.tokens))
    workdir = tempfile.mkdtemp(prefix="mlxkv-bench-", dir=args.dir or os.path.dirname(args.out))
    paths = {"mlx_lm": os.path.join(workdir, "mlx_lm.safetensors"), "mlxkv": os.path.join(workdir, "mlxkv.safetensors")}

    def save_lm():
        caches = fresh_caches(mlx_cache.KVCache, arrays)
        if os.path.exists(paths["mlx_lm"]):
            os.unlink(paths["mlx_lm"])
        return timed(mlx_lm_save, paths["mlx_lm"], caches)

    def save_kv():
        caches = fresh_caches(mlxkv.KVCache, arrays)
        if os.path.exists(paths["mlxkv"]):
            os.unlink(paths["mlxkv"])
        return timed(mlxkv_save, paths["mlxkv"], caches, tokens)

    def load_lm():
        return timed(lambda: append_one(evaluated(mlx_cache.load_prompt_cache(paths["mlx_lm"]))))

    def load_kv():
        return timed(lambda: append_one(evaluated(mlxkv.load(paths["mlxkv"]).caches)))

    def load_lm_only():
        return timed(lambda: evaluated(mlx_cache.load_prompt_cache(paths["mlx_lm"])))

    def load_kv_only():
        return timed(lambda: evaluated(mlxkv.load(paths["mlxkv"]).caches))

    steps = {
        "mlx_lm_save": save_lm,
        "mlxkv_save": save_kv,
        "mlx_lm_load": load_lm_only,
        "mlxkv_load": load_kv_only,
        "mlx_lm_load_then_append": load_lm,
        "mlxkv_load_then_append": load_kv,
    }
    times = {k: [] for k in steps}
    order = random.Random(1)
    try:
        for r in range(args.repeats):
            for group in (
                ("mlx_lm_save", "mlxkv_save"),
                ("mlx_lm_load", "mlxkv_load"),
                ("mlx_lm_load_then_append", "mlxkv_load_then_append"),
            ):
                names = list(group)
                order.shuffle(names)
                for name in names:
                    times[name].append(steps[name]())
            print(
                f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in times.items()),
                file=sys.stderr,
            )
    finally:
        for p_ in paths.values():
            if os.path.exists(p_):
                os.unlink(p_)
        os.rmdir(workdir)
    per_repeat = {
        what: [a / b for a, b in zip(times[f"mlxkv_{what}"], times[f"mlx_lm_{what}"])]
        for what in ("save", "load", "load_then_append")
    }
    result = {
        "mode": "independent",
        "cache": {"layers": args.layers, "shape": [1, args.heads, args.tokens, args.dim], "dtype": "bfloat16"},
        "repeats": args.repeats,
        "seconds": {k: quartiles(v) for k, v in times.items()},
        "ratio_of_medians": {
            w: statistics.median(times[f"mlxkv_{w}"]) / statistics.median(times[f"mlx_lm_{w}"]) for w in per_repeat
        },
        "per_repeat_ratio": {w: quartiles(v) for w, v in per_repeat.items()},
        "all_seconds": times,
        "machine": machine(),
    }
    with open(args.out.replace(".json", "_independent.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"independent side-by-side: fresh caches, files unlinked before saves, {args.repeats} repeats")
    for k, q in result["seconds"].items():
        print(f"  {k.ljust(26)} median {q['median'] * 1000:7.1f} ms  [{q['min'] * 1000:.0f} .. {q['max'] * 1000:.0f}]")
    print("mlxkv / mlx_lm: ratio of medians; per-repeat ratio median [q1 .. q3] (min .. max)")
    for w, q in result["per_repeat_ratio"].items():
        print(
            f"  {w.ljust(17)} {result['ratio_of_medians'][w]:.3f};  {q['median']:.3f} [{q['q1']:.3f} .. {q['q3']:.3f}]"
            f" ({q['min']:.3f} .. {q['max']:.3f})"
        )
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--pause", type=float, default=0.0, help="rest before each measurement, seconds")
    p.add_argument("--dir", default=None, help="where to write the files (default: a temp dir next to the results)")
    p.add_argument("--out", default=str(RESULTS / "snapshot_io.json"))
    p.add_argument("--independent", action="store_true", help="fresh caches, unlinked files, per-repeat ratios")
    args = p.parse_args(argv)
    global PAUSE
    PAUSE = args.pause
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.independent:
        return independent(args)

    arrays = build_arrays(args.layers, args.heads, args.tokens, args.dim)
    logical = sum(k.nbytes + v.nbytes for k, v in arrays)
    tokens = [0] * args.tokens
    lm_caches, kv_caches = mlx_lm_caches(arrays), mlxkv_caches(arrays)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mlxkv-bench-", dir=args.dir or os.path.dirname(args.out))
    paths = {n: os.path.join(workdir, f"{n}.safetensors") for n in ("numpy", "mlx_lm", "mlxkv")}

    times = {
        k: []
        for k in (
            "numpy_save",
            "numpy_load",
            "mlx_lm_save",
            "mlx_lm_load",
            "mlxkv_save",
            "mlxkv_load_verified",
            "mlxkv_load_unverified",
            "mlx_lm_load_then_append",
            "mlxkv_load_then_append",
            "exact_load",
            "exact_load_then_append",
            "mlx_lm_load_cold",
            "mlxkv_load_verified_cold",
        )
    }
    try:
        saves = {
            "numpy_save": (numpy_save, paths["numpy"], arrays),
            "mlx_lm_save": (mlx_lm_save, paths["mlx_lm"], lm_caches),
            "mlxkv_save": (mlxkv_save, paths["mlxkv"], kv_caches, tokens),
        }
        loads = {
            "numpy_load": (numpy_load, paths["numpy"], arrays),
            "mlx_lm_load": (mlx_lm_load, paths["mlx_lm"]),
            "mlxkv_load_verified": (mlxkv_load, paths["mlxkv"], True),
            "mlxkv_load_unverified": (mlxkv_load, paths["mlxkv"], False),
            "mlx_lm_load_then_append": (then_append, mlx_lm_load, paths["mlx_lm"]),
            "mlxkv_load_then_append": (then_append, mlxkv_load, paths["mlxkv"]),
            "exact_load": (exact_load, paths["mlxkv"]),
            "exact_load_then_append": (then_append, exact_load, paths["mlxkv"]),
            "mlx_lm_load_cold": (cold, mlx_lm_load, paths["mlx_lm"]),
            "mlxkv_load_verified_cold": (cold, mlxkv_load, paths["mlxkv"], True),
        }
        order = random.Random(0)
        for r in range(args.repeats):
            # every repeat runs each contender once, in a shuffled order (no position bias)
            for group in (saves, loads):
                names = list(group)
                order.shuffle(names)
                for name in names:
                    times[name].append(timed(*group[name]))
            print(
                f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in times.items()),
                file=sys.stderr,
            )

        # correctness of what was timed: mlxkv gives back the same bytes
        def identical(caches):
            return all(
                bool(mx.array_equal(c.keys[..., : c.offset, :], k).item())
                and bool(mx.array_equal(c.values[..., : c.offset, :], v).item())
                for c, (k, v) in zip(caches, arrays)
            )

        same = identical(mlxkv.load(paths["mlxkv"]).caches) and identical(exact_load(paths["mlxkv"]))
        st = read_safetensors_header(paths["mlxkv"])
        sizes = {n: os.path.getsize(p) for n, p in paths.items()}
    finally:
        for p_ in paths.values():
            if os.path.exists(p_):
                os.unlink(p_)
        os.rmdir(workdir)

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    ratios = {
        "mlxkv_save / mlx_lm_save": med["mlxkv_save"] / med["mlx_lm_save"],
        "mlxkv_save / numpy_save": med["mlxkv_save"] / med["numpy_save"],
        "mlxkv_load_verified / mlx_lm_load": med["mlxkv_load_verified"] / med["mlx_lm_load"],
        "mlxkv_load_verified / numpy_load": med["mlxkv_load_verified"] / med["numpy_load"],
        "mlxkv_load_verified_cold / mlx_lm_load_cold": med["mlxkv_load_verified_cold"] / med["mlx_lm_load_cold"],
        "mlxkv_load_unverified / mlx_lm_load": med["mlxkv_load_unverified"] / med["mlx_lm_load"],
        "mlxkv_load_then_append / mlx_lm_load_then_append": med["mlxkv_load_then_append"]
        / med["mlx_lm_load_then_append"],
        "exact_load / mlx_lm_load": med["exact_load"] / med["mlx_lm_load"],
        "exact_load_then_append / mlx_lm_load_then_append": med["exact_load_then_append"]
        / med["mlx_lm_load_then_append"],
        "mlxkv_file / (logical + header)": sizes["mlxkv"] / (logical + st.data_start),
    }
    targets = {
        "save no slower than mlx_lm (<= 1.0)": ratios["mlxkv_save / mlx_lm_save"] <= 1.0,
        "verified load within 1.5x of mlx_lm, page cache warm (<= 1.5)": ratios["mlxkv_load_verified / mlx_lm_load"]
        <= 1.5,
        "verified load within 1.5x of mlx_lm, from disk (<= 1.5)": ratios["mlxkv_load_verified_cold / mlx_lm_load_cold"]
        <= 1.5,
        "file <= logical + header": sizes["mlxkv"] <= logical + st.data_start,
    }
    result = {
        "cache": {
            "layers": args.layers,
            "shape": [1, args.heads, args.tokens, args.dim],
            "dtype": "bfloat16",
            "logical_bytes": logical,
        },
        "repeats": args.repeats,
        "median_seconds": med,
        "min_seconds": best,
        "min_ratios": {
            "mlxkv_save / mlx_lm_save": best["mlxkv_save"] / best["mlx_lm_save"],
            "mlxkv_load_verified / mlx_lm_load": best["mlxkv_load_verified"] / best["mlx_lm_load"],
            "exact_load / mlx_lm_load": best["exact_load"] / best["mlx_lm_load"],
        },
        "all_seconds": times,
        "throughput_MiB_per_s": {k: logical / v / 2**20 for k, v in med.items()},
        "file_bytes": sizes,
        "mlxkv_header_bytes": st.data_start,
        "ratios": ratios,
        "targets_met": targets,
        "roundtrip_identical": same,
        "machine": machine(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    print(
        f"cache: {args.layers} layers x K,V {[1, args.heads, args.tokens, args.dim]} bf16 = {logical / 2**20:.0f} MiB; "
        f"median of {args.repeats}"
    )
    w = max(len(k) for k in med)
    print(f"  {'':{w}}  {'median':>8}     {'min':>8}")
    for k, v in med.items():
        print(f"  {k.ljust(w)}  {v * 1000:8.1f} ms  {best[k] * 1000:8.1f} ms  {logical / v / 2**20:8.0f} MiB/s")
    print("ratios (medians):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    print("ratios (minima):")
    for k, v in result["min_ratios"].items():
        print(f"  {k}: {v:.3f}")
    print("targets:")
    for k, v in targets.items():
        print(f"  {'met ' if v else 'MISS'}  {k}")
    print(f"file bytes: {sizes}; mlxkv header {st.data_start} bytes; round trip identical: {same}")
    print(f"wrote {args.out}")
    return 0 if all(targets.values()) and same else 1


if __name__ == "__main__":
    sys.exit(main())
