"""Crash consistency, concurrent replace and clean exits, run as processes really run.

    python tests/stress.py crash DIR [--kills 100]
    python tests/stress.py concurrency DIR [--savers 4 --loaders 4 --seconds 20 --format mixed]
    python tests/stress.py fresh DIR [--processes 200 --parallel 2]

Each mode prints one JSON line of counts (the tests in test_stress.py and
tests/stress_campaign.py read it).

``crash`` and ``concurrency`` run in a process that imports mlxkv and then only forks: every
saver, loader and checker is a forked child that does its MLX work itself (the parent never
starts MLX's threads, so forking stays safe), and ends with ``os._exit``. ``fresh`` runs tiny
scripts in fresh interpreters, because an abort at interpreter shutdown shows only there.

``concurrency --format`` picks what savers write: ``mlxkv`` snapshots (the default), mlx-bun
files (``mlx-bun``: formats 3 and 5 in turn), or all three in turn (``mixed``), so that a
loader also meets a file of another container renamed over the path.

What a snapshot holds identifies its save: generation ``g`` has ``tokens = [g] * T`` and
every key and value equal to ``g % 256``, so a load that mixed two files, or a torn file,
cannot pass for a whole one.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

LAYERS, HEADS, ROWS, DIM = 4, 4, 256, 64


def _caches(g: int):
    import mlx.core as mx

    import mlxkv

    caches = []
    for _ in range(LAYERS):
        c = mlxkv.KVCache()
        x = mx.full((1, HEADS, ROWS, DIM), g % 256, mx.bfloat16)
        c.update_and_fetch(x, x)
        caches.append(c)
    return caches


#: what generation ``g`` is saved as, per ``--format``: mlxkv, mlx-bun whole (format 3), blocks (5)
FORMATS = {"mlxkv": ("mlxkv",), "mlx-bun": ("whole", "blocks"), "mixed": ("mlxkv", "whole", "blocks")}


def _save(path: str, g: int, fsync: bool, pause: float = 0.0, fmt: str = "mlxkv"):
    import mlxkv
    from mlxkv.formats.mlxbun import save_mlx_bun

    def slow(done, total):
        if pause:
            time.sleep(pause)

    as_ = FORMATS[fmt][g % len(FORMATS[fmt])]
    if as_ == "mlxkv":
        mlxkv.save(path, _caches(g), [g] * ROWS, progress=slow, fsync=fsync)
    else:
        save_mlx_bun(path, _caches(g), [g] * ROWS, layout=as_, progress=slow, fsync=fsync)


def _whole(path: str):
    """(generation, None) of the snapshot at ``path``, or (None, why it is not whole)."""
    import mlx.core as mx

    import mlxkv

    try:
        snap = mlxkv.load(path)
    except mlxkv.SnapshotError as e:
        return None, f"refused: {e}"
    g = snap.tokens[0]
    if snap.tokens != [g] * ROWS:
        return None, "tokens of two saves"
    for c in snap.caches:
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        if not (mx.all(k == g % 256).item() and mx.all(v == g % 256).item()):
            return None, f"tensors of another save than its tokens ({g})"
    return g, None


def _child(fn, *args) -> int:
    """Fork; the child runs fn(*args) and exits with its return code (0 on None)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn(*args) or 0
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    return pid


def _temporaries(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if ".mlxkv-tmp." in f)


