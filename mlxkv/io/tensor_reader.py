"""Reading the tensors of a checked safetensors file straight into MLX arrays.

``mx.load`` is handed a stand-in file (``_LoadStream``) whose header declares the tensors
asked for, with the slack rows a growing cache wants added to their shape. MLX allocates
each array uninitialized and passes its memory to ``readinto``; the stored bytes are read
into it with preadv, each half by one of two threads, each chunk checksummed right after it
arrives. A load is thus one copy out of the page cache per byte, with no fill pass, no
staging buffer and no memory beyond the arrays themselves.
"""

import io
import os
import struct
from collections.abc import Callable, Iterable

import mlx.core as mx
import numpy as np

from ..errors import CorruptSnapshotError, SnapshotError
from .safetensors import DTYPES, SafetensorsHeader, TensorInfo, crc32, crc32_combine, header_bytes, io_pool

_IOV_MAX = 1024  # iovecs per preadv call (Linux's IOV_MAX)
_SPLIT_MIN = 1 << 20  # tensors at least this large are read by two threads
_CHUNK = 512 << 10  # read, then checksum while still in cache (docs/sessions.md, snapshot I/O)
_PARALLEL = crc32_combine is not None and hasattr(os, "preadv")

Piece = tuple[memoryview, int]  # destination, file offset
Request = tuple[str, str | None, int | None]  # name, expected CRC-32 (or None), rows


