"""mlx-bun's cache-file container (``MLXBUNKV2``, formatVersion 3, 4 and 5): reader and writer.

The TypeScript engine mlx-bun writes its SSD-tier cache files in this layout (docs/mlx-bun.md
is the normative description). This module knows the container only: the 26-byte prefix,
the header hash (Zig's wyhash), the JSON header's ``caches`` / ``attachments`` lists of
tensor records, mlx-c dtype codes, byte ranges, blocks. It knows no cache kind: which record
holds which slot, and what the entry fields mean, is the format's business (``formats/mlxbun.py``).

Reading: an :class:`MlxBunFile` is opened once (a :class:`~mlxkv.io.tensor_file.TensorFile`,
like mlxkv's own ``SafetensorsFile``); its ``header`` (:class:`MlxBunHeader`) is checked
before a tensor byte is read (docs/mlx-bun.md section 8, steps 1-9: the prefix, the header
hash, JSON as I-JSON restricts it, the version, every tensor record's ``off``, ``bytes``, ``shape``,
``dtype``, hash and blocks with exact integer arithmetic, the byte ranges against the file,
the attachments), and :class:`~mlxkv.io.tensor_reader.TensorReader` reads the tensors of a
"whole" file through the same descriptor, each wyhash checked as it arrives. Format 5's
blocks are read with :func:`read_block_tensor`: each block through one descriptor of its
own, its sha256 checked over the very bytes that are kept.

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
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..checks import is_count, is_int
from ..errors import CorruptSnapshotError, FormatVersionError, SnapshotError
from . import strict_json
from .atomic import start_writeback, write_file_atomically
from .safetensors import DTYPES, ITEMSIZE, MAX_HEADER, array_buffer, checked_shape, dtype_name
from .tensor_file import Checksum, TensorFile, TensorInfo, open_regular
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
#: the keys of a tensor record (format 5 adds ``blocks``), of a block reference, of an attachment
RECORD_KEYS = frozenset({"off", "bytes", "shape", "dtype", "hash"})
BLOCK_KEYS = frozenset({"hash", "bytes"})
ATTACHMENT_KEYS = frozenset({"schema", "metadata", "tensors"})

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

#: mlx-bun files check every tensor with Zig's wyhash (docs/mlx-bun.md section 2)
WYHASH = Checksum(Wyhash, "tensor hash mismatch in {name} (stored {stored}, computed {computed}): the file is damaged")


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_mlx_bun_magic(head: bytes) -> bool:
    """Do the first bytes of a file say mlx-bun cache file (either generation)?"""
    return head[: len(MAGIC)] in (MAGIC, OLD_MAGIC)


def _where(path: str) -> str:
    return f"{path}: mlx-bun cache file"


def _show(value, n: int = 80) -> str:
    """A value as a message shows it: its repr, cut to ``n`` characters."""
    return repr(value)[:n]


# -- the checked description -----------------------------------------------------------------


@dataclass
class TensorRecord:
    """One tensor of an mlx-bun header (mlx-bun's ``TensorSlot``; in mlxkv a slot is the name
    of an entry's tensor): where its bytes are and how to check them."""

    info: TensorInfo  # name "caches.<i>.<j>" / "attachments.<i>.<j>"; absolute offsets (whole layout)
    code: int  # the mlx-c dtype code as stored
    off: int  # the record's ``off``, verbatim (relative to dataStart)
    hash: str  # 16 hex digits (formats 3, 4); "" in format 5
    blocks: list[tuple[str, int]] = field(default_factory=list)  # format 5: (sha256 hex, bytes)

    @property
    def nbytes(self) -> int:
        return self.info.end - self.info.begin


@dataclass
class MlxBunHeader:
    """The checked prefix and header of an mlx-bun file; ``header`` is the JSON as written."""

    path: str
    version: int
    header: dict
    header_len: int
    data_start: int
    header_hash: int
    file_size: int
    caches: list[list[TensorRecord]]  # per header.caches entry, its tensors in order
    attachments: list[list[TensorRecord]]  # per header.attachments entry

    @property
    def where(self) -> str:
        return _where(self.path)

    @property
    def layout(self) -> str:
        return "blocks" if self.version == 5 else "whole"

    @property
    def blocks_dir(self) -> str:
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), BLOCKS_DIR)

    def records(self) -> list[TensorRecord]:
        return [r for group in (*self.caches, *self.attachments) for r in group]

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by name, for ``TensorReader`` (format 5 keeps none in the file)."""
        return {} if self.layout == "blocks" else {r.info.name: r.info for r in self.records()}


# -- checking the container ------------------------------------------------------------------


def _damaged(where: str, why: str):
    raise CorruptSnapshotError(f"{where}: {why}")


def parse_prefix(head: bytes, size: int, path: str) -> tuple[int, int, int]:
    """(headerLen, dataStart, headerHash) of the first bytes ``head`` of a ``size``-byte file
    (steps 1-2 of docs/mlx-bun.md section 8). Pure: no I/O."""
    if head[: len(OLD_MAGIC)] == OLD_MAGIC:
        raise FormatVersionError(
            f"{path}: an mlx-bun v1 cache file (MLXBUNKV1): mlx-bun never migrates these and "
            f"neither does mlxkv; mlxkv reads mlx-bun versions {', '.join(map(str, VERSIONS))}"
        )
    if head[: len(MAGIC)] != MAGIC:
        raise SnapshotError(f"{path}: not an mlx-bun KV v2 cache file (no MLXBUNKV2 magic)")
    where = _where(path)
    if len(head) < PREFIX_LEN:
        _damaged(where, f"truncated: {size} bytes, not even the 26-byte prefix")
    _, header_len, data_start, header_hash = PREFIX.unpack(head[:PREFIX_LEN])
    if header_len > MAX_HEADER or PREFIX_LEN + header_len > size:
        _damaged(where, f"truncated or damaged: header length {header_len} does not fit a {size}-byte file")
    return header_len, data_start, header_hash


def check_header_hash(raw: bytes, header_hash: int, path: str) -> None:
    """Step 3: the stored header hash is the wyhash of the header bytes."""
    got = wyhash(raw)
    if got != header_hash:
        _damaged(
            _where(path),
            f"header hash mismatch (stored {hex16(header_hash)}, computed {hex16(got)}): truncated or corrupt",
        )


def _check_version(where: str, doc: dict) -> int:
    version = doc.get("formatVersion")
    if not is_int(version):
        _damaged(where, f"formatVersion {_show(version, 40)} missing or not an integer")
    if version not in VERSIONS:
        raise FormatVersionError(
            f"{where}: unsupported formatVersion {version}; mlxkv reads mlx-bun versions "
            f"{', '.join(map(str, VERSIONS))}"
            + (" (mlx-bun never migrates older files either)" if version < VERSIONS[0] else "")
        )
    return version


def _parse_blocks(where: str, name: str, raw, nbytes: int) -> list[tuple[str, int]]:
    if type(raw) is not list:
        _damaged(where, f"tensor {name}: blocks must be a list")
    blocks = []
    for b in raw:
        if type(b) is not dict or b.keys() != BLOCK_KEYS:
            _damaged(where, f"tensor {name}: invalid KV block reference {_show(b)} (exactly hash, bytes)")
        digest, n = b["hash"], b["bytes"]
        if type(digest) is not str or not _SHA256.fullmatch(digest) or not is_count(n) or n == 0:
            _damaged(where, f"tensor {name}: invalid KV block reference {_show(b)}")
        blocks.append((digest, n))
    total = sum(n for _, n in blocks)
    if total != nbytes:
        _damaged(where, f"tensor {name}: blocks hold {total} bytes, the tensor {nbytes}")
    return blocks


def parse_tensor_record(where: str, name: str, raw, version: int) -> tuple:
    """(dtype name, shape, code, off, bytes, hash, blocks) of one tensor record, each checked
    (step 8)."""
    keys = RECORD_KEYS | {"blocks"} if version == 5 else RECORD_KEYS
    if type(raw) is not dict or raw.keys() != keys:
        _damaged(where, f"tensor {name} is not an object of exactly {', '.join(sorted(keys))}")
    off, nbytes, shape, code, h = (raw[k] for k in ("off", "bytes", "shape", "dtype", "hash"))
    if not is_count(off) or not is_count(nbytes):
        _damaged(where, f"tensor {name}: off {_show(off, 40)} / bytes {_show(nbytes, 40)} must be integers >= 0")
    if checked_shape(shape) is None:
        _damaged(where, f"tensor {name}: shape must be a list of at most 8 integers in 0..2^31-1, got {_show(shape)}")
    if not is_int(code):
        _damaged(where, f"tensor {name}: dtype {_show(code, 40)} is not an mlx-c dtype code")
    if code in UNSUPPORTED_CODES:
        _damaged(where, f"tensor {name}: dtype code {code} ({UNSUPPORTED_CODES[code]}) is not a dtype mlxkv holds")
    dtype = DTYPE_OF_CODE.get(code)
    if dtype is None:
        _damaged(where, f"tensor {name}: unknown mlx-c dtype code {code}")
    want = math.prod(shape) * ITEMSIZE[dtype]  # exact: Python integers do not wrap
    if want != nbytes:
        _damaged(where, f"tensor {name}: {nbytes} bytes do not hold shape {shape} of {dtype} ({want} bytes)")
    if version == 5:
        if h != "":
            _damaged(where, f'tensor {name}: hash must be "" in format 5 (its blocks carry sha256 names)')
        return dtype, shape, code, off, nbytes, h, _parse_blocks(where, name, raw["blocks"], nbytes)
    if type(h) is not str or not _HASH16.fullmatch(h):
        _damaged(where, f"tensor {name}: hash {_show(h, 40)} is not 16 lowercase hex digits")
    return dtype, shape, code, off, nbytes, h, []


def _check_metadata(where: str, i: int, raw: dict) -> None:
    schema, metadata = raw["schema"], raw["metadata"]
    if type(schema) is not str or type(metadata) is not dict:
        _damaged(where, f"attachment {i} needs a string schema and a metadata object")
    for k, v in metadata.items():
        if type(v) not in (str, int, float, bool):
            _damaged(
                where,
                f"attachment {i} ({schema[:40]}): metadata {k[:40]!r} is {_show(v, 40)}, "
                "not a string, number or boolean",
            )


def _groups(where: str, doc: dict, version: int, data_start: int) -> dict:
    """Step 7, and step 8 per tensor: ``caches`` and ``attachments`` as lists of tensor-record lists."""
    if type(doc.get("caches")) is not list:
        _damaged(where, "caches must be a list")
    attachments = doc.get("attachments")
    if attachments is not None and (type(attachments) is not list or not attachments):
        _damaged(where, "attachments, when present, must be a non-empty list")
    if version == 3 and attachments is not None:
        _damaged(where, "a format-3 file has attachments (mlx-bun writes them as format 4 or 5)")
    if version == 4 and attachments is None:
        _damaged(where, "a format-4 file without attachments (mlx-bun writes it as format 3)")
    groups = {}
    for key in ("caches", "attachments"):
        groups[key] = []
        for i, entry in enumerate(doc.get(key) or []):
            if type(entry) is not dict or type(entry.get("tensors")) is not list:
                _damaged(where, f"{key} entry {i} is malformed (not an object with a tensors list)")
            if key == "attachments":
                if entry.keys() != ATTACHMENT_KEYS:
                    _damaged(where, f"attachment {i} must have exactly schema, metadata, tensors")
                _check_metadata(where, i, entry)
            records = []
            for j, raw in enumerate(entry["tensors"]):
                name = f"{key}.{i}.{j}"
                dtype, shape, code, off, nbytes, h, blocks = parse_tensor_record(where, name, raw, version)
                begin = data_start + off
                records.append(
                    TensorRecord(TensorInfo(name, dtype, shape, begin, begin + nbytes), code, off, h, blocks)
                )
            groups[key].append(records)
    return groups


def _check_ranges(where: str, records: list[TensorRecord], data_start: int, size: int) -> None:
    """Step 9 (formats 3, 4): every stored tensor inside the file, none overlapping, and
    nothing after the last (nor the padding before ``dataStart`` missing)."""
    spans = sorted((r.info.begin, r.info.end, r.info.name) for r in records if r.nbytes)
    for _, end, name in spans:
        if end > size:
            _damaged(where, f"truncated: tensor {name} ends at byte {end} of a {size}-byte file")
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            _damaged(where, f"damaged header: tensors {a} and {b} overlap")
    last = max([data_start] + [end for _, end, _ in spans])
    if size != last:
        _damaged(where, f"{size - last:+d} bytes after the last tensor: truncated or damaged file")


def parse_mlx_bun_header(doc, header_len: int, data_start: int, header_hash: int, size: int, path: str) -> MlxBunHeader:
    """Check the parsed JSON header ``doc`` of a ``size``-byte file whose prefix says
    ``header_len`` and ``data_start`` (steps 4-9 of docs/mlx-bun.md section 8). Pure: no I/O."""
    where = _where(path)
    if type(doc) is not dict:
        _damaged(where, "damaged header: not a JSON object")
    version = _check_version(where, doc)
    end = PREFIX_LEN + header_len
    if version == 5:
        if data_start != end:
            _damaged(where, f"dataStart {data_start} is not {end}, where a format-5 header ends")
        if size != end:
            _damaged(where, f"{size - end:+d} bytes after the header of a format-5 file (its tensors are in blocks)")
    elif not end <= data_start <= size:
        _damaged(where, f"dataStart {data_start} lies outside {end}..{size} (after the header, inside the file)")
    groups = _groups(where, doc, version, data_start)
    f = MlxBunHeader(
        path, version, doc, header_len, data_start, header_hash, size, groups["caches"], groups["attachments"]
    )
    if version != 5:
        _check_ranges(where, f.records(), data_start, size)
    return f


class MlxBunFile(TensorFile):
    """One open mlx-bun file: its checked ``header`` (:class:`MlxBunHeader`) and the
    descriptor every later read of its tensors goes through."""

    checksum = WYHASH

    @property
    def where(self) -> str:
        return _where(self.path)

    def _read_header(self) -> None:
        head = self.read(PREFIX_LEN, 0)
        header_len, data_start, header_hash = parse_prefix(head, self.size, self.path)
        raw = self.read(header_len, PREFIX_LEN)
        if len(raw) < header_len:
            _damaged(self.where, "truncated while reading its header")
        check_header_hash(raw, header_hash, self.path)
        doc = strict_json.loads(raw, f"{self.where}: header")
        self.header = parse_mlx_bun_header(doc, header_len, data_start, header_hash, self.size, self.path)
        self.tensors = self.header.tensors


def read_mlx_bun(path: str) -> MlxBunHeader:
    """Parse and check the container of ``path``; reads no tensor bytes."""
    with MlxBunFile(path) as f:
        return f.header


# -- format 5: blocks --------------------------------------------------------------------------


_BLOCK_CHUNK = 1 << 20  # bytes a block is verified in when nothing is kept


def _block_path(h: MlxBunHeader, digest: str) -> str:
    return os.path.join(h.blocks_dir, digest)


def _refuse_block(h: MlxBunHeader, record: TensorRecord, digest: str, why: str):
    raise CorruptSnapshotError(f"{h.where}: tensor {record.info.name}: block {digest} {why}")


def _read_block(
    h: MlxBunHeader, record: TensorRecord, digest: str, n: int, into: bytearray | None, verify: bool
) -> None:
    """Block ``digest`` (``n`` bytes) through one descriptor: its size checked on that
    descriptor before anything is allocated for it, its bytes appended to ``into`` (or,
    when nothing is kept, read through a buffer of at most 1 MiB) and, with ``verify``, its
    sha256 taken over the very bytes read."""
    try:
        fd = open_regular(_block_path(h, digest))
    except SnapshotError as e:
        _refuse_block(h, record, digest, f"cannot be read ({str(e).rsplit(': ', 1)[-1]})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _refuse_block(h, record, digest, "cannot be read (not a regular file)")
        if st.st_size != n:
            _refuse_block(h, record, digest, f"holds {st.st_size} bytes, the header says {n}")
        sha = hashlib.sha256() if verify else None
        if into is None:
            at, buf = 0, bytearray(min(n, _BLOCK_CHUNK))
        else:
            at, buf = len(into), into
            into.extend(bytes(n))  # the block's size is on disk: what this allocates is really there
        with memoryview(buf) as mv:  # slices only as temporaries: ``into`` grows again after
            got = 0
            while got < n:
                lo, hi = (at + got, at + n) if into is not None else (0, min(len(mv), n - got))
                k = os.preadv(fd, [mv[lo:hi]], got)
                if not k:
                    _refuse_block(
                        h, record, digest, f"holds {got} bytes, the header says {n} (cut short while reading)"
                    )
                if sha is not None:
                    sha.update(mv[lo : lo + k])
                got += k
    except OSError as e:
        _refuse_block(h, record, digest, f"cannot be read ({e.strerror or e})")
    finally:
        os.close(fd)
    if sha is not None and sha.hexdigest() != digest:
        _refuse_block(h, record, digest, "does not match its sha256 name: KV block hash mismatch")


def verify_blocks(h: MlxBunHeader, record: TensorRecord) -> None:
    """Refuse a format-5 record whose blocks are missing, of the wrong size or damaged; keeps
    nothing (each block is hashed through a buffer of at most 1 MiB)."""
    for digest, n in record.blocks:
        _read_block(h, record, digest, n, None, True)


def read_block_tensor(h: MlxBunHeader, record: TensorRecord, verify: bool) -> mx.array:
    """A format-5 record as an MLX array: its blocks read in order (``_read_block``), the
    bytes growing block by block, so what is allocated never exceeds the block bytes really
    on disk, whatever the header claims."""
    raw = bytearray()
    for digest, n in record.blocks:
        _read_block(h, record, digest, n, raw, verify)
    import numpy as np  # here: reading a header (inspect, verify) needs no numpy

    a = np.frombuffer(raw, np.dtype(DTYPES[record.info.dtype][1]).newbyteorder("<")).reshape(record.info.shape)
    a = mx.array(a)
    return a.view(mx.bfloat16) if record.info.dtype == "BF16" else a


# -- writing -------------------------------------------------------------------------------


def new_tensor_record(a: mx.array) -> dict:
    """The header's tensor record of array ``a`` before layout: ``off`` and ``hash`` are filled by
    the writer."""
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
    """Assign every record's ``off`` as mlx-bun's planner does; returns the records in write order.

    Cache tensors: ``off = alignUp(cursor)``, cursor = off + bytes. Attachment tensors (the
    quirk): ``off = cursor`` unaligned, then cursor = alignUp(off + bytes).
    """
    records, cursor = [], 0
    for entry in header.get("caches", []):
        for s in entry["tensors"]:
            s["off"] = align_up(cursor)
            cursor = s["off"] + s["bytes"]
            records.append(s)
    for att in header.get("attachments", []):
        for s in att["tensors"]:
            s["off"] = cursor
            cursor = align_up(cursor + s["bytes"])
            records.append(s)
    return records


def prefix_bytes(header_json: bytes, data_start: int) -> bytes:
    return PREFIX.pack(MAGIC, len(header_json), data_start, wyhash(header_json)) + header_json


def planned(path: str, header: dict) -> MlxBunHeader:
    """``header`` (tensor records made by :func:`new_tensor_record`) laid out as the whole layout writes it,
    and checked as a reader checks a file (steps 4-9 of docs/mlx-bun.md section 8), before
    anything is written: a write never leaves a file a reader refuses."""
    records = lay_out(header)
    try:
        raw = js_json(header).encode()
    except UnicodeEncodeError:
        raise SnapshotError(f"{path}: a string of the header holds a lone UTF-16 surrogate: not JSON") from None
    doc = strict_json.loads(raw, f"{_where(path)}: header")
    data_start = align_up(PREFIX_LEN + len(raw))
    size = max([data_start] + [data_start + s["off"] + s["bytes"] for s in records if s["bytes"]])
    return parse_mlx_bun_header(doc, len(raw), data_start, 0, size, path)


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
    """Write ``header`` (tensor records made by :func:`new_tensor_record`, in cache-then-attachment order, one
    per array of ``arrays``) and the arrays as an mlx-bun file; returns the header written.

    ``layout="whole"`` is formats 3/4 (the tensors in the file); ``"blocks"`` is format 5:
    the file holds the prefix and header only, each tensor is cut into content-addressed
    blocks under ``<dir>/blocks/`` (a block never crosses a ``[T, F]`` plane, at most
    ``block_bytes`` each).
    """
    records = lay_out(header)
    if len(records) != len(arrays):
        raise SnapshotError(f"internal error: {len(records)} records for {len(arrays)} arrays")
    if layout == "blocks":
        return _write_blocks(path, header, records, arrays, block_bytes, progress, fsync)
    if layout != "whole":
        raise SnapshotError(f"unknown mlx-bun layout {layout!r}: 'whole' (formats 3, 4) or 'blocks' (format 5)")
    header_len = len(js_json(header).encode())
    data_start = align_up(PREFIX_LEN + header_len)
    total = sum(s["bytes"] for s in records)

    def fill(f):
        done = 0
        for s, a in zip(records, arrays):
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


def _write_blocks(path, header, records, arrays, block_bytes, progress, fsync) -> dict:
    if not is_int(block_bytes) or block_bytes <= 0:
        raise SnapshotError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    root = os.path.join(os.path.dirname(os.path.abspath(path)), BLOCKS_DIR)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot create {root}: {e}") from e
    total, done = sum(s["bytes"] for s in records), 0
    for s, a in zip(records, arrays):
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
