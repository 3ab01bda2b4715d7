"""Snapshots: every cache of a model in one safetensors file (docs/format.md).

``save`` encodes each cache through its kind's codec and streams the tensors to an atomic
write; ``load`` opens the file once, checks the whole header (header.py: version,
provider, kinds, fields, slot shapes, byte ranges; then the model's identity and
geometry) before a single tensor is read, and reads every tensor through that one
descriptor, verifying its CRC-32. ``read_header`` is the check without tensor I/O.
"""

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..caches.masks import ForwardMasks
from ..caches.schemes import scheme_for_pending
from ..caches.transition import Bf16FirstCache
from ..errors import (
    CorruptSnapshotError,
    EmptyCacheError,
    GeometryMismatchError,
    IdentityMismatchError,
    MLXKVError,
    SnapshotError,
)
from ..families import family_of_kind, family_of_persisted, kind_of
from ..io.safetensors import (
    CRC_PLACEHOLDER,
    SafetensorsFile,
    SafetensorsHeader,
    TensorInfo,
    check_storable,
    crc32_hex,
    dtype_name,
    write_atomic,
)
from ..io.tensor_reader import TensorReader
from .header import (  # noqa: F401 - the header constants are part of this module's interface
    ACCEPTED_PROVIDERS,
    CODEC_PROVIDER,
    FORMAT_VERSION,
    META_CRC_KEY,
    META_KEY,
    check_header,
)
from .identity import IDENTITY_FIELDS, model_fingerprint, model_geometry, model_identity
from .kinds import is_recurrent_cache


@dataclass
class Snapshot:
    caches: list
    tokens: list[int]
    header: dict
    path: str = ""

    @property
    def generation_checkpoint(self) -> dict | None:
        return self.header.get("generationCheckpoint")


def _is_empty(cache) -> bool:
    if is_recurrent_cache(cache):
        return all(a is None for a in cache.cache)
    return cache.offset == 0


def _encode_all(caches, tokens):
    if not caches:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    entries, tensors = [], []
    for i, cache in enumerate(caches):
        kind = kind_of(cache)
        family = family_of_kind(kind)  # unknown kinds fail before anything is written
        if _is_empty(cache):
            raise EmptyCacheError(f"layer {i} ({kind}) holds no tokens: run the prompt through the model before saving")
        if not is_recurrent_cache(cache) and cache.offset != len(tokens):
            raise SnapshotError(
                f"layer {i} ({kind}) is at offset {cache.offset} but {len(tokens)} tokens were given: "
                "tokens must be the exact prefix the caches encode"
            )
        fields, slots = family.codec.encode(cache.inner if isinstance(cache, Bf16FirstCache) else cache)
        entry = {"kind": family.persisted, **fields, "minimumReusableOffset": cache.minimum_reusable_offset}
        pending = getattr(cache, "pending_conversion", None)
        if pending is not None:
            entry["pendingConversion"] = pending
        entry["tensors"] = []
        for slot, array in slots:
            name = f"caches.{i}.{slot}"
            entry["tensors"].append({"name": name, "slot": slot})
            tensors.append((name, array))
        entries.append(entry)
    return entries, tensors


def _identity(model, given: dict) -> dict:
    """The identity fields to record: what is given, else what the model gives, else ""."""
    derived = model_identity(model) if model is not None else {}
    out = {}
    for key in IDENTITY_FIELDS:
        value = given.get(key)
        value = derived.get(key, "") if value is None else value
        if not isinstance(value, str):
            raise SnapshotError(f"{key} must be a string, got {value!r}")
        out[key] = value
    return out


