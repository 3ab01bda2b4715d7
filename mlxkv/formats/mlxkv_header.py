"""The mlxkv header of a snapshot, checked before a single tensor byte is read.

``check_header`` applies steps 9-19 of docs/format.md section 8, in that order, to a
safetensors header the io layer has checked (steps 1-8; a file's, or one a prompt store's
shared tier assembled from a manifest): the metadata keys, the header
checksum, the version, the provider, every field's type and range, every tensor reference,
and each kind's own rules. Whatever it accepts, a reader can restore without allocating
more than the header announces; whatever it refuses raises a :class:`SnapshotError`
(mostly :class:`CorruptSnapshotError`) that names the file and what is wrong.
"""

import re

from ..caches.schemes import check_pending
from ..checks import INT32_MAX, is_count32, is_count32_list, is_int
from ..codecs.base import check_entry
from ..errors import CorruptSnapshotError, FormatVersionError, MLXKVError, SnapshotError
from ..families import family_of_persisted
from ..io import strict_json
from ..io.safetensors import SafetensorsHeader, crc32_hex
from ..state.identity import RECORDED_FIELDS

FORMAT_VERSION = 2  # 2: generationCheckpoint in mlx-bun's layout (docs/format.md section 9)
CODEC_PROVIDER = "mlxkv"
ACCEPTED_PROVIDERS = ("mlxkv", "mlx-bun")
META_KEY = "mlxkv"
META_CRC_KEY = "mlxkv.crc32"
#: header fields that must be strings (time and identity; "" when unknown)
STRING_FIELDS = ("createdAt", *RECORDED_FIELDS)
_HEX8 = re.compile(r"[0-9a-f]{8}")


def looks_like_a_known_key(key: str) -> bool:
    """A metadata key in mlxkv's namespace, or one or two characters away from one of its
    two keys: what a damaged ``mlxkv`` or ``mlxkv.crc32`` would look like."""
    if key.startswith(META_KEY):
        return True
    return any(len(key) == len(k) and sum(a != b for a, b in zip(key, k)) <= 2 for k in (META_KEY, META_CRC_KEY))


def not_a_snapshot(path: str) -> SnapshotError:
    """The refusal of a safetensors file with no mlxkv header (an mlx-lm prompt cache, weights)."""
    return SnapshotError(
        f"{path}: not an mlxkv snapshot (no {META_KEY!r} metadata); for an mlx-lm prompt-cache file use `mlxkv convert`"
    )


def _checked_text(st: SafetensorsHeader) -> tuple[str, str | None, list[str]]:
    """(the mlxkv string, its checksum or None, metadata keys that look damaged)."""
    path, meta = st.path, st.metadata
    suspicious = sorted(k for k in meta if k not in (META_KEY, META_CRC_KEY) and looks_like_a_known_key(k))
    text = meta.get(META_KEY)
    if text is None:
        if suspicious:
            raise CorruptSnapshotError(
                f"{path}: damaged metadata: no {META_KEY!r} key, but {suspicious[0][:40]!r}, which looks like a "
                "damaged mlxkv key"
            )
        raise not_a_snapshot(path)
    crc = meta.get(META_CRC_KEY)
    if crc is not None and (not _HEX8.fullmatch(crc) or crc != crc32_hex(text.encode())):
        raise CorruptSnapshotError(f"{path}: checksum mismatch in the snapshot header: the file is damaged")
    return text, crc, suspicious


def _check_version(path: str, header: dict) -> None:
    version = header.get("formatVersion")
    if not is_int(version):
        raise CorruptSnapshotError(f"{path}: formatVersion missing or not an integer")
    if not 1 <= version <= FORMAT_VERSION:
        raise FormatVersionError(
            f"{path}: snapshot format version {version}; this mlxkv reads versions 1 to "
            f"{FORMAT_VERSION}" + (": upgrade mlxkv to read it" if version > FORMAT_VERSION else "")
        )


def _check_tensor_refs(st: SafetensorsHeader, i: int, entry: dict, seen: set) -> dict:
    """slot -> shape of entry ``i``'s tensor references, each checked against the file."""
    path, shapes = st.path, {}
    for t in entry["tensors"]:
        name = t.get("name") if type(t) is dict else None
        info = st.tensors.get(name) if type(name) is str else None
        if info is None or name in seen:
            raise CorruptSnapshotError(f"{path}: cache entry {i} names tensor {str(name)[:80]!r}, which the file lacks")
        slot = t.get("slot")
        if type(slot) is not str or name != f"caches.{i}.{slot}":
            raise CorruptSnapshotError(f"{path}: tensor {name!r} is not named caches.{i}.<slot>")
        shape = t.get("shape")  # compared element by element: a bool is not a dimension (True == 1)
        same_shape = type(shape) is list and len(shape) == len(info.shape)
        if info.dtype != t.get("dtype") or not (
            same_shape and all(type(a) is int and a == b for a, b in zip(shape, info.shape))
        ):
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: header says {str(t.get('dtype'))[:20]} {str(t.get('shape'))[:80]}, "
                f"file holds {info.dtype} {info.shape}"
            )
        crc = t.get("crc32")
        if type(crc) is not str or not _HEX8.fullmatch(crc):
            raise CorruptSnapshotError(f"{path}: tensor {name!r} has no crc32 of 8 lowercase hex digits")
        seen.add(name)
        shapes[slot] = info.shape
    return shapes