def crash(directory: str, kills: int, seed: int = 0) -> dict:
    """SIGKILL ``kills`` writers at random moments of their save; after each, a checker
    loads the path: it must hold a whole snapshot, the old one or the new one."""
    rng = random.Random(seed)
    path = os.path.join(directory, "s.safetensors")
    pid = _child(_save, path, 0, True)
    os.waitpid(pid, 0)
    result = {"kills": 0, "whole": 0, "torn": 0, "new": 0, "old": 0, "max_temporaries": 0, "problems": []}
    last = 0
    for i in range(1, kills + 1):
        pid = _child(_save, path, i, True, rng.choice((0.0, 0.002, 0.01)))
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        result["kills"] += 1
        r, w = os.pipe()
        checker = _child(_check_into, path, w)
        os.close(w)
        with os.fdopen(r) as f:
            report = json.loads(f.read() or '{"error": "no report"}')
        os.waitpid(checker, 0)
        g = report.get("generation")
        if g is None or g not in (last, i):
            result["torn"] += 1
            result["problems"].append(f"kill {i}: {report}")
        else:
            result["whole"] += 1
            result["new" if g == i else "old"] += 1
            last = g
        result["max_temporaries"] = max(result["max_temporaries"], len(_temporaries(directory)))
    result["temporaries_left"] = len(_temporaries(directory))
    return result


def _check_into(path: str, w: int):
    g, why = _whole(path)
    with os.fdopen(w, "w") as f:
        f.write(json.dumps({"generation": g, "error": why}))


def _saver(path: str, first: int, step: int, until: float, fmt: str):
    g = first
    while time.time() < until:
        _save(path, g, True, fmt=fmt)
        g += step


def _loader(path: str, until: float, w: int):
    counts = {"loads": 0, "whole": 0, "refused": 0, "mixed": 0, "examples": []}
    while time.time() < until:
        g, why = _whole(path)
        counts["loads"] += 1
        if g is not None:
            counts["whole"] += 1
        else:
            counts["refused" if why.startswith("refused") else "mixed"] += 1
            if len(counts["examples"]) < 3:
                counts["examples"].append(why[:300])
    with os.fdopen(w, "w") as f:
        f.write(json.dumps(counts))


def concurrency(directory: str, savers: int, loaders: int, seconds: float, fmt: str = "mlxkv") -> dict:
    """``savers`` processes save to one path while ``loaders`` load from it: no load may be
    refused (a whole snapshot is always there) or mix two saves."""
    path = os.path.join(directory, "s.safetensors")
    pid = _child(_save, path, 0, True, 0.0, fmt)
    os.waitpid(pid, 0)
    until = time.time() + seconds
    children, pipes = [], []
    for s in range(savers):
        children.append(_child(_saver, path, s + 1, savers, until, fmt))
    for _ in range(loaders):
        r, w = os.pipe()
        children.append(_child(_loader, path, until, w))
        os.close(w)
        pipes.append(r)
    total = {"savers": savers, "loaders": loaders, "seconds": seconds, "format": fmt}
    total.update(loads=0, whole=0, refused=0)
    total.update(mixed=0, examples=[])
    for r in pipes:
        with os.fdopen(r) as f:
            c = json.loads(f.read() or '{"loads": 0, "whole": 0, "refused": 0, "mixed": 0, "examples": ["no report"]}')
        for k in ("loads", "whole", "refused", "mixed"):
            total[k] += c[k]
        total["examples"] += c["examples"]
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in children]
    total["child_failures"] = sum(c != 0 for c in codes)
    total["temporaries_left"] = len(_temporaries(directory))
    return total


TINY = r"""
import importlib.util, sys, types

# mlxkv needs mlx_lm.models only; mlx_lm's package __init__ imports transformers (2 s of a
# 2.5 s start). Skipped, a fresh interpreter starts in 0.5 s; nothing under test changes.
spec = importlib.util.find_spec("mlx_lm")
sys.modules["mlx_lm"] = types.ModuleType("mlx_lm")
sys.modules["mlx_lm"].__path__ = list(spec.submodule_search_locations)

import mlx.core as mx
import mlxkv

path, mode = sys.argv[1], sys.argv[2]
if mode == "refused-after-read":  # tensor bytes read, then the checksum refuses the load
    try:
        mlxkv.load(path)
    except mlxkv.CorruptSnapshotError:
        pass
    else:
        sys.exit(3)
elif mode == "load":
    snap = mlxkv.load(path)
    mx.eval([c.state for c in snap.caches])
elif mode == "convert-without-tokens":  # the mlx-lm file is read whole, then refused
    try:
        mlxkv.convert_prompt_cache(path, path + ".out")
    except mlxkv.SnapshotError:
        pass
    else:
        sys.exit(3)
"""


