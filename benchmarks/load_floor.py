"""Where a verified load's time goes, step by step from MLX's own reader to ``mlxkv.load``.

One snapshot of fresh caches (``update_and_fetch``, as snapshot_io.py builds them) and mlx-lm's
file of the same caches, on the page cache; every round times each step below once, in a
shuffled order, every array evaluated, the freed memory given back first (every array is
allocated afresh, as in a new process):

1. ``load_prompt_cache``: mlx-lm's load (the baseline of snapshot_io.py);
2. ``mx.load(path)``: MLX's own reader of the file (four threads, one ``pread`` per tensor);
3. the smallest stand-in stream: ``mx.load`` of a Python file object whose ``readinto`` reads
   each tensor with two ``preadv`` calls (one on a helper thread), nothing else: the floor
   of any load MLX makes through Python;
4. mlxkv's stand-in stream (``TensorReader.read_all``), no checksum, the stored shapes;
5. the same with the slack rows a restored cache gets (the next 256-row step);
6. and 7. steps 4 and 5 with every CRC-32 verified (``mlxkv.formats.mlxkv.read``: the header
   checked, no caches built): what the checksum adds to each;
8. ``mlxkv.load(verify=False)``: header checks and caches on top;
9. ``mlxkv.load``: every CRC-32 verified.

Each step's result is its per-round ratio to step 1, median [min-max].

Usage: python -m benchmarks.load_floor [--layers 16 --tokens 4096 --repeats 15 --dir DIR]
"""

import os
import random
import tempfile
import time

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

import mlxkv
from benchmarks.common import fresh_memory, ratios, summary, write_result
from benchmarks.snapshot_io import build_arrays, cache_arguments, fresh_caches
from mlxkv.formats.mlxkv import read
from mlxkv.io.safetensors import CRC32, io_pool, read_safetensors_header
from mlxkv.io.tensor_reader import TensorReader, _LoadStream, _Target


class MinimalStream(_LoadStream):
    """A stand-in safetensors file for the tensors of ``header``: mlxkv's stand-in (its header
    and file methods), each tensor read with two ``preadv`` calls, the second half on the
    helper thread, and nothing else."""

    def __init__(self, fd, header):
        targets = [_Target(info, None, None, CRC32) for info in header.tensors.values()]
        super().__init__(fd, sorted(targets, key=lambda t: t.info.begin), None)
        self.begins = {start: t.info.begin for start, t in self.spans}  # stand-in offset -> file offset

    def readinto(self, b):
        out, n = memoryview(b).cast("B"), len(b)
        if self.pos < len(self.head):  # MLX reads the header in its own calls
            out[:] = self.head[self.pos : self.pos + n]
        else:
            begin, half = self.begins[self.pos - len(self.head)], n // 2
            helper = io_pool().submit(os.preadv, self.fd, [out[half:]], begin + half)
            os.preadv(self.fd, [out[:half]], begin)
            helper.result()
        self.pos += n
        return n


def arrays_of(caches):
    return [a for c in caches for a in (c.keys, c.values)]


def steps(kv, lm, header, rows):
    def minimal():
        fd = os.open(kv, os.O_RDONLY)
        try:
            return list(mx.load(MinimalStream(fd, header), format="safetensors").values())
        finally:
            os.close(fd)

    def read_all(slack):
        with TensorReader(header) as r:
            return list(r.read_all([(n, None, rows if slack else None) for n in header.tensors]).values())

    return {
        "load_prompt_cache (mlx-lm)": lambda: arrays_of(mlx_cache.load_prompt_cache(lm)),
        "mx.load(path)": lambda: list(mx.load(lm).values()),
        "smallest stand-in stream": minimal,
        "mlxkv stream, stored shapes": lambda: read_all(False),
        "mlxkv stream, slack rows": lambda: read_all(True),
        "mlxkv stream, stored shapes, verified": lambda: list(read(kv, slack=False)[1].values()),
        "mlxkv stream, slack rows, verified": lambda: list(read(kv)[1].values()),
        "mlxkv.load, not verified": lambda: arrays_of(mlxkv.load(kv, verify=False).caches),
        "mlxkv.load, verified": lambda: arrays_of(mlxkv.load(kv).caches),
    }


def run(args):
    arrays = build_arrays(args.layers, args.heads, args.tokens, args.dim)
    workdir = tempfile.mkdtemp(prefix="mlxkv-floor-", dir=args.dir)
    kv, lm = os.path.join(workdir, "mlxkv.safetensors"), os.path.join(workdir, "mlx_lm.safetensors")
    try:
        mlxkv.save(kv, fresh_caches(mlxkv.KVCache, arrays), list(range(args.tokens)))
        mlx_cache.save_prompt_cache(lm, fresh_caches(mlx_cache.KVCache, arrays))
        header = read_safetensors_header(kv)
        rows = mlxkv.load(kv).caches[0].keys.shape[2]  # the rows a restored cache holds
        tasks = steps(kv, lm, header, rows)
        times = {name: [] for name in tasks}
        order = random.Random(0)
        for fn in tasks.values():  # imports and first-call costs outside the rounds
            mx.eval(fn())
        for r in range(args.repeats):
            names = list(tasks)
            order.shuffle(names)
            for name in names:
                fresh_memory()
                t0 = time.perf_counter()
                mx.eval(tasks[name]())
                times[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.repeats} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for path in (kv, lm):
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(workdir)
    base = times["load_prompt_cache (mlx-lm)"]
    return {
        "cache": {"layers": args.layers, "shape": [1, args.heads, args.tokens, args.dim], "dtype": "bfloat16"},
        "restored_rows": rows,
        "repeats": args.repeats,
        "dir": args.dir or tempfile.gettempdir(),
        "steps": {name: {"seconds": summary(t), "ratio": ratios(t, base)} for name, t in times.items()},
    }


def main(argv=None):
    p = cache_arguments(__doc__.split("\n")[0], repeats=15)
    p.add_argument("--out", default=None, help="default: benchmarks/results/load_floor.json")
    args = p.parse_args(argv)
    res = run(args)
    out = write_result("load_floor", res, args.out)
    print(f"\nper-round ratio to load_prompt_cache, median [min-max]; {res['repeats']} rounds")
    for name, s in res["steps"].items():
        r = s["ratio"]
        print(f"{name:38} {s['seconds']['median'] * 1e3:7.1f} ms  {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