def _check_readable(path: str, base: dict, tensors) -> None:
    """Run the reader's header checks on what is about to be written, so a save never writes
    a file a reader refuses (a token id out of range, an ssm entry too large, ...)."""
    infos, at = {}, 0
    for name, a in tensors:
        infos[name] = TensorInfo(name, dtype_name(a), list(a.shape), at, at + a.nbytes)
        at += a.nbytes
    for entry in base["caches"]:
        for t in entry["tensors"]:
            info = infos[t["name"]]
            t.update(dtype=info.dtype, shape=info.shape, crc32=CRC_PLACEHOLDER)
    text = json.dumps(base, separators=(",", ":"), ensure_ascii=True)
    meta = {META_KEY: text, META_CRC_KEY: crc32_hex(text.encode())}
    try:
        check_header(SafetensorsHeader(path, meta, infos, 0, at))
    except SnapshotError as e:
        raise SnapshotError(f"{path}: not saved: the snapshot would not read back: {e}") from None


def save(
    path: str,
    caches: Sequence,
    tokens: Sequence[int],
    *,
    model=None,
    model_id: str | None = None,
    config_fingerprint: str | None = None,
    tokenizer_hash: str | None = None,
    ns: str | None = None,
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    created_at: str | None = None,
) -> dict:
    """Write ``caches`` and the ``tokens`` they encode to ``path``; returns the header.

    ``model`` records the identity derived from it (its id and fingerprint,
    ``mlxkv.state.identity``), so that loading into another model is refused; the
    identity keywords, when given, override it. Everything is checked before the file is
    opened; the write is atomic, so a snapshot already at ``path`` survives any failure.
    ``created_at`` pins the timestamp (fixtures).
    """
    try:
        tokens = [int(t) for t in tokens]
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"tokens must be integers: {e}") from None
    entries, tensors = _encode_all(list(caches), tokens)
    for name, a in tensors:
        check_storable(name, a)  # unsupported dtypes and ranks fail before the file is opened
    by_name = dict(tensors)
    identity = _identity(
        model,
        {"model_id": model_id, "config_fingerprint": config_fingerprint, "tokenizer_hash": tokenizer_hash, "ns": ns},
    )
    base = {
        "formatVersion": FORMAT_VERSION,
        "createdAt": created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "codecProvider": CODEC_PROVIDER,
        **{field: identity[key] for key, field in IDENTITY_FIELDS.items()},
        "tokens": tokens,
        "caches": entries,
    }
    if generation_checkpoint is not None:
        base["generationCheckpoint"] = generation_checkpoint
    if attachments:
        base["attachments"] = attachments
    try:
        json.dumps(base)
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot header is not JSON-serializable: {e}") from None
    _check_readable(path, base, tensors)

    final = {}

    def build(crcs: dict[str, str]) -> dict[str, str]:
        for entry in entries:
            for t in entry["tensors"]:
                a = by_name[t["name"]]
                t["dtype"], t["shape"] = dtype_name(a), list(a.shape)
                t["crc32"] = crcs[t["name"]]
        text = json.dumps(base, separators=(",", ":"), ensure_ascii=True)
        final["header"] = base
        return {META_KEY: text, META_CRC_KEY: crc32_hex(text.encode())}

    write_atomic(path, tensors, build, progress=progress, fsync=fsync)
    return final["header"]


# -- reading ------------------------------------------------------------------------------


def read_header(path: str) -> dict:
    """The validated mlxkv header of ``path``; no tensor bytes are read."""
    with SafetensorsFile(path) as file:
        return check_header(file.header)


def _check_expectations(path, header, expect):
    for key, value in expect.items():
        if key not in IDENTITY_FIELDS:
            raise TypeError(f"load() got an unexpected expectation {key!r}")
        if value is None:
            continue
        field_name = IDENTITY_FIELDS[key]
        if header.get(field_name) != value:
            raise IdentityMismatchError(
                f"{path}: {field_name} is {header.get(field_name)!r}, expected {value!r}: "
                "this snapshot belongs to another model, tokenizer, config or adapter"
            )


def _check_model_identity(path, header, model):
    """A snapshot that records a model fingerprint loads only into that model."""
    recorded = header["configFingerprint"]
    if not recorded:
        return  # saved without a model: nothing to compare (the geometry still is)
    mine = model_fingerprint(model)
    if recorded != mine:
        raise IdentityMismatchError(
            f"{path}: the snapshot was computed by another model (fingerprint {recorded[:16]}..., "
            f"this model's is {mine[:16]}...; modelId {header['modelId']!r}): its caches would make this "
            "model generate garbage. Pass allow_other_model=True to load it anyway"
        )