def fresh(directory: str, processes: int, parallel: int) -> dict:
    """``processes`` fresh interpreters that load (or are refused after reading) and exit:
    every one must exit with status 0."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    import mlxkv

    good = os.path.join(directory, "good.safetensors")
    _save(good, 7, False)
    damaged = os.path.join(directory, "damaged.safetensors")
    _save(damaged, 8, False)
    with open(damaged, "r+b") as f:  # one bit of the last tensor
        f.seek(-7, 2)
        b = f.read(1)
        f.seek(-7, 2)
        f.write(bytes([b[0] ^ 1]))
    lm = os.path.join(directory, "mlx-lm.safetensors")
    caches = [mlx_cache.KVCache() for _ in range(2)]
    for c in caches:
        x = mx.ones((1, 2, 24, 64), mx.bfloat16)
        c.update_and_fetch(x, x)
    mlx_cache.save_prompt_cache(lm, caches)
    script = os.path.join(directory, "tiny.py")
    with open(script, "w") as f:
        f.write(TINY)
    jobs = [
        (damaged, "refused-after-read"),
        (lm, "convert-without-tokens"),
        (good, "load"),
    ]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    codes, errors = [], []
    running = []
    for i in range(processes):
        target, mode = jobs[i % len(jobs)]
        running.append(
            subprocess.Popen([sys.executable, script, target, mode], stderr=subprocess.PIPE, text=True, env=env)
        )
        if len(running) >= parallel or i == processes - 1:
            for p in running:
                _, err = p.communicate(timeout=120)
                codes.append(p.returncode)
                if p.returncode != 0:
                    errors.append(f"exit {p.returncode}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
            running = []
    del mlxkv
    return {
        "processes": len(codes),
        "clean": codes.count(0),
        "abnormal": len(codes) - codes.count(0),
        "errors": errors[:5],
    }


LOCK_AND_DIE = r"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("temporaries", sys.argv[1])
temporaries = importlib.util.module_from_spec(spec)
spec.loader.exec_module(temporaries)
for _ in range(int(sys.argv[3])):
    pid = os.fork()
    if pid == 0:
        fd, tmp = temporaries.create(sys.argv[2])
        os.write(fd, b"half a snapshot")
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding its lock, like a killed writer
    os.waitpid(pid, 0)
"""


def killed_writers(target: str, n: int) -> list[str]:
    """Leave the temporaries of ``n`` writers of ``target`` SIGKILLed mid-write (forked from
    a small process that imports only io/temporaries.py); returns the directory's
    temporaries afterwards."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module = os.path.join(here, "mlxkv", "io", "temporaries.py")
    subprocess.run([sys.executable, "-c", LOCK_AND_DIE, module, target, str(n)], check=True)
    return _temporaries(os.path.dirname(target))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("crash", "concurrency", "fresh"))
    p.add_argument("dir")
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--savers", type=int, default=4)
    p.add_argument("--loaders", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--processes", type=int, default=200)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=tuple(FORMATS), default="mlxkv")
    args = p.parse_args(argv)
    # imported before any fork, so children share them (``import mlxkv`` alone is light, and so
    # are the formats and the kind records: the live caches, and mlx-lm with them, come when a
    # cache is first built; a child that imported them itself would spend its seconds on it)
    import mlxkv.caches.masks  # noqa: F401
    import mlxkv.caches.plain  # noqa: F401
    import mlxkv.caches.transition  # noqa: F401
    import mlxkv.formats.table  # noqa: F401
    import mlxkv.kinds.records  # noqa: F401

    if args.mode == "crash":
        out = crash(args.dir, args.kills, args.seed)
    elif args.mode == "concurrency":
        out = concurrency(args.dir, args.savers, args.loaders, args.seconds, args.format)
    else:
        out = fresh(args.dir, args.processes, args.parallel)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
