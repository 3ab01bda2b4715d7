"""One open file of tensors, whatever its container, and how its tensors are checked.

A :class:`TensorFile` is opened once; its header and every tensor are read through that one
descriptor, so a writer renaming a new file over the path meanwhile (every writer here
replaces files atomically) is never mixed with the file being read. A container subclasses
it (``SafetensorsFile`` for mlxkv snapshots and safetensors files, ``MlxBunFile`` for
mlx-bun's cache files), parses its header in ``_read_header`` and describes its tensors as
:class:`TensorInfo` (absolute byte ranges in the file); ``TensorReader`` then reads any of
them into MLX arrays, checking each with the container's :class:`Checksum`.
"""

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SnapshotError


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class Checksum:
    """How a container checks a tensor's stored bytes.

    ``new()`` gives a streaming state (``update(bytes_like)``, ``hexdigest()``); ``combine``,
    when the function has one (CRC-32), joins the states of two consecutive parts, so the
    two halves of a large tensor are checked by two threads; without it (wyhash) the reader
    still reads both halves at once and hashes them in order. ``mismatch`` is the message
    (after ``where``) of a tensor whose bytes disagree, formatted with ``name``, ``stored``
    and ``computed``."""

    new: Callable[[], object]
    mismatch: str
    combine: Callable[[object, object, int], object] | None = None


def file_identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` (never blocking on a FIFO or device: refused as
    not a regular file by :class:`TensorFile`)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from e


def regular_stat(fd: int, path: str) -> os.stat_result:
    """The status of the open ``fd``, refused unless it is a regular file."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError(f"{path}: cannot read: not a regular file")
    return st


def read_exactly(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` at ``offset``; fewer only at the end of the file."""
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


class TensorFile:
    """An open regular file, its size and identity, and (after ``_read_header``) its tensors.

    ``TensorFile(path)`` opens the path; ``TensorFile(path, fd)`` takes over a descriptor
    already open on it (``open_container`` reads the magic first). The descriptor is closed
    by ``close`` (or the ``with`` block), or at once if the header is refused."""

    checksum: Checksum  # the container's tensor check
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str, fd: int | None = None):
        self.path = path
        self.fd = open_regular(path) if fd is None else fd
        try:
            st = regular_stat(self.fd, path)
            self.size, self.identity = st.st_size, file_identity(st)
            self._read_header()
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        """How messages name this file."""
        return self.path

    def _read_header(self) -> None:  # pragma: no cover - every container defines it
        raise NotImplementedError

    def read(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` through the one descriptor."""
        try:
            return read_exactly(self.fd, n, offset)
        except OSError as e:
            raise SnapshotError(f"{self.path}: cannot read: {e.strerror or e}") from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
