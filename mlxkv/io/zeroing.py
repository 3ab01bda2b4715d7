"""Zeroing a run of an array's memory without touching its whole pages.

A restored cache's slack rows must read as zeros (a compiled step attends them masked, and a
masked row's weight is zero only against finite values). Writing the zeros faults in and
fills every page of them, 4,096 pages for a 256 MiB load (docs/sessions.md, "What saving
and loading cost"). On Linux a page of private anonymous memory given back with
``madvise(MADV_DONTNEED)`` reads as zeros when next touched and costs nothing until then, so
only the partial pages at a run's ends are written. MLX's CPU arrays are such memory
(the C allocator's heap or its anonymous mappings); arrays that may live elsewhere (a GPU
backend's unified or managed memory, or anything but Linux, where ``MADV_DONTNEED`` does
not promise zeros) are zeroed by writing, as is any run ``madvise`` refuses.
"""

import ctypes
import functools
import mmap
import sys

import mlx.core as mx

from .libc import libc_function

_PAGE = mmap.PAGESIZE
_MIN_RUN = 4 * _PAGE  # shorter runs are written: a system call costs more than the pages


@functools.cache
def _madvise():
    """libc's ``madvise`` where it zeroes what it is given, else None; asked at the first
    zeroing, so importing mlxkv starts no GPU runtime."""
    if sys.platform != "linux" or mx.cuda.is_available():  # (Metal is macOS only)
        return None
    return libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


_DONTNEED = 4  # MADV_DONTNEED (Linux)


def zero(view: memoryview) -> None:
    """Set the bytes of ``view`` (writable, contiguous, from an MLX array) to zero."""
    n = len(view)
    if not n:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    madvise = _madvise() if n >= _MIN_RUN else None
    if madvise is None:
        ctypes.memset(address, 0, n)
        return
    first = -address % _PAGE  # bytes before the first whole page
    pages = (n - first) // _PAGE * _PAGE
    if madvise(address + first, pages, _DONTNEED) != 0:  # pragma: no cover - refused: write them
        ctypes.memset(address, 0, n)
        return
    ctypes.memset(address, 0, first)
    ctypes.memset(address + first + pages, 0, n - first - pages)
