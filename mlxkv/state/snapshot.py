"""Snapshots: every cache of a model in one safetensors file (docs/format.md).

``save`` encodes each cache through its kind's codec and streams the tensors to an atomic
write; ``load`` checks the whole header (version, provider, kinds, identity, geometry, slot
shapes, byte ranges) before a single tensor is read, then reads one tensor at a time and
verifies its CRC-32. ``read_header`` is the check without tensor I/O.
"""

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..caches.masks import ForwardMasks
from ..caches.schemes import scheme_for_pending
from ..caches.transition import Bf16FirstCache
from ..checks import is_int
from ..errors import (
    CorruptSnapshotError,
    EmptyCacheError,
    FormatVersionError,
    GeometryMismatchError,
    IdentityMismatchError,
    SnapshotError,
)
from ..families import family_of_kind, family_of_persisted, kind_of
from ..io.mlxbun import is_mlx_bun_file
from ..io.safetensors import (
    SafetensorsHeader,
    crc32_hex,
    dtype_name,
    read_safetensors_header,
    write_atomic,
)
from ..io.tensor_reader import TensorReader
from .checkpoint import normalized
from .identity import IDENTITY_FIELDS, model_geometry
from .kinds import check_entry, is_recurrent_cache

FORMAT_VERSION = 2  # 2: generationCheckpoint in mlx-bun's layout (docs/format.md section 9)
CODEC_PROVIDER = "mlxkv"
ACCEPTED_PROVIDERS = ("mlxkv", "mlx-bun")
META_KEY = "mlxkv"
META_CRC_KEY = "mlxkv.crc32"


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


def encode_layer(i: int, cache, tokens: list):
    """(family, header fields, (slot, array) pairs) of layer ``i``, after the checks every
    writer makes: a known kind, a cache that holds tokens, and an offset that is
    ``len(tokens)`` (recurrent state has no token axis). Writes nothing."""
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
    return family, fields, slots


def _encode_all(caches, tokens):
    if not caches:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    entries, tensors = [], []
    for i, cache in enumerate(caches):
        family, fields, slots = encode_layer(i, cache, tokens)
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


def encode(
    caches: Sequence,
    tokens: Sequence[int],
    *,
    model_id: str = "",
    config_fingerprint: str = "",
    tokenizer_hash: str = "",
    ns: str = "",
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    created_at: str | None = None,
    extra: dict | None = None,
) -> tuple[dict, list[tuple[str, mx.array]]]:
    """The snapshot of ``caches`` in memory: its mlxkv header and its (name, array) tensors.

    The arrays are the caches' own stored rows (views, nothing copied); each tensor entry of
    the header names its slot, and ``write`` adds dtype, shape and CRC-32. ``extra`` adds
    header fields (a writer may; readers ignore fields they do not know). Everything is
    checked here, so a write of the result fails only for file-system reasons.
    """
    tokens = [int(t) for t in tokens]
    entries, tensors = _encode_all(list(caches), tokens)
    for _, a in tensors:
        dtype_name(a)  # unsupported dtypes fail before any file is opened
    header = {
        "formatVersion": FORMAT_VERSION,
        "createdAt": created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "codecProvider": CODEC_PROVIDER,
        "modelId": model_id,
        "configFingerprint": config_fingerprint,
        "tokenizerHash": tokenizer_hash,
        "ns": ns,
        "tokens": tokens,
        "caches": entries,
    }
    if generation_checkpoint is not None:  # format 1's layout is translated, any other checked
        header["generationCheckpoint"] = normalized(generation_checkpoint, tokens, ns)
    if attachments:
        header["attachments"] = attachments
    for key, value in (extra or {}).items():
        header.setdefault(key, value)
    try:
        json.dumps(header)
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot header is not JSON-serializable: {e}") from None
    return header, tensors


def write(
    path: str,
    header: dict,
    tensors: Sequence[tuple[str, mx.array]],
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
) -> dict:
    """Write an encoded snapshot (``encode``'s result) atomically to ``path``; returns the
    header as written (with every tensor's dtype, shape and CRC-32). ``header`` itself is
    not modified."""
    base = json.loads(json.dumps(header))
    by_name = dict(tensors)
    final = {}

    def build(crcs: dict[str, str]) -> dict[str, str]:
        for entry in base["caches"]:
            for t in entry["tensors"]:
                a = by_name[t["name"]]
                t["dtype"], t["shape"] = dtype_name(a), list(a.shape)
                t["crc32"] = crcs[t["name"]]
        text = json.dumps(base, separators=(",", ":"), ensure_ascii=True)
        final["header"] = base
        return {META_KEY: text, META_CRC_KEY: crc32_hex(text.encode())}

    write_atomic(path, tensors, build, progress=progress, fsync=fsync)
    return final["header"]