def _check_geometry(path, header, model):
    geo = model_geometry(model)
    entries = header["caches"]
    if len(entries) != geo.layers:
        raise GeometryMismatchError(f"{path}: snapshot has {len(entries)} cache layers, the model has {geo.layers}")
    for i, entry in enumerate(entries):
        shapes = {t["slot"]: t["shape"] for t in entry["tensors"]}
        g = family_of_persisted(entry["kind"]).codec.geometry(entry, shapes)
        if g is None:
            continue
        heads, dim = g
        if (geo.kv_heads is not None and heads != geo.kv_heads) or (geo.head_dim is not None and dim != geo.head_dim):
            raise GeometryMismatchError(
                f"{path}: layer {i} stores {heads} kv heads of dim {dim}; the model has "
                f"{geo.kv_heads} kv heads of dim {geo.head_dim}"
            )


def _decode(path, entry, codec, tensors, masks):
    try:
        cache = codec.decode(entry, tensors)
        mx.eval(cache.state)  # a codec that transforms its slots does it one cache at a time
        cache.minimum_reusable_offset = entry["minimumReusableOffset"]
        if "pendingConversion" in entry:
            cache = Bf16FirstCache(scheme_for_pending(entry["pendingConversion"]), cache)
    except SnapshotError as e:
        raise type(e)(f"{path}: {e}") from None
    except MLXKVError as e:  # the header checks should have refused it: still a refusal of ours
        raise SnapshotError(f"{path}: cannot restore this snapshot: {e}") from None
    cache.masks = masks
    return cache


def load(
    path: str,
    model=None,
    *,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    allow_other_model: bool = False,
    check: Callable[[str, dict], None] | None = None,
    **expect,
) -> Snapshot:
    """Restore a snapshot.

    With ``model``, the snapshot must have been computed by that model: a recorded
    fingerprint that differs from the model's refuses the load (``IdentityMismatchError``)
    unless ``allow_other_model=True``; the layer count and head geometry are always
    compared. ``expect`` takes model_id, config_fingerprint, tokenizer_hash, ns, each
    compared exactly. ``check(path, header)``, if given, runs after every header check and
    before any tensor is read (raise to refuse). The file is opened once: a snapshot
    renamed over ``path`` meanwhile is never mixed with the one being read.
    """
    with SafetensorsFile(path) as file:
        header = check_header(file.header)
        _check_expectations(path, header, expect)
        if model is not None:
            if not allow_other_model:
                _check_model_identity(path, header, model)
            _check_geometry(path, header, model)
        if check is not None:
            check(path, header)
        entries = [(entry, family_of_persisted(entry["kind"]).codec) for entry in header["caches"]]
        requests = [
            (t["name"], t["crc32"] if verify else None, codec.capacity(entry))
            for entry, codec in entries
            for t in entry["tensors"]
        ]
        arrays = TensorReader(file).read_all(requests, progress)
    masks = ForwardMasks()
    caches = [
        _decode(path, entry, codec, {t["slot"]: arrays.pop(t["name"]) for t in entry["tensors"]}, masks)
        for entry, codec in entries
    ]
    return Snapshot(caches, list(header["tokens"]), header, path)


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every checksum of ``path`` without building caches; returns the header."""
    with SafetensorsFile(path) as file:
        header = check_header(file.header)
        st = file.header
        done, total = 0, st.file_size - st.data_start
        reader = TensorReader(file)
        for entry in header["caches"]:
            for t in entry["tensors"]:
                got = reader.checksum(t["name"])
                if got != t["crc32"]:
                    raise CorruptSnapshotError(
                        f"{path}: checksum mismatch in tensor {t['name']!r} (stored {t['crc32']}, "
                        f"computed {got}): the file is damaged"
                    )
                info = st.tensors[t["name"]]
                done += info.end - info.begin
                if progress:
                    progress(done, total)
    return header
