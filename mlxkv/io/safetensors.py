"""A streaming safetensors writer and a validating header reader.

Writer: the header's length is fixed before any tensor is written (checksums are
fixed-width hex), so tensors stream to a temporary file one at a time, their CRC-32 taken
on the way, and the header is written last; then fsync, rename, fsync of the directory.
Peak extra memory is one tensor. Header reader: every declared range is checked against
the file, with exact integer arithmetic, before a byte of tensor data is touched; the file
is opened once and every later read goes through that descriptor (tensor_reader.py).
"""

import functools
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

from ..checks import is_count
from ..errors import CorruptSnapshotError, SnapshotError
from . import strict_json
from .atomic import start_writeback, write_file_atomically
from .tensor_file import Checksum, TensorFile, TensorInfo, file_identity  # noqa: F401 - re-exported

try:  # zlib-ng computes the same CRC-32 as zlib, faster (SIMD; docs/sessions.md), and can combine two
    from zlib_ng.zlib_ng import crc32, crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    from zlib import crc32

    crc32_combine = None

# safetensors dtype name <-> (mlx dtype, numpy dtype name of the raw bytes); names, not numpy
# dtypes, so that reading a header (inspect, verify) never imports numpy
DTYPES = {
    "BOOL": (mx.bool_, "bool"),
    "U8": (mx.uint8, "uint8"),
    "I8": (mx.int8, "int8"),
    "U16": (mx.uint16, "uint16"),
    "I16": (mx.int16, "int16"),
    "U32": (mx.uint32, "uint32"),
    "I32": (mx.int32, "int32"),
    "U64": (mx.uint64, "uint64"),
    "I64": (mx.int64, "int64"),
    "F16": (mx.float16, "float16"),
    "BF16": (mx.bfloat16, "uint16"),  # numpy has no bfloat16: raw 16-bit words
    "F32": (mx.float32, "float32"),
}
ITEMSIZE = {name: m.size for name, (m, _) in DTYPES.items()}
_NAME_OF = {m: name for name, (m, _) in DTYPES.items()}
MAX_HEADER = 64 << 20  # bytes of header JSON
MAX_RANK = 8  # dimensions of a tensor
MAX_DIM = 2**31 - 1  # elements along one dimension (MLX's shapes are int32)
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
CRC_PLACEHOLDER = "00000000"
EVAL_GROUP = 64 << 20  # bytes of tensors a writer evaluates at once
#: bytes per pwrite: one 8 MiB pwrite per tensor cost 3-5x the CPU of 512 KiB ones on ext4
#: (docs/sessions.md)
WRITE_CHUNK = 512 << 10


def dtype_name(a: mx.array) -> str:
    try:
        return _NAME_OF[a.dtype]
    except KeyError:
        raise SnapshotError(f"arrays of dtype {a.dtype} cannot be stored") from None


def check_storable(name: str, a: mx.array) -> None:
    """Refuse, before anything is written, an array a reader would refuse to read."""
    dtype_name(a)
    if a.ndim > MAX_RANK:
        raise SnapshotError(f"{name}: arrays of {a.ndim} dimensions cannot be stored (at most {MAX_RANK})")


def crc32_hex(data) -> str:
    """CRC-32 (zlib's) as 8 lowercase hex digits."""
    return f"{crc32(data) & 0xFFFFFFFF:08x}"


class _Crc32:
    """A running CRC-32 (the streaming state of :data:`CRC32`)."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0):
        self.value = value

    def update(self, data) -> "_Crc32":
        self.value = crc32(data, self.value)
        return self

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


def _crc32_combine(a: _Crc32, b: _Crc32, b_len: int) -> _Crc32:
    return _Crc32(crc32_combine(a.value, b.value, b_len))


#: mlxkv snapshots check every tensor with CRC-32 (docs/format.md section 6)
CRC32 = Checksum(
    _Crc32,
    "checksum mismatch in tensor {name!r} (stored {stored}, computed {computed}): the file is damaged",
    _crc32_combine if crc32_combine is not None else None,
)


@functools.cache
def io_pool() -> ThreadPoolExecutor:
    """The one helper thread: a tensor's checksum while the writer writes it, half of each read."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-io")


def _raw(a: mx.array) -> mx.array:
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16