def _pread_into(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from the bytes of ``fd`` at ``offset``; returns the bytes read,
    fewer than asked only at the end of the file."""
    views = [v for v in views if len(v)]
    total = 0
    while views:
        batch = views[:_IOV_MAX]
        if hasattr(os, "preadv"):
            got = os.preadv(fd, batch, offset + total)
        else:  # pragma: no cover - platforms without preadv read on one thread (_PARALLEL)
            os.lseek(fd, offset + total, os.SEEK_SET)
            got = os.readv(fd, batch)
        if got == 0:
            break
        total += got
        while views and got >= len(views[0]):  # a read may stop anywhere: resume there
            got -= len(views.pop(0))
        if got:
            views[0] = views[0][got:]
    return total


def _chunks(pieces: list[Piece], size: int):
    """File-contiguous ``pieces`` regrouped as (views, file offset) of at most ``size`` bytes."""
    batch, n, offset = [], 0, pieces[0][1] if pieces else 0
    for v, _ in pieces:
        while len(v):
            k = min(len(v), size - n)
            batch.append(v[:k])
            n, v = n + k, v[k:]
            if n == size:
                yield batch, offset
                batch, n, offset = [], 0, offset + size
    if batch:
        yield batch, offset


def _read_and_checksum(fd: int, pieces: list[Piece], crc: int = 0) -> tuple[int, int]:
    """Read file-contiguous ``pieces``; returns (CRC-32 continuing ``crc``, bytes read)."""
    total = 0
    for views, offset in _chunks(pieces, _CHUNK):
        got = _pread_into(fd, views, offset)
        total, left = total + got, got
        for v in views:
            crc = crc32(v[: min(len(v), left)], crc)
            left -= min(len(v), left)
        if got < sum(len(v) for v in views):
            break  # end of file
    return crc, total


def _split(pieces: list[Piece], at: int) -> tuple[list[Piece], list[Piece]]:
    """``pieces`` cut into their first ``at`` bytes and the rest."""
    for i, (v, off) in enumerate(pieces):
        if at < len(v):
            head = pieces[:i] + ([(v[:at], off)] if at else [])
            return head, [(v[at:], off + at)] + pieces[i + 1 :]
        at -= len(v)
    return pieces, []


class _Target:
    """One requested tensor: where its bytes are in the file and in the array MLX allocates.

    Stored, the tensor is ``blocks`` runs of ``part`` bytes; in the array each run is
    followed by ``slack`` zero bytes (the slack rows of one [B, H] block), or nothing.
    """

    def __init__(self, info: TensorInfo, expected_crc: str | None, rows: int | None):
        self.info, self.expected_crc = info, expected_crc
        self.shape = list(info.shape)
        if rows is not None and len(self.shape) == 4 and rows > self.shape[2]:
            B, H, T, D = self.shape
            row = D * np.dtype(DTYPES[info.dtype][1]).itemsize
            self.blocks, self.part, self.slack = B * H, T * row, (rows - T) * row
            self.shape[2] = rows
        else:
            self.blocks, self.part, self.slack = 1, info.end - info.begin, 0
        self.nbytes = self.blocks * (self.part + self.slack)
        self.crc, self.bytes_read = 0, 0

    def fill(self, fd: int, out: memoryview, at: int):
        """Fill ``out``, the array's bytes from ``at`` on: stored bytes read, slack zeroed."""
        stride, end = self.part + self.slack, at + len(out)
        pieces = []
        for i in range(at // stride, (end - 1) // stride + 1):  # iovecs: one per [B, H] block
            blk = i * stride
            a, z = max(at, blk), min(end, blk + self.part)
            if a < z:
                pieces.append((out[a - at : z - at], self.info.begin + i * self.part + a - blk))
            a, z = max(at, blk + self.part), min(end, blk + stride)
            if a < z:
                np.frombuffer(out[a - at : z - at], dtype=np.uint8)[:] = 0
        total = sum(len(v) for v, _ in pieces)
        if _PARALLEL and total >= _SPLIT_MIN:
            # the helper reads the second half; waited for here, so no read outlives the call
            # that lent us the array's memory
            first, second = _split(pieces, total // 2)
            helper = io_pool().submit(_read_and_checksum, fd, second)
            crc_a, got_a = _read_and_checksum(fd, first, self.crc)
            crc_b, got_b = helper.result()
            self.crc, got = crc32_combine(crc_a, crc_b, got_b), got_a + got_b
        else:
            self.crc, got = _read_and_checksum(fd, pieces, self.crc)
        self.bytes_read += got

    def check(self, path: str):
        name, stored = self.info.name, self.info.end - self.info.begin
        if self.bytes_read != stored:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: read {self.bytes_read} of {stored} bytes: "
                "the file was truncated while loading"
            )
        got = f"{self.crc & 0xFFFFFFFF:08x}"
        if self.expected_crc is not None and got != self.expected_crc:
            raise CorruptSnapshotError(
                f"{path}: checksum mismatch in tensor {name!r} "
                f"(stored {self.expected_crc}, computed {got}): the file is damaged"
            )


class _LoadStream(io.RawIOBase):
    """The stand-in file ``mx.load`` reads: a safetensors header for ``targets`` (in file
    order), then their array bytes, produced on demand by ``readinto``."""

    def __init__(self, fd: int, targets: list[_Target], progress: Callable[[int, int], None] | None):
        self.fd, self.targets, self.progress = fd, targets, progress
        entries, self.spans, pos = {}, [], 0
        for t in targets:
            entries[t.info.name] = {"dtype": t.info.dtype, "shape": t.shape, "data_offsets": [pos, pos + t.nbytes]}
            if t.nbytes:
                self.spans.append((pos, t))
            pos += t.nbytes
        self.starts = np.array([s for s, _ in self.spans], dtype=np.int64)
        raw = header_bytes(entries, {})
        self.head = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.head) + pos
        self.pos, self.error, self.done = 0, None, 0
        self.total = sum(t.info.end - t.info.begin for t in targets)

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = offset + (0, self.pos, self.size)[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        out = memoryview(b).cast("B")
        n, h = len(out), len(self.head)
        k = max(0, min(n, h - self.pos))
        out[:k] = self.head[self.pos : self.pos + k]
        at = self.pos + k - h
        try:
            while k < n and self.error is None:  # MLX reads one whole tensor per call
                start, t = self.spans[int(np.searchsorted(self.starts, at, side="right")) - 1]
                m = min(n - k, start + t.nbytes - at)
                t.fill(self.fd, out[k : k + m], at - start)
                k, at = k + m, at + m
                if at == start + t.nbytes:
                    self.done += t.info.end - t.info.begin
                    if self.progress:
                        self.progress(self.done, self.total)
        except Exception as e:  # raised again, as ours, once mx.load returns
            self.error = e
        self.pos += n
        return n


class TensorReader:
    """Reads tensors of one checked file, verifying CRC-32 when asked."""

    def __init__(self, header: SafetensorsHeader):
        self.header = header
        try:
            self._file = open(header.path, "rb")  # noqa: SIM115 - closed by close() / __exit__
        except OSError as e:  # gone or locked since its header was read
            raise SnapshotError(f"{header.path}: cannot read: {e}") from e

    def read_all(
        self, requests: Iterable[Request], progress: Callable[[int, int], None] | None = None
    ) -> dict[str, mx.array]:
        """The tensors asked for by (name, expected CRC-32 or None, rows), by name, in one
        pass over the file; every given checksum is verified before anything is returned.

        ``rows`` (rank-4 tensors only) gives a [B, H, rows, D] array whose first T rows
        along axis 2 are the tensor and the rest zeros: the slack a growing cache wants.
        ``progress(done_bytes, total_bytes)`` is called after each tensor, possibly from
        MLX's loader thread.
        """
        wanted = {name: (crc, rows) for name, crc, rows in requests}  # a name asked twice is read once
        targets = sorted(
            (_Target(self.header.tensors[name], crc, rows) for name, (crc, rows) in wanted.items()),
            key=lambda t: t.info.begin,
        )
        if not targets:
            return {}
        stream = _LoadStream(self._file.fileno(), targets, progress)
        arrays = mx.load(stream, format="safetensors")  # fills every array through readinto
        if isinstance(stream.error, OSError):
            raise SnapshotError(f"{self.header.path}: cannot read: {stream.error}") from stream.error
        if stream.error is not None:
            raise stream.error
        for t in targets:
            t.check(self.header.path)
        return arrays

    def read(self, name: str, expected_crc: str | None = None, rows: int | None = None) -> mx.array:
        """One tensor; see ``read_all``."""
        return self.read_all([(name, expected_crc, rows)])[name]

    def checksum(self, name: str) -> str:
        """CRC-32 of the stored bytes of ``name``, read in chunks into one reused buffer."""
        info = self.header.tensors[name]
        buf = memoryview(bytearray(min(_CHUNK, info.end - info.begin)))
        crc = 0
        for pos in range(info.begin, info.end, _CHUNK):
            view = buf[: min(len(buf), info.end - pos)]
            crc, got = _read_and_checksum(self._file.fileno(), [(view, pos)], crc)
            if got < len(view):
                raise CorruptSnapshotError(f"{self.header.path}: truncated while verifying tensor {name!r}")
        return f"{crc & 0xFFFFFFFF:08x}"

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
