"""Atomic file replacement, shared by every writer (safetensors snapshots, mlx-bun files).

``write_file_atomically(path, fill)`` hands ``fill`` a fresh temporary file in the target's
directory; after ``fill`` returns, the file is flushed, fsynced, renamed over ``path`` and
the directory is fsynced. A crash never leaves a torn file under ``path``, and whatever was
at ``path`` survives any failure (the temporary file is removed; one a killed writer left is
recognisable and removed by a later write: temporaries.py). A write the file system
refuses raises :class:`~mlxkv.errors.SnapshotWriteError` (an ``OSError`` with its errno).
"""

import contextlib
import ctypes
import os
from collections.abc import Callable
from typing import BinaryIO, TypeVar

from ..errors import SnapshotWriteError
from . import temporaries
from .libc import libc_function

T = TypeVar("T")


#: None where the C library has none (not Linux): the final fsync then does all the writing
_SYNC_FILE_RANGE = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing ``nbytes`` at ``offset`` to the disk now, without
    waiting, so the device works while the next tensors are produced and the final fsync
    finds little left."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:  # (0 would mean "to the end of the file")
        _SYNC_FILE_RANGE(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; advice only: no check


def release_cached_pages(path: str) -> None:
    """Drop the page cache of the file about to be replaced (its bytes on disk stay).

    Its cached pages are garbage once the replacement lands; released first, they are what
    the new file's pages are taken from, instead of pages the system must find afresh while
    the old copy is still cached (docs/sessions.md has what that changed on the benchmark
    machine).
    """
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - macOS
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # nothing there yet (or not ours to read): nothing to release
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:  # pragma: no cover - advice only
        pass
    finally:
        os.close(fd)


def write_error(path: str, e: OSError, what: str) -> SnapshotWriteError:
    return SnapshotWriteError(e.errno, f"{path}: {what} ({e.strerror or e}); the file there, if any, is unchanged")


def write_file_atomically(path: str, fill: Callable[[BinaryIO], T], fsync: bool = True) -> T:
    """Write ``path`` through ``fill(f)`` on a temporary file, then rename it into place;
    returns what ``fill`` returns."""
    directory = os.path.dirname(os.path.abspath(path))
    release_cached_pages(path)
    temporaries.remove_stale_now_and_then(directory)  # those of writers killed before (first:
    # a writer killed at any point then leaves at most its own behind)
    try:
        fd, tmp = temporaries.create(path)  # a recognisable name, locked while it is written
    except OSError as e:
        raise write_error(path, e, f"cannot create a file in {directory}") from e
    try:
        with os.fdopen(fd, "wb") as f:  # closing it releases the lock: after the rename
            result = fill(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e, "cannot write the snapshot") from e
        raise
    if fsync:
        try:
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise SnapshotWriteError(
                e.errno,
                f"{path}: written, but syncing {directory} failed ({e.strerror or e}): "
                "the rename may not survive a crash",
            ) from e
    return result
