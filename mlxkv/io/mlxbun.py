"""mlx-bun's cache-file container (``MLXBUNKV2``, formatVersion 3, 4 and 5): reader and writer.

The TypeScript engine mlx-bun writes its SSD-tier cache files in this layout (docs/mlx-bun.md
is the normative description). This module knows the container only: the 26-byte prefix,
the header hash (Zig's wyhash), the JSON header's ``caches`` / ``attachments`` lists of
tensor slots, mlx-c dtype codes, byte ranges, blocks. It knows no cache kind: which slot is
which, and what the entry fields mean, is the state layer's business (``state/mlxbun.py``).

Reading gives an :class:`MlxBunFile`: the raw header dict, and per slot a
:class:`~mlxkv.io.safetensors.TensorInfo` with absolute file offsets, so that
:class:`~mlxkv.io.tensor_reader.TensorReader` reads the tensors of a "whole" file into MLX
arrays unchanged (``MlxBunFile.tensor_source()``). Every check that needs no tensor byte is
done on reading: the header hash (always), the version, every slot's ``off``/``bytes``/
``shape``/``dtype`` and hash format, and that every byte range lies inside the file.

Writing lays tensors out exactly as mlx-bun's writer does (16 KiB-aligned cache tensors,
the first attachment tensor at the unaligned cursor, fixed-width hashes patched into a
header of unchanged length, ``JSON.stringify`` formatting), atomically.
"""

import decimal
import hashlib
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import CorruptSnapshotError, FormatVersionError, SnapshotError
from .atomic import start_writeback, write_file_atomically
from .safetensors import DTYPES, MAX_HEADER, SafetensorsHeader, TensorInfo, array_buffer, dtype_name
from .wyhash import Wyhash, hex16, wyhash

MAGIC = b"MLXBUNKV2\n"
OLD_MAGIC = b"MLXBUNKV1\n"
PREFIX = struct.Struct("<10sIIQ")  # magic, headerLen, dataStart, headerHash
PREFIX_LEN = PREFIX.size  # 26
ALIGN = 16384
VERSIONS = (3, 4, 5)
CODEC_PROVIDER = "mlx-cache-v3"  # mlx-bun's built-in codec table; absent in early v3 files
HASH_PLACEHOLDER = "0" * 16
DEFAULT_BLOCK_BYTES = 1 << 20
BLOCKS_DIR = "blocks"

#: mlx-c ``mlx_dtype`` enum value -> the safetensors dtype name mlxkv uses
DTYPE_OF_CODE = {
    0: "BOOL",
    1: "U8",
    2: "U16",
    3: "U32",
    4: "U64",
    5: "I8",
    6: "I16",
    7: "I32",
    8: "I64",
    9: "F16",
    10: "F32",
    12: "BF16",
}
#: mlx-c codes mlx-bun may write that mlxkv cannot hold
UNSUPPORTED_CODES = {11: "float64", 13: "complex64"}
CODE_OF_DTYPE = {name: code for code, name in DTYPE_OF_CODE.items()}

_HASH16 = re.compile(r"[0-9a-f]{16}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _itemsize(dtype: str) -> int:
    return np.dtype(DTYPES[dtype][1]).itemsize


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * _itemsize(dtype)


def is_mlx_bun_file(path: str) -> bool:
    """Does ``path`` start with mlx-bun's cache-file magic (either generation)?"""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) in (MAGIC, OLD_MAGIC)
    except OSError:
        return False


def _where(path: str) -> str:
    return f"{path}: mlx-bun cache file"


# -- the neutral description ---------------------------------------------------------------


@dataclass
class Slot:
    """One tensor slot of an mlx-bun header: where its bytes are and how to check them."""

    info: TensorInfo  # name "caches.<i>.<j>" / "attachments.<i>.<j>"; absolute offsets (whole layout)
    code: int  # the mlx-c dtype code as stored
    off: int  # the slot's ``off``, verbatim (relative to dataStart)
    hash: str  # 16 hex digits (formats 3, 4); "" in format 5
    blocks: list[tuple[str, int]] = field(default_factory=list)  # format 5: (sha256 hex, bytes)

    @property
    def nbytes(self) -> int:
        return self.info.end - self.info.begin