def save(
    path: str,
    caches: Sequence,
    tokens: Sequence[int],
    *,
    model_id: str = "",
    config_fingerprint: str = "",
    tokenizer_hash: str = "",
    ns: str = "",
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    created_at: str | None = None,
    format: str = "mlxkv",
) -> dict:
    """Write ``caches`` and the ``tokens`` they encode to ``path``; returns the header.

    Everything is checked before the file is opened; the write is atomic, so a snapshot
    already at ``path`` survives any failure. ``created_at`` pins the timestamp (fixtures).
    ``format="mlx-bun"`` writes mlx-bun's cache-file format instead (docs/mlx-bun.md).
    """
    if format == "mlx-bun":  # hook: mlx-bun's format lives in state/mlxbun.py
        from .mlxbun import save_mlx_bun

        return save_mlx_bun(
            path,
            caches,
            tokens,
            model_id=model_id,
            config_fingerprint=config_fingerprint,
            tokenizer_hash=tokenizer_hash,
            ns=ns,
            generation_checkpoint=generation_checkpoint,
            attachments=attachments,
            progress=progress,
            fsync=fsync,
            created_at=created_at,
        )
    if format != "mlxkv":
        raise SnapshotError(f"unknown snapshot format {format!r}: 'mlxkv' or 'mlx-bun'")
    header, tensors = encode(
        caches,
        tokens,
        model_id=model_id,
        config_fingerprint=config_fingerprint,
        tokenizer_hash=tokenizer_hash,
        ns=ns,
        generation_checkpoint=generation_checkpoint,
        attachments=attachments,
        created_at=created_at,
    )
    return write(path, header, tensors, progress=progress, fsync=fsync)


# -- reading ------------------------------------------------------------------------------


def _parse(st: SafetensorsHeader) -> dict:
    path = st.path
    text = st.metadata.get(META_KEY)
    if text is None:
        raise SnapshotError(
            f"{path}: not an mlxkv snapshot (no {META_KEY!r} metadata); "
            "for an mlx-lm prompt-cache file use `mlxkv convert`"
        )
    crc = st.metadata.get(META_CRC_KEY)
    if crc is not None and crc != crc32_hex(text.encode()):
        raise CorruptSnapshotError(f"{path}: checksum mismatch in the snapshot header: the file is damaged")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CorruptSnapshotError(f"{path}: damaged snapshot header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptSnapshotError(f"{path}: damaged snapshot header: not an object")
    version = header.get("formatVersion")
    if not is_int(version):
        raise CorruptSnapshotError(f"{path}: formatVersion missing or not an integer")
    if version > FORMAT_VERSION or version < 1:
        raise FormatVersionError(
            f"{path}: snapshot format version {version}; this mlxkv reads version "
            f"{FORMAT_VERSION} and older: upgrade mlxkv to read it"
        )
    provider = header.get("codecProvider")
    if provider not in ACCEPTED_PROVIDERS:
        raise SnapshotError(f"{path}: codec provider {provider!r} is not one of {ACCEPTED_PROVIDERS}")
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise CorruptSnapshotError(f"{path}: tokens must be a list of integers")
    entries = header.get("caches")
    if not isinstance(entries, list) or not entries:
        raise CorruptSnapshotError(f"{path}: the snapshot lists no caches")
    seen = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), list):
            raise CorruptSnapshotError(f"{path}: cache entry {i} is malformed")
        family_of_persisted(entry.get("kind"))  # an unknown kind is named before its tensors
        shapes = {}
        for t in entry["tensors"]:
            name = t.get("name") if isinstance(t, dict) else None
            info = st.tensors.get(name)
            if info is None or name in seen:
                raise CorruptSnapshotError(f"{path}: cache entry {i} names tensor {name!r}, which the file lacks")
            if t.get("slot") is None or name != f"caches.{i}.{t['slot']}":
                raise CorruptSnapshotError(f"{path}: tensor {name!r} is not named caches.{i}.<slot>")
            if info.dtype != t.get("dtype") or info.shape != t.get("shape"):
                raise CorruptSnapshotError(
                    f"{path}: tensor {name!r}: header says {t.get('dtype')} {t.get('shape')}, "
                    f"file holds {info.dtype} {info.shape}"
                )
            if not isinstance(t.get("crc32"), str):
                raise CorruptSnapshotError(f"{path}: tensor {name!r} has no crc32")
            seen.add(name)
            shapes[t["slot"]] = info.shape
        if not isinstance(entry.get("minimumReusableOffset"), int):
            raise CorruptSnapshotError(f"{path}: cache entry {i} lacks minimumReusableOffset")
        try:
            check_entry(entry, shapes)
        except CorruptSnapshotError as e:
            raise CorruptSnapshotError(f"{path}: cache entry {i}: {e}") from None
        if "pendingConversion" in entry:
            p = entry["pendingConversion"]
            if not isinstance(p, dict) or not isinstance(p.get("scheme"), str) or not isinstance(p.get("start"), int):
                raise CorruptSnapshotError(f"{path}: cache entry {i}: malformed pendingConversion {p!r}")
    extra = set(st.tensors) - seen
    if extra:
        raise CorruptSnapshotError(f"{path}: tensors {sorted(extra)} belong to no cache entry")
    return header