def _bytes_of(a: mx.array) -> memoryview:
    """The row-major bytes of an evaluated array: its own memory when it is contiguous, else
    one copy (numpy reads MLX's strides; a slice of a cache's buffer is such a view)."""
    import numpy as np

    if a.size == 0:
        return memoryview(b"")
    if a.ndim > 64:  # numpy stops at 64 dimensions (MLX does not): flatten in MLX first
        a = mx.contiguous(a).reshape(-1)
        mx.eval(a)
    n = np.asarray(a)
    return memoryview(n if n.flags.c_contiguous else np.ascontiguousarray(n)).cast("B")


def array_buffers(arrays: Sequence[mx.array]):
    """The row-major bytes of each array, one at a time (at most one contiguous copy alive).

    The arrays are evaluated in groups of up to ``EVAL_GROUP`` bytes (at least one array): a
    writer waits for MLX once per group, not once per tensor (on a busy 2-core machine each
    wait cost about as much as writing a tensor; docs/sessions.md). Arrays already computed
    (a cache after a forward pass) take no memory to evaluate; lazy ones at most a group's."""
    raw = [_raw(a) for a in arrays]
    start = 0
    while start < len(raw):
        end, size = start + 1, raw[start].nbytes
        while end < len(raw) and size + raw[end].nbytes <= EVAL_GROUP:
            size += raw[end].nbytes
            end += 1
        mx.eval(raw[start:end])
        for i in range(start, end):
            a, raw[i] = raw[i], None  # (the group holds no array past its write)
            yield _bytes_of(a)
            del a
        start = end


