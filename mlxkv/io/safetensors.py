"""A streaming safetensors writer and a validating header reader.

Writer: the header's length is fixed before any tensor is written (checksums are
fixed-width hex), so tensors stream to a temporary file one at a time, their CRC-32 taken
on the way, and the header is written last; then fsync, rename, fsync of the directory.
Peak extra memory is one tensor. Header reader: every declared range is checked against
the file before a byte of tensor data is touched (tensors are read by tensor_reader.py).
"""

import functools
import json
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import CorruptSnapshotError, SnapshotError
from .atomic import start_writeback, write_file_atomically

try:  # zlib-ng computes the same CRC-32 as zlib, faster (SIMD; docs/sessions.md), and can combine two
    from zlib_ng.zlib_ng import crc32, crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    from zlib import crc32

    crc32_combine = None

# safetensors dtype name <-> (mlx dtype, numpy dtype of the raw bytes)
DTYPES = {
    "BOOL": (mx.bool_, np.bool_),
    "U8": (mx.uint8, np.uint8),
    "I8": (mx.int8, np.int8),
    "U16": (mx.uint16, np.uint16),
    "I16": (mx.int16, np.int16),
    "U32": (mx.uint32, np.uint32),
    "I32": (mx.int32, np.int32),
    "U64": (mx.uint64, np.uint64),
    "I64": (mx.int64, np.int64),
    "F16": (mx.float16, np.float16),
    "BF16": (mx.bfloat16, np.uint16),  # numpy has no bfloat16: raw 16-bit words
    "F32": (mx.float32, np.float32),
}
_NAME_OF = {m: name for name, (m, _) in DTYPES.items()}
_RAW_MX = {name: (mx.uint16 if name == "BF16" else m) for name, (m, _) in DTYPES.items()}
MAX_HEADER = 64 << 20
CRC_PLACEHOLDER = "00000000"


def dtype_name(a: mx.array) -> str:
    try:
        return _NAME_OF[a.dtype]
    except KeyError:
        raise SnapshotError(f"arrays of dtype {a.dtype} cannot be stored") from None


def crc32_hex(data) -> str:
    """CRC-32 (zlib's) as 8 lowercase hex digits."""
    return f"{crc32(data) & 0xFFFFFFFF:08x}"


@functools.cache
def io_pool() -> ThreadPoolExecutor:
    """The one helper thread: checksums while the caller writes, half of each read."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-io")


def array_buffer(a: mx.array) -> memoryview:
    """The row-major bytes of ``a`` (one contiguous copy at most)."""
    if a.size == 0:
        return memoryview(b"")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    a = mx.contiguous(a)
    mx.eval(a)
    return memoryview(np.asarray(a)).cast("B")


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
    checksums and the real ones (fixed-width hex does).
    """
    entries, start = {}, 0
    for name, a in tensors:
        n = a.nbytes
        entries[name] = {"dtype": dtype_name(a), "shape": list(a.shape), "data_offsets": [start, start + n]}
        start += n
    total = start
    placeholder = header_bytes(entries, build_metadata(dict.fromkeys(entries, CRC_PLACEHOLDER)))

    def fill(f) -> dict[str, str]:
        crcs, done = {}, 0
        f.seek(8 + len(placeholder))
        for name, a in tensors:
            buf = array_buffer(a)
            crc = io_pool().submit(crc32_hex, buf)  # overlaps the write
            f.write(buf)
            if fsync:
                f.flush()
                start_writeback(f.fileno(), f.tell() - buf.nbytes, buf.nbytes)
            crcs[name] = crc.result()
            done += buf.nbytes
            del buf
            if progress:
                progress(done, total)
        header = header_bytes(entries, build_metadata(crcs))
        if len(header) != len(placeholder):  # pragma: no cover - guarded by fixed widths
            raise SnapshotError("internal error: header length changed while writing")
        f.seek(0)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        return crcs

    return write_file_atomically(path, fill, fsync)


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # absolute file offsets
    end: int


@dataclass
class SafetensorsHeader:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int


def read_safetensors_header(path: str) -> SafetensorsHeader:
    """Parse and check the safetensors header of ``path``; reads no tensor bytes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptSnapshotError(f"{path}: truncated: {size} bytes, not even a header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CorruptSnapshotError(
                    f"{path}: truncated or damaged: header length {n} does not fit a {size}-byte file"
                )
            raw = f.read(n)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from e
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptSnapshotError(f"{path}: damaged header: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptSnapshotError(f"{path}: damaged header: not a JSON object")
    meta = doc.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptSnapshotError(f"{path}: damaged header: __metadata__ must map strings to strings")
    data_start = 8 + n
    tensors, spans = {}, []
    for name, e in doc.items():
        try:
            dtype, shape, (b, t) = e["dtype"], [int(s) for s in e["shape"]], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptSnapshotError(f"{path}: damaged header entry for tensor {name!r}") from None
        if dtype not in DTYPES:
            raise CorruptSnapshotError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        itemsize = np.dtype(DTYPES[dtype][1]).itemsize
        want = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
        if any(s < 0 for s in shape) or not (isinstance(b, int) and isinstance(t, int)) or t - b != want or b < 0:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: byte range {[b, t]} does not hold shape {shape} of {dtype}"
            )
        if data_start + t > size:
            raise CorruptSnapshotError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + t} of a {size}-byte file"
            )
        tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + t)
        spans.append((b, t))
    spans.sort()
    pos = 0
    for b, t in spans:
        if b != pos:
            raise CorruptSnapshotError(f"{path}: damaged header: tensor byte ranges overlap or leave holes")
        pos = t
    if data_start + pos != size:
        raise CorruptSnapshotError(
            f"{path}: {size - data_start - pos:+d} bytes after the last tensor: truncated or damaged file"
        )
    return SafetensorsHeader(path, meta, tensors, data_start, size)
