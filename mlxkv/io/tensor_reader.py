"""Reading the tensors of a checked file straight into MLX arrays.

``mx.load`` is handed a stand-in file (``_LoadStream``) whose header declares the tensors
asked for, with the slack rows a growing cache wants added to their shape. MLX allocates
each array uninitialized and passes its memory to ``readinto``; the stored bytes are read
into it with preadv, each half by one of two threads, each chunk checked right after it
arrives (CRC-32 for mlxkv snapshots, wyhash for mlx-bun files: the container's
:class:`~mlxkv.io.tensor_file.Checksum`). A load is thus one copy out of the page cache per
byte, with no fill pass, no staging buffer and no memory beyond the arrays themselves.
Every read goes through the one descriptor the header was read from (a
:class:`~mlxkv.io.tensor_file.TensorFile`, whichever container it is).

MLX's reader of a Python stream is a C++ object that may be released by one of MLX's I/O
threads, and its destructor takes the GIL: during interpreter shutdown that thread is killed
and the process aborts. ``_load`` therefore returns only once that object is gone (a weak
reference to the stream says so), so no MLX thread touches Python after a load returns.
"""

import io
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterable

import mlx.core as mx

from ..errors import CorruptSnapshotError, SnapshotError
from .safetensors import CRC32, DTYPES, ITEMSIZE, SafetensorsHeader, header_bytes, io_pool
from .tensor_file import Checksum, TensorFile, TensorInfo, file_identity, open_regular
from .zeroing import zero

_IOV_MAX = 1024  # iovecs per preadv call (Linux's IOV_MAX)
_SPLIT_MIN = 1 << 20  # tensors at least this large are read by two threads
_CHUNK = 256 << 10  # read, then checksum while still in cache (docs/sessions.md, snapshot I/O)
_PARALLEL = hasattr(os, "preadv")
_MAX_BLOCKS = 4096  # [B, H] blocks placed one iovec each; more are staged (_fill_staged)
_RELEASE_TIMEOUT = 60.0  # seconds MLX may take to drop its reader of a finished load

Piece = tuple[memoryview, int]  # destination, file offset
Request = tuple[str, str | None, int | None]  # name, expected checksum (or None), rows


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


def _read_and_checksum(fd: int, pieces: list[Piece], state=None) -> int:
    """Read file-contiguous ``pieces``, updating the checksum ``state`` (if any) with every
    byte read, in order; returns the bytes read. Without a checksum there is nothing to take
    while the bytes are in cache: one read."""
    total, size = 0, _CHUNK if state is not None else max(1, sum(len(v) for v, _ in pieces))
    for views, offset in _chunks(pieces, size):
        got = _pread_into(fd, views, offset)
        total += got
        if state is not None:
            _update(state, views, got)
        if got < sum(len(v) for v in views):
            break  # end of file
    return total