def _check_pending(path: str, i: int, pending) -> None:
    if type(pending) is not dict or pending.keys() != {"scheme", "start"}:
        raise CorruptSnapshotError(f"{path}: cache entry {i}: malformed pendingConversion {str(pending)[:80]}")
    if type(pending["scheme"]) is not str or not pending["scheme"].isascii() or not is_count32(pending["start"]):
        raise CorruptSnapshotError(f"{path}: cache entry {i}: malformed pendingConversion {str(pending)[:80]}")
    try:
        check_pending(pending)
    except MLXKVError as e:
        raise CorruptSnapshotError(f"{path}: cache entry {i}: pendingConversion names no conversion: {e}") from None


def check_tokens(where: str, tokens) -> list:
    """``tokens`` if it is a list of token ids (mlxkv snapshots and mlx-bun files alike)."""
    if not is_count32_list(tokens):
        raise CorruptSnapshotError(f"{where}: tokens must be a list of token ids (integers in 0..{INT32_MAX})")
    return tokens


def check_position(where: str, i: int, entry: dict, tokens: list) -> None:
    """A positional cache (every kind but plain arrays) is at the offset the tokens reach."""
    offset = entry["offset"]
    if family_of_persisted(entry["kind"]).codec.positional and offset != len(tokens):
        raise CorruptSnapshotError(
            f"{where}: cache entry {i} ({entry['kind']}) is at offset {offset} but the snapshot has "
            f"{len(tokens)} tokens"
        )


def check_header(st: SafetensorsHeader) -> dict:
    """The validated mlxkv header of a checked safetensors header (steps 9-19)."""
    path = st.path
    text, crc, suspicious = _checked_text(st)
    header = strict_json.loads(text, f"{path}: snapshot header")
    if type(header) is not dict:
        raise CorruptSnapshotError(f"{path}: damaged snapshot header: not an object")
    _check_version(path, header)
    if crc is None:
        raise CorruptSnapshotError(f"{path}: the snapshot header has no checksum ({META_CRC_KEY!r}): damaged")
    if suspicious:
        raise CorruptSnapshotError(
            f"{path}: damaged metadata: key {suspicious[0][:40]!r} looks like a damaged mlxkv key"
        )
    provider = header.get("codecProvider")
    if provider not in ACCEPTED_PROVIDERS:
        raise SnapshotError(f"{path}: codec provider {str(provider)[:40]!r} is not one of {ACCEPTED_PROVIDERS}")
    for name in STRING_FIELDS:
        if type(header.get(name)) is not str:
            raise CorruptSnapshotError(f"{path}: {name} must be a string, got {str(header.get(name))[:40]}")
    tokens = check_tokens(path, header.get("tokens"))
    entries = header.get("caches")
    if type(entries) is not list or not entries:
        raise CorruptSnapshotError(f"{path}: the snapshot lists no caches")
    seen = set()
    for i, entry in enumerate(entries):
        if type(entry) is not dict or type(entry.get("tensors")) is not list:
            raise CorruptSnapshotError(f"{path}: cache entry {i} is malformed")
        family_of_persisted(entry.get("kind"))  # an unknown kind is named before its tensors
        shapes = _check_tensor_refs(st, i, entry, seen)
        reuse = entry.get("minimumReusableOffset")
        if not is_count32(reuse):
            raise CorruptSnapshotError(f"{path}: cache entry {i}: minimumReusableOffset must be an integer >= 0")
        try:
            check_entry(entry, shapes)
        except CorruptSnapshotError as e:
            raise CorruptSnapshotError(f"{path}: cache entry {i}: {e}") from None
        offset = entry.get("offset")  # every kind has it; its family's fields type it too
        if not is_count32(offset):
            raise CorruptSnapshotError(f"{path}: cache entry {i}: offset must be an integer in 0..{INT32_MAX}")
        check_position(path, i, entry, tokens)
        if reuse > offset:
            raise CorruptSnapshotError(
                f"{path}: cache entry {i}: minimumReusableOffset {reuse} is beyond its offset {offset}"
            )
        if "pendingConversion" in entry:
            _check_pending(path, i, entry["pendingConversion"])
    extra = set(st.tensors) - seen
    if extra:
        raise CorruptSnapshotError(f"{path}: tensors {sorted(extra)[:8]} belong to no cache entry")
    return header