def array_buffer(a: mx.array) -> memoryview:
    """The row-major bytes of ``a`` (one contiguous copy at most), as one flat dimension."""
    return next(array_buffers([a]))


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (a write may stop short: resume there)."""
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def header_bytes(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    doc = {"__metadata__": metadata, **entries}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    return raw + b" " * (-len(raw) % 8)


def write_atomic(
    path: str,
    tensors: Sequence[tuple[str, mx.array]],
    build_metadata: Callable[[dict[str, str]], dict[str, str]],
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
) -> dict[str, str]:
    """Write a safetensors file atomically at ``path``; returns name -> crc32 hex.

    ``build_metadata(crcs)`` must give a header of the same length for the placeholder
    checksums and the real ones (fixed-width hex does). Arrays a reader would refuse are
    refused before anything is written.
    """
    entries, start = {}, 0
    for name, a in tensors:
        check_storable(name, a)
        n = a.nbytes
        entries[name] = {"dtype": dtype_name(a), "shape": list(a.shape), "data_offsets": [start, start + n]}
        start += n
    total = start
    placeholder = header_bytes(entries, build_metadata(dict.fromkeys(entries, CRC_PLACEHOLDER)))

    def fill(f) -> dict[str, str]:
        fd, crcs = f.fileno(), {}
        at = data_start = 8 + len(placeholder)
        buffers = array_buffers([a for _, a in tensors])
        for name, _ in tensors:
            buf = next(buffers)  # (nothing holds the previous tensor's bytes)
            crc = io_pool().submit(crc32, buf)  # the helper checksums while this thread writes
            for i in range(0, len(buf), WRITE_CHUNK):
                pwrite_all(fd, buf[i : i + WRITE_CHUNK], at + i)
            if fsync:
                start_writeback(fd, at, len(buf))
            crcs[name] = f"{crc.result() & 0xFFFFFFFF:08x}"
            at += len(buf)
            del buf, crc  # (a copy of a strided tensor lives no longer than its write)
            if progress:
                progress(at - data_start, total)
        header = header_bytes(entries, build_metadata(crcs))
        if len(header) != len(placeholder):  # pragma: no cover - guarded by fixed widths
            raise SnapshotError("internal error: header length changed while writing")
        pwrite_all(fd, struct.pack("<Q", len(header)) + header, 0)
        return crcs

    return write_file_atomically(path, fill, fsync)


@dataclass
class SafetensorsHeader:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int
    #: (st_dev, st_ino, st_size, st_mtime_ns) of the file the header was read from
    identity: tuple = ()


def checked_shape(value) -> list[int] | None:
    """``value`` if it is a shape a reader accepts (a list of at most MAX_RANK integers in
    0..MAX_DIM), else None."""
    if type(value) is not list or len(value) > MAX_RANK or not all(is_count(d) and d <= MAX_DIM for d in value):
        return None
    return value


def parse_safetensors_header(raw: bytes, file_size: int, path: str) -> SafetensorsHeader:
    """Check the header bytes ``raw`` (the ``N`` bytes after the length) of a ``file_size``
    byte file: section 8, steps 3-8, of docs/format.md. Pure: no I/O."""
    doc = strict_json.loads(raw, f"{path}: header")
    if type(doc) is not dict:
        raise CorruptSnapshotError(f"{path}: damaged header: not a JSON object")
    meta = doc.pop("__metadata__", None)
    if meta is None:  # absent, or null as MLX writes it
        meta = {}
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise CorruptSnapshotError(f"{path}: damaged header: __metadata__ must map strings to strings")
    data_start, data_size = 8 + len(raw), file_size - 8 - len(raw)
    tensors, spans = {}, []
    for name, e in doc.items():
        if type(e) is not dict or e.keys() != _ENTRY_KEYS:
            raise CorruptSnapshotError(
                f"{path}: damaged header entry for tensor {name!r}: expected exactly dtype, shape, data_offsets"
            )
        dtype, shape, offsets = e["dtype"], checked_shape(e["shape"]), e["data_offsets"]
        if type(dtype) is not str or dtype not in DTYPES:
            raise CorruptSnapshotError(f"{path}: tensor {name!r} has unsupported dtype {str(dtype)[:40]!r}")
        if shape is None:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: shape must be a list of at most {MAX_RANK} integers "
                f"in 0..{MAX_DIM}, got {str(e['shape'])[:80]}"
            )
        if type(offsets) is not list or len(offsets) != 2 or not all(is_count(o) for o in offsets):
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: data_offsets must be two integers >= 0, got {str(offsets)[:80]}"
            )
        b, t = offsets
        want = math.prod(shape) * ITEMSIZE[dtype]  # exact: Python integers do not wrap
        if t - b != want:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: byte range {[b, t]} does not hold shape {shape} of {dtype} ({want} bytes)"
            )
        if t > data_size:
            raise CorruptSnapshotError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + t} of a {file_size}-byte file"
            )
        tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + t)
        spans.append((b, t))
    spans.sort()
    pos = 0
    for b, t in spans:
        if b != pos:
            raise CorruptSnapshotError(f"{path}: damaged header: tensor byte ranges overlap or leave holes")
        pos = t
    if pos != data_size:
        raise CorruptSnapshotError(
            f"{path}: {data_size - pos:+d} bytes after the last tensor: truncated or damaged file"
        )
    return SafetensorsHeader(path, meta, tensors, data_start, file_size)


class SafetensorsFile(TensorFile):
    """One open safetensors file: its checked header (``header``), and the descriptor every
    later read goes through. Opened once, it stays the same file however the path is renamed
    over or removed meanwhile, so a header and the tensors read after it never come from two
    files."""

    checksum = CRC32

    def _read_header(self) -> None:
        path, size = self.path, self.size
        head = self.read(8, 0)
        if size == 0:
            raise CorruptSnapshotError(f"{path}: an empty file, not a snapshot")
        if len(head) < 8:
            raise CorruptSnapshotError(f"{path}: truncated: {size} bytes, not even a header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or self.read(1, 8) not in (b"{", b""):  # a header is a JSON object
            raise CorruptSnapshotError(
                f"{path}: not a snapshot: it has no mlx-bun magic and does not start as a safetensors file "
                f"(header length {n}, no JSON header after it); expected an mlxkv snapshot, an mlx-bun cache "
                "file or an mlx-lm prompt-cache file"
            )
        if 8 + n > size:
            raise CorruptSnapshotError(
                f"{path}: truncated or damaged: header length {n} does not fit a {size}-byte file"
            )
        raw = self.read(n, 8)
        if len(raw) < n:
            raise CorruptSnapshotError(f"{path}: truncated while reading its header")
        self.header = parse_safetensors_header(raw, size, path)
        self.header.identity = self.identity
        self.tensors = self.header.tensors


def read_safetensors_header(path: str) -> SafetensorsHeader:
    """Parse and check the safetensors header of ``path``; reads no tensor bytes."""
    with SafetensorsFile(path) as f:
        return f.header