def parse_header(st: SafetensorsHeader) -> dict:
    """Every header check of section 8 of docs/format.md over a safetensors header (a file's,
    or one a prompt store's shared tier assembled from a manifest); returns the mlxkv header."""
    return _parse(st)


def read_header(path: str) -> dict:
    """The validated mlxkv header of ``path``; no tensor bytes are read."""
    if is_mlx_bun_file(path):  # hook: an mlx-bun file, translated (state/mlxbun.py)
        from .mlxbun import read_mlx_bun_header

        return read_mlx_bun_header(path)
    return _parse(read_safetensors_header(path))


def check_identity(path, header, expect):
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


def check_geometry(path, header, model):
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


def read(
    path: str,
    model=None,
    *,
    verify: bool = True,
    slack: bool = True,
    progress: Callable[[int, int], None] | None = None,
    **expect,
) -> tuple[dict, dict[str, mx.array]]:
    """The checked header of ``path`` and its tensors by name, before any cache is built.

    ``slack`` gives growing caches their restore capacity (``Codec.capacity``); without it
    every tensor holds exactly its stored rows (a prompt store keeps them so)."""
    st = read_safetensors_header(path)
    header = _parse(st)
    check_identity(path, header, expect)
    if model is not None:
        check_geometry(path, header, model)
    with TensorReader(st) as reader:
        requests = []
        for entry in header["caches"]:
            rows = family_of_persisted(entry["kind"]).codec.capacity(entry) if slack else None
            requests += [(t["name"], t["crc32"] if verify else None, rows) for t in entry["tensors"]]
        arrays = reader.read_all(requests, progress)
    return header, arrays


def decode(header: dict, arrays: dict[str, mx.array]) -> list:
    """Live caches from a checked header and its tensors by name (one shared masks object).

    The caches hold the given arrays as they are; nothing is evaluated or copied."""
    masks = ForwardMasks()
    caches = []
    for entry in header["caches"]:
        codec = family_of_persisted(entry["kind"]).codec
        cache = codec.decode(entry, {t["slot"]: arrays[t["name"]] for t in entry["tensors"]})
        cache.minimum_reusable_offset = entry["minimumReusableOffset"]
        if "pendingConversion" in entry:
            cache = Bf16FirstCache(scheme_for_pending(entry["pendingConversion"]), cache)
        cache.masks = masks
        caches.append(cache)
    return caches


def load(
    path: str,
    model=None,
    *,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    **expect,
) -> Snapshot:
    """Restore a snapshot. ``expect`` takes model_id, config_fingerprint, tokenizer_hash, ns;
    a given ``model`` is checked for layer count and head geometry."""
    if is_mlx_bun_file(path):  # hook: an mlx-bun file (state/mlxbun.py)
        from .mlxbun import load_mlx_bun

        return load_mlx_bun(path, model, verify=verify, progress=progress, **expect)
    header, arrays = read(path, model, verify=verify, progress=progress, **expect)
    caches = decode(header, arrays)
    del arrays
    for cache in caches:
        mx.eval(cache.state)  # a codec that transforms its slots does it one cache at a time
    return Snapshot(caches, list(header["tokens"]), header, path)


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every checksum of ``path`` without building caches; returns the header."""
    if is_mlx_bun_file(path):  # hook: an mlx-bun file (state/mlxbun.py)
        from .mlxbun import verify_mlx_bun

        return verify_mlx_bun(path, progress)
    st = read_safetensors_header(path)
    header = _parse(st)
    done, total = 0, st.file_size - st.data_start
    with TensorReader(st) as reader:
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
