"""What the benchmarks share: wall-clock timing, summaries of repeated measurements (median and
range, never the best run alone), pair-by-pair ratios against a baseline measured in the same
run, a description of the machine, and result files."""

import ctypes
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxkv.io.libc import libc_function

RESULTS = Path(__file__).resolve().parent / "results"
OPENBLAS = "libopenblas"


def timed(fn, *args, **kw) -> tuple[float, object]:
    """(wall seconds, result) of one call; ``fn`` evaluates what it computes."""
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def seconds(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn()`` after ``warmup`` calls not counted."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[0] for _ in range(repeats)]


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """The median of :func:`seconds`."""
    return statistics.median(seconds(fn, repeats, warmup))


@functools.cache
def _malloc_trim():
    return libc_function("malloc_trim", ctypes.c_size_t)  # glibc's; None elsewhere


def fresh_memory() -> None:
    """Give the memory freed so far back to the system, so the arrays allocated next are new
    pages, as in a new process. MLX's buffer cache is cleared, and glibc's malloc trims every
    arena (``malloc_trim``): it keeps freed blocks of arrays (its mmap threshold rises to the
    size of the first large block freed) and hands them out again already faulted in, which
    made a 256 MiB load that reused the previous round's blocks take half the time of one
    that did not (docs/sessions.md)."""
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def summary(values) -> dict:
    """Median, minimum, maximum and count of repeated measurements."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratios(values, baseline) -> dict:
    """The summary of ``values[i] / baseline[i]``: each pair measured in the same round, so the
    ratio holds while the machine's speed drifts between rounds."""
    return summary(v / b for v, b in zip(values, baseline, strict=True))


def blas() -> str:
    """Which BLAS MLX's matrix products run on: OpenBLAS when it is preloaded, else the
    reference BLAS of MLX's Linux CPU wheel (docs/models.md has the figures)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if OPENBLAS in preload:
        threads = os.environ.get("OPENBLAS_NUM_THREADS")
        return f"OpenBLAS (LD_PRELOAD={preload}{f', OPENBLAS_NUM_THREADS={threads}' if threads else ''})"
    return "MLX's own (Linux CPU wheel: reference BLAS)" if platform.system() == "Linux" else "MLX's own"


def machine() -> dict:
    """The machine a result was measured on, and how busy it was when the run started."""
    import mlx.core as mx

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "blas": blas(),
    }


def write_result(name: str, result: dict, path: str | None = None) -> Path:
    """Write ``result`` with the machine's description as JSON to ``path`` (default:
    ``benchmarks/results/<name>.json``); returns the path."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), **result}, indent=1))
    return out