@dataclass
class MlxBunFile:
    path: str
    version: int
    header: dict  # the JSON header as written
    header_len: int
    data_start: int
    header_hash: int
    file_size: int
    caches: list[list[Slot]]  # per header.caches entry, its slots in order
    attachments: list[list[Slot]]  # per header.attachments entry

    @property
    def layout(self) -> str:
        return "blocks" if self.version == 5 else "whole"

    @property
    def blocks_dir(self) -> str:
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), BLOCKS_DIR)

    def slots(self) -> list[Slot]:
        return [s for group in (*self.caches, *self.attachments) for s in group]

    def tensor_source(self) -> SafetensorsHeader:
        """The slots as a checked safetensors description, for ``TensorReader`` (whole layout)."""
        if self.layout != "whole":
            raise SnapshotError(f"{_where(self.path)}: format 5 keeps its tensors in blocks, not in the file")
        return SafetensorsHeader(
            self.path, {}, {s.info.name: s.info for s in self.slots()}, self.data_start, self.file_size
        )


# -- reading the container -----------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_prefix(path: str) -> tuple[bytes, int, int, int, bytes, int]:
    """(magic, headerLen, dataStart, headerHash, header bytes, file size), the hash checked."""
    where = _where(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(PREFIX_LEN)
            if head[: len(MAGIC)] == OLD_MAGIC:
                raise FormatVersionError(
                    f"{path}: an mlx-bun v1 cache file (MLXBUNKV1): mlx-bun never migrates these and "
                    f"neither does mlxkv; mlxkv reads mlx-bun versions {', '.join(map(str, VERSIONS))}"
                )
            if head[: len(MAGIC)] != MAGIC:
                raise SnapshotError(f"{path}: not an mlx-bun KV v2 cache file (no MLXBUNKV2 magic)")
            if len(head) < PREFIX_LEN:
                raise CorruptSnapshotError(f"{where}: truncated: {size} bytes, not even the 26-byte prefix")
            magic, header_len, data_start, header_hash = PREFIX.unpack(head)
            if header_len > MAX_HEADER or PREFIX_LEN + header_len > size:
                raise CorruptSnapshotError(
                    f"{where}: truncated or damaged: header length {header_len} does not fit a {size}-byte file"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from e
    if wyhash(raw) != header_hash:
        raise CorruptSnapshotError(
            f"{where}: header hash mismatch (stored {hex16(header_hash)}, computed {hex16(wyhash(raw))}): "
            "truncated or corrupt"
        )
    return magic, header_len, data_start, header_hash, raw, size


def _parse_slot(where: str, name: str, raw, version: int) -> tuple:
    """(dtype name, shape, off, bytes, hash, blocks) of one slot, each checked."""
    if not isinstance(raw, dict):
        raise CorruptSnapshotError(f"{where}: tensor slot {name} is not an object")
    off, nbytes, shape, code, h = (raw.get(k) for k in ("off", "bytes", "shape", "dtype", "hash"))
    if not _is_int(off) or off < 0 or not _is_int(nbytes) or nbytes < 0:
        raise CorruptSnapshotError(f"{where}: tensor slot {name}: off {off!r} / bytes {nbytes!r} must be integers >= 0")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptSnapshotError(f"{where}: tensor slot {name}: shape {shape!r} is not a list of integers >= 0")
    if not _is_int(code):
        raise CorruptSnapshotError(f"{where}: tensor slot {name}: dtype {code!r} is not an mlx-c dtype code")
    if code in UNSUPPORTED_CODES:
        raise CorruptSnapshotError(
            f"{where}: tensor slot {name}: dtype code {code} ({UNSUPPORTED_CODES[code]}) is not a dtype mlxkv holds"
        )
    dtype = DTYPE_OF_CODE.get(code)
    if dtype is None:
        raise CorruptSnapshotError(f"{where}: tensor slot {name}: unknown mlx-c dtype code {code}")
    if _nbytes(shape, dtype) != nbytes:
        raise CorruptSnapshotError(
            f"{where}: tensor slot {name}: {nbytes} bytes do not hold shape {shape} of {dtype} "
            f"({_nbytes(shape, dtype)} bytes)"
        )
    blocks = []
    if version == 5:
        if not isinstance(h, str):
            raise CorruptSnapshotError(f"{where}: tensor slot {name}: hash must be a string")
        raw_blocks = raw.get("blocks", [])
        if not isinstance(raw_blocks, list):
            raise CorruptSnapshotError(f"{where}: tensor slot {name}: blocks must be a list")
        for b in raw_blocks:
            bh, bn = (b.get("hash"), b.get("bytes")) if isinstance(b, dict) else (None, None)
            if not isinstance(bh, str) or not _SHA256.fullmatch(bh) or not _is_int(bn) or bn <= 0:
                raise CorruptSnapshotError(f"{where}: tensor slot {name}: invalid KV block reference {b!r}")
            blocks.append((bh, bn))
        if sum(n for _, n in blocks) != nbytes:
            raise CorruptSnapshotError(
                f"{where}: tensor slot {name}: blocks hold {sum(n for _, n in blocks)} bytes, the slot {nbytes}"
            )
    elif not isinstance(h, str) or not _HASH16.fullmatch(h):
        raise CorruptSnapshotError(f"{where}: tensor slot {name}: hash {h!r} is not 16 lowercase hex digits")
    return dtype, shape, off, nbytes, h, blocks


def read_mlx_bun(path: str) -> MlxBunFile:
    """Parse and check the container of ``path``; reads no tensor bytes."""
    where = _where(path)
    _, header_len, data_start, header_hash, raw, size = read_prefix(path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptSnapshotError(f"{where}: damaged header: not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptSnapshotError(f"{where}: damaged header: not a JSON object")
    version = header.get("formatVersion")
    if not _is_int(version):
        raise CorruptSnapshotError(f"{where}: formatVersion {version!r} missing or not an integer")
    if version not in VERSIONS:
        raise FormatVersionError(
            f"{where}: unsupported formatVersion {version}; mlxkv reads mlx-bun versions "
            f"{', '.join(map(str, VERSIONS))}"
            + (" (mlx-bun never migrates older files either)" if version < VERSIONS[0] else "")
        )
    if data_start < PREFIX_LEN + header_len:
        raise CorruptSnapshotError(
            f"{where}: dataStart {data_start} lies inside the {PREFIX_LEN + header_len}-byte prefix and header"
        )
    groups = {}
    for key in ("caches", "attachments"):
        entries = header.get(key, [])
        if not isinstance(entries, list):
            raise CorruptSnapshotError(f"{where}: {key} must be a list")
        groups[key] = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), list):
                raise CorruptSnapshotError(f"{where}: {key} entry {i} is malformed (no tensors list)")
            slots = []
            for j, raw_slot in enumerate(entry["tensors"]):
                name = f"{key}.{i}.{j}"
                dtype, shape, off, nbytes, h, blocks = _parse_slot(where, name, raw_slot, version)
                begin = data_start + off
                if version != 5 and nbytes and begin + nbytes > size:
                    raise CorruptSnapshotError(
                        f"{where}: truncated: tensor {name} ends at byte {begin + nbytes} of a {size}-byte file"
                    )
                slots.append(
                    Slot(TensorInfo(name, dtype, shape, begin, begin + nbytes), raw_slot["dtype"], off, h, blocks)
                )
            groups[key].append(slots)
    if version != 5:
        spans = sorted(
            (s.info.begin, s.info.end, s.info.name) for g in groups.values() for e in g for s in e if s.nbytes
        )
        for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
            if begin < end:
                raise CorruptSnapshotError(f"{where}: damaged header: tensors {a} and {b} overlap")
    return MlxBunFile(
        path, version, header, header_len, data_start, header_hash, size, groups["caches"], groups["attachments"]
    )


# -- reading and checking tensor bytes -----------------------------------------------------


def slot_hash(f: MlxBunFile, slot: Slot, fd: int) -> str:
    """Zig wyhash of a whole-layout slot's stored bytes, read in chunks from ``fd``."""
    h, pos, end = Wyhash(), slot.info.begin, slot.info.end
    while pos < end:
        chunk = os.pread(fd, min(_CHUNK, end - pos), pos)
        if not chunk:
            raise CorruptSnapshotError(f"{_where(f.path)}: truncated while hashing tensor {slot.info.name}")
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()


def read_block_bytes(f: MlxBunFile, slot: Slot, verify: bool) -> bytearray:
    """A format-5 slot's bytes: its blocks concatenated; with ``verify``, each block's sha256."""
    out, pos = bytearray(slot.nbytes), 0
    for digest, n in slot.blocks:
        path = os.path.join(f.blocks_dir, digest)
        try:
            with open(path, "rb") as b:
                part = b.read(n + 1)
        except OSError as e:
            raise CorruptSnapshotError(
                f"{_where(f.path)}: tensor {slot.info.name}: block {digest} cannot be read ({e.strerror or e})"
            ) from None
        if len(part) != n:
            raise CorruptSnapshotError(
                f"{_where(f.path)}: tensor {slot.info.name}: block {digest} holds {len(part)} bytes, the header "
                f"says {n}"
            )
        if verify and hashlib.sha256(part).hexdigest() != digest:
            raise CorruptSnapshotError(f"{_where(f.path)}: tensor {slot.info.name}: KV block hash mismatch ({digest})")
        out[pos : pos + n] = part
        pos += n
    return out


def check_slot(f: MlxBunFile, slot: Slot, fd: int | None) -> None:
    """Refuse a slot whose stored bytes disagree with its hash (or its blocks' sha256)."""
    if f.layout == "blocks":
        read_block_bytes(f, slot, verify=True)
        return
    got = slot_hash(f, slot, fd)
    if got != slot.hash:
        raise CorruptSnapshotError(
            f"{_where(f.path)}: tensor hash mismatch in {slot.info.name} (stored {slot.hash}, computed {got}): "
            "the file is damaged"
        )


def array_from_bytes(data, dtype: str, shape: Sequence[int]) -> mx.array:
    """An MLX array of ``dtype`` (a safetensors name) over the row-major bytes ``data``."""
    raw = np.frombuffer(bytes(data), dtype=np.dtype(DTYPES[dtype][1]).newbyteorder("<")).reshape(shape)
    a = mx.array(raw)
    return a.view(mx.bfloat16) if dtype == "BF16" else a


# -- writing -------------------------------------------------------------------------------


def new_slot(a: mx.array) -> dict:
    """The header slot of array ``a`` before layout: ``off`` and ``hash`` are filled by the writer."""
    code = CODE_OF_DTYPE.get(dtype_name(a))
    if code is None:  # pragma: no cover - dtype_name already refuses what mlxkv cannot store
        raise SnapshotError(f"arrays of dtype {a.dtype} have no mlx-c dtype code")
    return {"off": 0, "bytes": a.nbytes, "shape": [int(d) for d in a.shape], "dtype": code, "hash": HASH_PLACEHOLDER}


def _js_number(x: float) -> str:
    """``Number.prototype.toString`` (what ``JSON.stringify`` writes) of a float."""
    if not math.isfinite(x):
        return "null"
    if x == 0:
        return "0"
    if x < 0:
        return "-" + _js_number(-x)
    if x.is_integer() and x < 2**53:
        return str(int(x))
    _, digits, exp = decimal.Decimal(repr(x)).as_tuple()
    d = "".join(map(str, digits)).rstrip("0")
    exp += len(digits) - len(d)
    k, n = len(d), exp + len(d)  # x = 0.d * 10**n
    if k <= n <= 21:
        return d + "0" * (n - k)
    if 0 < n <= 21:
        return d[:n] + "." + d[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + d
    e = n - 1
    return (d[0] + ("." + d[1:] if k > 1 else "")) + "e" + ("+" if e >= 0 else "-") + str(abs(e))


def js_json(value) -> str:
    """``JSON.stringify(value)``: no whitespace, keys in insertion order, non-ASCII as is."""
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=False) + ":" + js_json(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(js_json(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value) if abs(value) < 2**53 else _js_number(float(value))
    if isinstance(value, float):
        return _js_number(value)
    raise SnapshotError(f"mlx-bun headers hold JSON values only, not {type(value).__name__}")


def lay_out(header: dict) -> list[dict]:
    """Assign every slot's ``off`` as mlx-bun's planner does; returns the slots in write order.

    Cache tensors: ``off = alignUp(cursor)``, cursor = off + bytes. Attachment tensors (the
    quirk): ``off = cursor`` unaligned, then cursor = alignUp(off + bytes).
    """
    slots, cursor = [], 0
    for entry in header.get("caches", []):
        for s in entry["tensors"]:
            s["off"] = align_up(cursor)
            cursor = s["off"] + s["bytes"]
            slots.append(s)
    for att in header.get("attachments", []):
        for s in att["tensors"]:
            s["off"] = cursor
            cursor = align_up(cursor + s["bytes"])
            slots.append(s)
    return slots


def prefix_bytes(header_json: bytes, data_start: int) -> bytes:
    return PREFIX.pack(MAGIC, len(header_json), data_start, wyhash(header_json)) + header_json


def write_mlx_bun(
    path: str,
    header: dict,
    arrays: Sequence[mx.array],
    *,
    layout: str = "whole",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
) -> dict:
    """Write ``header`` (slots made by :func:`new_slot`, in cache-then-attachment order, one
    per array of ``arrays``) and the arrays as an mlx-bun file; returns the header written.

    ``layout="whole"`` is formats 3/4 (the tensors in the file); ``"blocks"`` is format 5:
    the file holds the prefix and header only, each tensor is cut into content-addressed
    blocks under ``<dir>/blocks/`` (a block never crosses a ``[T, F]`` plane, at most
    ``block_bytes`` each).
    """
    slots = lay_out(header)
    if len(slots) != len(arrays):
        raise SnapshotError(f"internal error: {len(slots)} slots for {len(arrays)} arrays")
    if layout == "blocks":
        return _write_blocks(path, header, slots, arrays, block_bytes, progress, fsync)
    if layout != "whole":
        raise SnapshotError(f"unknown mlx-bun layout {layout!r}: 'whole' (formats 3, 4) or 'blocks' (format 5)")
    header_len = len(js_json(header).encode())
    data_start = align_up(PREFIX_LEN + header_len)
    total = sum(s["bytes"] for s in slots)

    def fill(f):
        done = 0
        for s, a in zip(slots, arrays):
            buf = array_buffer(a)
            if buf.nbytes != s["bytes"]:
                raise SnapshotError(f"internal error: tensor byte-length drift ({s['bytes']} planned, {buf.nbytes})")
            s["hash"] = hex16(wyhash(buf))
            if buf.nbytes:
                f.seek(data_start + s["off"])
                f.write(buf)
                if fsync:
                    f.flush()
                    start_writeback(f.fileno(), data_start + s["off"], buf.nbytes)
            done += buf.nbytes
            del buf
            if progress:
                progress(done, total)
        text = js_json(header).encode()
        if len(text) != header_len:
            raise SnapshotError("internal error: mlx-bun header length drift")
        f.seek(0)
        f.write(prefix_bytes(text, data_start))
        f.write(bytes(data_start - PREFIX_LEN - header_len))

    write_file_atomically(path, fill, fsync)
    return header


def block_spans(shape: Sequence[int], itemsize: int, block_bytes: int) -> list[tuple[int, int]]:
    """mlx-bun's segmented chunking, in elements: (start, count) per block. A block holds at
    most ``max(1, block_bytes // itemsize)`` elements and never crosses a row, a row being
    the product of the last two dimensions."""
    size = math.prod(shape)
    row = math.prod(shape[-2:]) if shape else 1
    limit = max(1, block_bytes // itemsize)
    spans, start = [], 0
    while start < size:
        count = min(limit, row - start % row, size - start)
        spans.append((start, count))
        start += count
    return spans


def _write_blocks(path, header, slots, arrays, block_bytes, progress, fsync) -> dict:
    if not _is_int(block_bytes) or block_bytes <= 0:
        raise SnapshotError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    root = os.path.join(os.path.dirname(os.path.abspath(path)), BLOCKS_DIR)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot create {root}: {e}") from e
    total, done = sum(s["bytes"] for s in slots), 0
    for s, a in zip(slots, arrays):
        buf = array_buffer(a)
        item = a.itemsize
        s["blocks"] = []
        for start, count in block_spans(s["shape"], item, block_bytes):
            chunk = buf[start * item : (start + count) * item]
            digest = hashlib.sha256(chunk).hexdigest()
            s["blocks"].append({"hash": digest, "bytes": len(chunk)})
            dest = os.path.join(root, digest)
            if not os.path.exists(dest):
                write_file_atomically(dest, lambda f, c=chunk: f.write(c), fsync)
        s["hash"] = ""
        done += buf.nbytes
        del buf
        if progress:
            progress(done, total)
    header["formatVersion"] = 5
    text = js_json(header).encode()
    write_file_atomically(path, lambda f: f.write(prefix_bytes(text, PREFIX_LEN + len(text))), fsync)
    return header