def _update(state, views, n: int) -> None:
    """``state`` updated with the first ``n`` bytes of ``views``, in order."""
    for v in views:
        k = min(len(v), n)
        if k:
            state.update(v[:k])
        n -= k


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

    def __init__(self, info: TensorInfo, expected: str | None, rows: int | None, checksum: Checksum):
        self.info, self.expected, self.checksum = info, expected, checksum
        self.shape = list(info.shape)
        if rows is not None and len(self.shape) == 4 and rows > self.shape[2]:
            B, H, T, D = self.shape
            row = D * ITEMSIZE[info.dtype]
            self.blocks, self.part, self.slack = B * H, T * row, (rows - T) * row
            self.shape[2] = rows
        else:
            self.blocks, self.part, self.slack = 1, info.end - info.begin, 0
        self.nbytes = self.blocks * (self.part + self.slack)
        self.state = checksum.new() if expected is not None else None  # nothing to compare: not computed
        self.bytes_read = 0

    def fill(self, fd: int, out: memoryview, at: int, split: bool = True):
        """Fill ``out``, the array's bytes from ``at`` on: stored bytes read, slack zeroed;
        with ``split``, the second half by the helper thread."""
        if self.slack and self.blocks > _MAX_BLOCKS and at == 0 and len(out) == self.nbytes:
            return self._fill_staged(fd, out, split)
        stride, end = self.part + self.slack, at + len(out)
        pieces = []
        for i in range(at // stride, (end - 1) // stride + 1):  # iovecs: one per [B, H] block
            blk = i * stride
            a, z = max(at, blk), min(end, blk + self.part)
            if a < z:
                pieces.append((out[a - at : z - at], self.info.begin + i * self.part + a - blk))
            a, z = max(at, blk + self.part), min(end, blk + stride)
            if a < z:
                zero(out[a - at : z - at])
        self._read(fd, pieces, split)

    def _fill_staged(self, fd: int, out: memoryview, split: bool):
        """Many short blocks (a crafted file can declare millions): read them in one run
        into a staging buffer, then place them with one strided copy instead of a Python
        loop per block."""
        import numpy as np

        stored = bytearray(self.blocks * self.part)
        self._read(fd, [(memoryview(stored), self.info.begin)], split)
        grid = np.frombuffer(out, dtype=np.uint8).reshape(self.blocks, self.part + self.slack)
        grid[:, : self.part] = np.frombuffer(stored, dtype=np.uint8).reshape(self.blocks, self.part)
        grid[:, self.part :] = 0

    def _read(self, fd: int, pieces: list[Piece], split: bool):
        total = sum(len(v) for v, _ in pieces)
        if split and _PARALLEL and total >= _SPLIT_MIN:
            # the helper reads the second half; waited for here, so no read outlives the call
            # that lent us the array's memory
            first, second = _split(pieces, total // 2)
            combine = self.checksum.combine
            part = self.checksum.new() if self.state is not None and combine is not None else None
            helper = io_pool().submit(_read_and_checksum, fd, second, part)
            got_a = _read_and_checksum(fd, first, self.state)
            got_b = helper.result()
            if part is not None:
                self.state = combine(self.state, part, got_b)
            elif self.state is not None:  # a checksum that does not combine: the second half after the first
                _update(self.state, [v for v, _ in second], got_b)
            got = got_a + got_b
        else:
            got = _read_and_checksum(fd, pieces, self.state)
        self.bytes_read += got

    def check(self, where: str):
        name, stored = self.info.name, self.info.end - self.info.begin
        if self.bytes_read != stored:
            raise CorruptSnapshotError(
                f"{where}: tensor {name!r}: read {self.bytes_read} of {stored} bytes: "
                "the file was truncated while loading"
            )
        if self.state is not None:
            got = self.state.hexdigest()
            if got != self.expected:
                raise CorruptSnapshotError(
                    f"{where}: " + self.checksum.mismatch.format(name=name, stored=self.expected, computed=got)
                )


class _LoadStream(io.RawIOBase):
    """The stand-in file ``mx.load`` reads: a safetensors header for ``targets`` (in file
    order), then their array bytes, produced on demand by ``readinto``."""

    def __init__(self, fd: int, targets: list[_Target], progress: Callable[[int, int], None] | None):
        import numpy as np

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
        self.readers = 0  # readinto calls in flight
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
        import numpy as np

        out = memoryview(b).cast("B")
        n, h = len(out), len(self.head)
        k = max(0, min(n, h - self.pos))
        out[:k] = self.head[self.pos : self.pos + k]
        at = self.pos + k - h
        self.readers += 1
        try:
            while k < n and self.error is None:  # MLX reads one whole tensor per call
                start, t = self.spans[int(np.searchsorted(self.starts, at, side="right")) - 1]
                m = min(n - k, start + t.nbytes - at)
                # MLX's loader threads may read several tensors at once: then each reads its
                # own; a tensor read alone is split with the helper thread
                t.fill(self.fd, out[k : k + m], at - start, split=self.readers == 1)
                k, at = k + m, at + m
                if at == start + t.nbytes:
                    self.done += t.info.end - t.info.begin
                    if self.progress:
                        self.progress(self.done, self.total)
        except Exception as e:  # raised again, as ours, once mx.load returns
            # without its traceback, whose frames hold this stream (see _load)
            self.error = e.with_traceback(None)
            self.error.__context__ = None
        finally:
            self.readers -= 1
        self.pos += n
        return n


def _load(fd: int, targets: list[_Target], progress) -> tuple[dict[str, mx.array], Exception | None]:
    """``mx.load`` of the stand-in file for ``targets`` (all non-empty); returns the arrays
    and the first error ``readinto`` met. Returns only after MLX has released the stream."""
    released = threading.Event()
    stream = _LoadStream(fd, targets, progress)
    watch = weakref.ref(stream, lambda _: released.set())
    try:
        arrays = mx.load(stream, format="safetensors")  # fills every array through readinto
    finally:
        error, stream.error = stream.error, None
        del stream
        # MLX's C++ reader holds the stream; the last owner may be one of MLX's I/O threads,
        # which releases it, taking the GIL, just after its read. Wait (the GIL released)
        # until it has: then no MLX thread holds a Python object of this load any more.
        if watch() is not None and not released.wait(_RELEASE_TIMEOUT):  # pragma: no cover
            raise SnapshotError(
                f"MLX still holds the stream of a finished load after {_RELEASE_TIMEOUT:.0f} s: "
                "this mlx version keeps its readers alive, which mlxkv cannot read with safely"
            )
    return arrays, error


class TensorReader:
    """Reads tensors of one checked file, verifying their checksums when asked.

    Given a :class:`TensorFile` (a ``SafetensorsFile``, an ``MlxBunFile``), it reads through
    that file's descriptor (the caller closes it) and checks with the container's checksum.
    Given a :class:`SafetensorsHeader` alone (a prompt store's shared tier assembles one),
    it opens the header's path and refuses a file that is not the one the header was read
    from.
    """

    def __init__(self, source: TensorFile | SafetensorsHeader):
        self._own_fd = False
        if isinstance(source, TensorFile):
            self.tensors, self.where, self._checksum, self._fd = (
                source.tensors,
                source.where,
                source.checksum,
                source.fd,
            )
            return
        self.tensors, self.where, self._checksum = source.tensors, source.path, CRC32
        self._fd = open_regular(source.path)  # gone or locked since its header was read: ours
        self._own_fd = True
        if source.identity and file_identity(os.fstat(self._fd)) != source.identity:
            self.close()
            raise SnapshotError(
                f"{source.path}: the file changed since its header was read (replaced or rewritten): read it again"
            )

    def read_all(
        self, requests: Iterable[Request], progress: Callable[[int, int], None] | None = None
    ) -> dict[str, mx.array]:
        """The tensors asked for by (name, expected checksum or None, rows), by name, in one
        pass over the file; every given checksum is verified before anything is returned.

        ``rows`` (rank-4 tensors only) gives a [B, H, rows, D] array whose first T rows
        along axis 2 are the tensor and the rest zeros: the slack a growing cache wants.
        ``progress(done_bytes, total_bytes)`` is called after each tensor, possibly from
        MLX's loader thread. What the arrays need is checked against the machine's memory
        before anything is allocated.
        """
        wanted = {name: (expected, rows) for name, expected, rows in requests}  # a name asked twice is read once
        targets = sorted(
            (_Target(self.tensors[name], expected, rows, self._checksum) for name, (expected, rows) in wanted.items()),
            key=lambda t: t.info.begin,
        )
        check_allocation(self.where, sum(t.nbytes for t in targets))
        stored = [t for t in targets if t.info.end > t.info.begin]
        arrays, error = _load(self._fd, stored, progress) if stored else ({}, None)
        if isinstance(error, OSError):
            raise SnapshotError(f"{self.where}: cannot read: {error}") from error
        if error is not None:
            raise error
        for t in stored:
            t.check(self.where)
        for t in targets:  # nothing stored: MLX is not asked for zero-length reads
            if t.info.end == t.info.begin:
                arrays[t.info.name] = mx.zeros(t.shape, DTYPES[t.info.dtype][0])
        return arrays

    def read(self, name: str, expected: str | None = None, rows: int | None = None) -> mx.array:
        """One tensor; see ``read_all``."""
        return self.read_all([(name, expected, rows)])[name]

    def checksum(self, name: str) -> str:
        """The container's checksum of the stored bytes of ``name``, read in chunks into one
        reused buffer."""
        info = self.tensors[name]
        buf = memoryview(bytearray(min(_CHUNK, info.end - info.begin)))
        state = self._checksum.new()
        for pos in range(info.begin, info.end, _CHUNK):
            view = buf[: min(len(buf), info.end - pos)]
            try:
                got = _read_and_checksum(self._fd, [(view, pos)], state)
            except OSError as e:
                raise SnapshotError(f"{self.where}: cannot read: {e}") from e
            if got < len(view):
                raise CorruptSnapshotError(f"{self.where}: truncated while verifying tensor {name!r}")
        return state.hexdigest()

    def verify(self, name: str, expected: str) -> None:
        """Refuse the file if the stored bytes of ``name`` disagree with ``expected``."""
        got = self.checksum(name)
        if got != expected:
            raise CorruptSnapshotError(
                f"{self.where}: " + self._checksum.mismatch.format(name=name, stored=expected, computed=got)
            )

    def close(self):
        if self._own_fd:
            os.close(self._fd)
            self._own_fd = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def physical_memory() -> int | None:
    """Bytes of memory this machine has, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic systems
        return None


def check_allocation(path: str, nbytes: int) -> None:
    """Refuse a load whose arrays would not fit this machine's memory, before allocating."""
    limit = physical_memory()
    if limit is not None and nbytes > limit:
        raise SnapshotError(
            f"{path}: restoring needs {nbytes} bytes of arrays, more than this machine's {limit} bytes of memory"
        )
