"""mlx-bun cache files as mlxkv snapshots: translation both ways (docs/mlx-bun.md).

Reading: the container (``io/mlxbun.py``) gives the raw header and its tensor records; each mlx-bun
cache entry is translated into the mlxkv header entry of the same persisted kind (slot names,
``keep`` 0 for rings, ``size`` 2 for ``ssm``, the reuse floor), checked by mlxkv's own codec
(``codec.check``) and decoded by it (``codec.decode``), so both formats share every check.
The result is a :class:`MlxBunSnapshot`: a :class:`~mlxkv.formats.snapshot.Snapshot` whose
header is an mlxkv header (``codecProvider`` ``"mlx-bun"``, ``formatVersion`` the mlx-bun
version) plus ``mlxBun``, what only the mlx-bun file says, and whose ``attachments`` hold
mlx-bun's companion tensors.

Writing: live caches are encoded by their codec, and each entry is laid out as mlx-bun's
codec for that kind writes it (fields, slot order, the whole ring as laid out, the floor
appended last). Kinds mlx-bun has no codec for, rings that keep leading positions and
pending conversions are refused before anything is written.
"""

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..checks import INT32_MAX, is_count32, is_int
from ..codecs.base import check_entry
from ..errors import (
    CorruptSnapshotError,
    EmptyCacheError,
    SnapshotError,
    UnsupportedKindError,
)
from ..families import families, family_of_persisted
from ..io import mlxbun as container
from ..io.safetensors import ITEMSIZE
from ..io.tensor_reader import TensorReader, check_allocation
from ..kinds.entries import Layer, cache_layers, check_layers, decode_entries, read_layers
from ..state.checkpoint import describe as describe_checkpoint
from ..state.checkpoint import normalized, read_checkpoint
from ..state.identity import RECORDED_FIELDS, UNKNOWN, Identity, check_expected, check_for_model
from .mlxkv_header import check_position, check_tokens
from .snapshot import Carried, Snapshot, epoch_ms, iso_time

PROVIDER = "mlx-bun"  # the codecProvider of a translated header (docs/format.md accepts it)

#: the kinds of mlx-bun's codec table that no mlxkv family has (the others are the families
#: whose codec has a ``bun`` form)
NO_MLXKV_FAMILY = {
    "paged": "a paged block pool (mlxkv has no paged cache; extract rows on the mlx-bun side first)",
    "mla": "GLM's compressed MLA cache (mlxkv has no MLA cache)",
    "mla-dsa": "GLM's compressed MLA cache with DSA state (mlxkv has no MLA cache)",
    "mtp-mla": "GLM's MTP MLA cache (mlxkv has no MLA cache)",
}


@dataclass
class MlxBunSnapshot(Snapshot):
    """A restored mlx-bun file: ``header`` is the translated mlxkv header, ``source`` the
    header as the file holds it, ``attachments`` mlx-bun's companion state with its tensors
    as MLX arrays (``[{"schema", "metadata", "tensors": [mx.array, ...]}]``)."""

    attachments: list = field(default_factory=list)
    source: dict = field(default_factory=dict)

    @property
    def created_at(self) -> int:
        """The creation time as the file records it: milliseconds since the epoch."""
        return self.header["mlxBun"]["createdAt"]


#: the latest createdAt a file may record: 9999-12-31T23:59:59.999Z (an ISO year has 4 digits)
MAX_CREATED_AT = 253402300799999


# -- reading: mlx-bun entries as mlxkv entries -----------------------------------------------


@dataclass
class _Layer:
    entry: dict  # the mlxkv entry
    records: list  # the container's TensorRecord of each mlxkv slot, in order
    floor: int


def _corrupt(where: str, why: str):
    raise CorruptSnapshotError(f"{where}: {why}")


def bun_codecs() -> dict:
    """mlx-bun kind -> the codec of the mlxkv family that has a ``bun`` form for it."""
    return {f.persisted: f.codec for f in families() if f.codec.bun is not None}


def _translate_entry(where: str, i: int, raw, records: list, tokens: list) -> _Layer:
    """The mlxkv entry of mlx-bun entry ``i`` (step 12 of docs/mlx-bun.md section 8)."""
    kind = raw.get("kind")
    if type(kind) is not str:
        _corrupt(where, f"cache entry {i}: kind {str(kind)[:40]!r} is not a string")
    if kind in NO_MLXKV_FAMILY:
        raise UnsupportedKindError(kind, f"{where}: cache entry {i} is mlx-bun kind {kind!r}, {NO_MLXKV_FAMILY[kind]}")
    codecs = bun_codecs()
    if kind not in codecs:
        raise UnsupportedKindError(
            kind,
            f"{where}: cache entry {i} has kind {kind[:40]!r}, which mlx-bun's codec table (mlx-cache-v3) "
            f"does not have; mlxkv reads mlx-bun kinds {', '.join(codecs)}",
        )
    codec = codecs[kind]
    form = codec.bun
    fields, names = form.fields(codec), form.slot_names(codec)
    allowed = {"kind", *fields, "tensors", "minimumReusableOffset"}
    extra, missing = set(raw) - allowed, set(fields) - set(raw)
    if extra or missing:
        _corrupt(
            where,
            f"cache entry {i} ({kind}) has fields {sorted(raw)[:12]}; mlx-bun's {kind} has exactly "
            f"{', '.join(['kind', *fields, 'tensors'])} and an optional minimumReusableOffset",
        )
    if len(records) != len(names):
        _corrupt(
            where,
            f"cache entry {i} ({kind}) has {len(records)} tensors; mlx-bun's {kind} holds "
            f"{len(names)} ({', '.join(names)})",
        )
    offset = raw["offset"]
    if not is_count32(offset):
        _corrupt(where, f"cache entry {i} ({kind}): offset {str(offset)[:40]} is not an integer in 0..{INT32_MAX}")
    floor = raw.get("minimumReusableOffset", offset if form.floor_at_offset else 0)
    if not is_count32(floor) or floor > offset:
        _corrupt(
            where,
            f"cache entry {i} ({kind}): invalid cache minimum reusable offset {str(floor)[:40]} (offset {offset})",
        )
    given = {f: raw[f] for f in fields}
    entry = {"kind": kind, **{f: given[f] if f in given else form.implied[f] for f in codec.fields}}
    entry["minimumReusableOffset"] = floor
    entry["tensors"] = []
    for name, record in zip(names, records):
        shape = list(record.info.shape)
        if form.ring and len(shape) == 4:
            shape[2] = min(offset, shape[2])  # rows past offset are the unwritten tail of the ring
        entry["tensors"].append(
            {
                "name": f"caches.{i}.{name}",
                "slot": name,
                "dtype": record.info.dtype,
                "shape": shape,
                "wyhash": record.hash,
            }
        )
    shapes = {t["slot"]: t["shape"] for t in entry["tensors"]}
    try:
        check_entry(entry, shapes)
    except CorruptSnapshotError as e:
        raise CorruptSnapshotError(f"{where}: cache entry {i}: {e}") from None
    check_position(where, i, entry, tokens)
    if form.ring:  # rows past offset are a tail grown before the ring is full, never past its window
        rows, size = records[0].info.shape[2], entry["maxSize"]
        if rows > max(offset, size):
            _corrupt(
                where,
                f"cache entry {i} ({kind}): a ring of {rows} rows at offset {offset} with maxSize {size}: "
                "rows past the offset are the unwritten tail of a ring not yet full, at most maxSize",
            )
    return _Layer(entry, list(records), floor)


def translate(f: container.MlxBunHeader) -> tuple[dict, list]:
    """(the mlxkv header of an mlx-bun file, its layers): steps 10-13 of docs/mlx-bun.md
    section 8 over a checked container; reads no tensor."""
    where, raw = f.where, f.header
    provider = raw.get("codecProvider", container.CODEC_PROVIDER)
    if provider != container.CODEC_PROVIDER:
        raise SnapshotError(
            f"{where}: cache codec provider {str(provider)[:40]!r}: mlxkv reads mlx-bun's "
            f"{container.CODEC_PROVIDER!r} (its built-in codec table) only"
        )
    created = raw.get("createdAt")
    if not is_int(created) or not 0 <= created <= MAX_CREATED_AT:
        _corrupt(where, f"createdAt {str(created)[:40]} is not milliseconds since the epoch (0..{MAX_CREATED_AT})")
    for name in RECORDED_FIELDS:
        if name in raw and type(raw[name]) is not str:
            _corrupt(where, f"{name} must be a string, got {str(raw[name])[:40]}")
    tokens = check_tokens(where, raw.get("tokens"))
    layers = [_translate_entry(where, i, e, s, tokens) for i, (e, s) in enumerate(zip(raw["caches"], f.caches))]
    header = {"formatVersion": f.version, "createdAt": iso_time(created), "codecProvider": PROVIDER}
    header.update({k: raw[k] for k in RECORDED_FIELDS if k in raw})
    header["tokens"] = list(tokens)
    header["caches"] = [layer.entry for layer in layers]
    for k in ("generationCheckpoint", "attachments"):  # kept as the file has them
        if k in raw:
            header[k] = raw[k]
    header["mlxBun"] = {"formatVersion": f.version, "createdAt": created, "codecProvider": provider, "layout": f.layout}
    read_checkpoint(header, where, state=False)  # mlx-bun's fields; mlxkv's own state is a resume's to check
    return header, layers


def read_mlx_bun_header(f: container.MlxBunFile) -> dict:
    """The translated, checked header of an open mlx-bun file; no tensor bytes are read."""
    return translate(f.header)[0]


def _restored_bytes(record: container.TensorRecord, rows) -> int:
    """Bytes of the array a tensor restores to (a growing cache's slack rows included)."""
    shape = list(record.info.shape)
    if rows is not None and len(shape) == 4 and rows > shape[2]:
        shape[2] = rows
    return math.prod(shape) * ITEMSIZE[record.info.dtype]


def _read_arrays(f: container.MlxBunFile, requests, verify: bool, progress) -> dict:
    """name -> array for (tensor record, rows) requests, each hash checked as it is read (``verify``):
    through ``TensorReader`` on the file's descriptor, or from format 5's blocks."""
    if f.header.layout == "whole":
        reader = TensorReader(f)
        return reader.read_all([(s.info.name, s.hash if verify else None, rows) for s, rows in requests], progress)
    check_allocation(f.where, sum(_restored_bytes(s, rows) for s, rows in requests))
    out, done, total = {}, 0, sum(s.nbytes for s, _ in requests)
    for s, _ in requests:  # KVCache.adopt adds the slack rows itself
        out[s.info.name] = container.read_block_tensor(f.header, s, verify)
        done += s.nbytes
        if progress:
            progress(done, total)
    return out


def load_mlx_bun(
    f: container.MlxBunFile,
    model=None,
    *,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    allow_other_model: bool = False,
    check: Callable[[str, dict], None] | None = None,
    **expect,
) -> MlxBunSnapshot:
    """Restore an open mlx-bun file as mlxkv caches (``mlxkv.load`` comes here through the
    format table, by the file's magic).

    Every header check passes before an array is allocated; the tensors are then read through
    the descriptor the header came from, ``verify`` checking every tensor's wyhash (format 5:
    every block's sha256) on the bytes as they are read. mlx-bun itself checks them only on
    request, mlxkv by default."""
    h, where = f.header, f.where
    header, layers = translate(h)
    check_expected(where, header, expect)
    if model is not None:
        check_for_model(where, header, model, allow_other_model)
    if check is not None:
        check(f.path, header)
    # rings are decoded as laid out, unwritten tail included: the live ring mlx-bun had
    by_name, attachments = _read_tensors(f, layers, True, verify, progress)
    caches = decode_entries({"caches": [layer.entry for layer in layers]}, by_name, where)
    del by_name
    for cache in caches:
        mx.eval(cache.state)
    return MlxBunSnapshot(caches, list(header["tokens"]), header, f.path, attachments, h.header)


def layers_mlx_bun(f: container.MlxBunFile) -> Carried:
    """What a conversion carries out of an open mlx-bun file: every header check, every
    tensor (hashes verified, no slack rows; rings whole as laid out), its layers
    (``kinds.entries.read_layers``) and its attachments, no cache built."""
    header, layers = translate(f.header)
    by_name, attachments = _read_tensors(f, layers, False, True, None)
    carried = read_layers(header, by_name, f.where)
    return Carried(carried, list(header["tokens"]), header, f.path, attachments, header["mlxBun"]["createdAt"])


def _read_tensors(f: container.MlxBunFile, layers: list, slack: bool, verify: bool, progress) -> tuple[dict, list]:
    """(every layer's tensors by their mlxkv name, the attachments with theirs), read in one
    pass; ``slack`` gives growing caches their restore capacity (``Codec.capacity``), else
    every tensor is as the file holds it."""
    h = f.header
    rows = [family_of_persisted(layer.entry["kind"]).codec.capacity(layer.entry) if slack else None for layer in layers]
    requests = [(s, n) for layer, n in zip(layers, rows) for s in layer.records]
    requests += [(s, None) for group in h.attachments for s in group]
    arrays = _read_arrays(f, requests, verify, progress)
    by_name = {
        ref["name"]: arrays.pop(s.info.name)
        for layer in layers
        for ref, s in zip(layer.entry["tensors"], layer.records)
    }
    attachments = [
        {
            "schema": raw["schema"],
            "metadata": dict(raw["metadata"]),
            "tensors": [arrays.pop(s.info.name) for s in group],
        }
        for raw, group in zip(h.header.get("attachments", []), h.attachments)
    ]
    return by_name, attachments


def verify_mlx_bun(f: container.MlxBunFile, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check the header hash, every entry, and every tensor hash (block sha256 in format 5),
    all through the one open file; returns the translated header."""
    h = f.header
    header, _ = translate(h)
    reader = TensorReader(f) if h.layout == "whole" else None
    done, total = 0, sum(r.nbytes for r in h.records())
    for record in h.records():
        if reader is not None:
            reader.verify(record.info.name, record.hash)
        else:
            container.verify_blocks(h, record)
        done += record.nbytes
        if progress:
            progress(done, total)
    return header


# -- writing: live caches as mlx-bun entries ---------------------------------------------------


def _refuse_layer(i: int, kind, why: str):
    raise UnsupportedKindError(kind, f"layer {i}: {why}; nothing was written")


def _entry(i: int, layer: Layer) -> tuple[dict, list]:
    """(the mlx-bun header entry, its arrays in slot order) of one layer."""
    fields = layer.entry
    persisted, codec = fields["kind"], layer.codec
    form = codec.bun
    if form is None:
        _refuse_layer(
            i,
            persisted,
            f"mlx-bun has no codec for mlxkv's {persisted!r} caches ({layer.live_kind}); it persists "
            f"{', '.join(bun_codecs())}",
        )
    pending = fields.get("pendingConversion")
    if pending is not None:
        _refuse_layer(
            i,
            persisted,
            f"a bf16-first cache with a pending conversion {pending}: "
            "mlx-bun files cannot record it (save after the conversion, or as mlxkv)",
        )
    for name, value in form.implied.items():
        if fields[name] != value:
            _refuse_layer(
                i,
                persisted,
                f"{name}={fields[name]}: mlx-bun's {persisted} entries have no {name}, it is always {value} there",
            )
    slots = layer.stored()
    names = form.slot_names(codec)
    if [s for s, _ in slots] != list(names):
        _refuse_layer(
            i, persisted, f"tensor slots {[s for s, _ in slots]}: mlx-bun's {persisted} holds exactly {list(names)}"
        )
    # mlx-bun persists the whole ring as laid out, unwritten tail included
    arrays = [a for _, a in (layer.held if form.ring else slots)]
    entry = {"kind": persisted, **{f: int(fields[f]) for f in form.fields(codec)}}
    entry["tensors"] = [container.new_tensor_record(a) for a in arrays]
    floor = int(fields["minimumReusableOffset"])
    if floor or form.floor_at_offset:  # such an entry without it would mean "offset"
        entry["minimumReusableOffset"] = floor
    return entry, arrays


def _attachments(attachments) -> tuple[list, list]:
    if attachments and not isinstance(attachments, (list, tuple)):
        raise SnapshotError(
            "attachments: mlx-bun's are a list of {'schema', 'metadata', 'tensors'}; mlxkv's JSON "
            "attachments have no mlx-bun form, so nothing is written rather than drop them"
        )
    entries, arrays = [], []
    for i, att in enumerate(attachments or []):
        schema, metadata, tensors = (att.get(k) for k in ("schema", "metadata", "tensors"))
        if not isinstance(schema, str) or not isinstance(metadata, dict) or not isinstance(tensors, (list, tuple)):
            raise SnapshotError(f"attachment {i}: give {{'schema': str, 'metadata': dict, 'tensors': [mx.array]}}")
        if not all(isinstance(v, (str, int, float, bool)) for v in metadata.values()):
            raise SnapshotError(f"attachment {i} ({schema}): metadata values must be strings, numbers or booleans")
        entries.append(
            {"schema": schema, "metadata": dict(metadata), "tensors": [container.new_tensor_record(a) for a in tensors]}
        )
        arrays += list(tensors)
    return entries, arrays


def save_mlx_bun(path: str, caches: Sequence, tokens: Sequence[int], **kwargs) -> dict:
    """Write live ``caches`` as an mlx-bun cache file (``save_mlx_bun_layers`` documents the
    keywords); returns the mlx-bun header written."""
    return save_mlx_bun_layers(path, cache_layers(list(caches), tokens), tokens, **kwargs)


def save_mlx_bun_layers(
    path: str,
    layers: Sequence[Layer],
    tokens: Sequence[int],
    *,
    identity: Identity = UNKNOWN,
    generation_checkpoint: dict | None = None,
    attachments: list | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    created_at=None,
    layout: str = "whole",
    block_bytes: int = container.DEFAULT_BLOCK_BYTES,
) -> dict:
    """Write ``layers`` as an mlx-bun cache file (format 3, 4 with attachments, 5 with
    ``layout="blocks"``); returns the mlx-bun header written. ``created_at`` pins
    ``createdAt`` (milliseconds, or mlxkv's ISO form). Everything is checked before the file
    is opened, and the write is atomic."""
    tokens = [int(t) for t in tokens]
    layers = list(layers)
    if not layers and not attachments:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    check_layers(layers, tokens)
    entries, arrays = [], []
    for i, layer in enumerate(layers):
        entry, a = _entry(i, layer)
        entries.append(entry)
        arrays += a
    att_entries, att_arrays = _attachments(attachments)
    header = {"formatVersion": 4 if att_entries else 3, "createdAt": epoch_ms(created_at), **identity.header_fields()}
    if generation_checkpoint is not None:  # mlx-bun's fields; mlxkv's own state rides along
        header["generationCheckpoint"] = normalized(generation_checkpoint, tokens, identity.ns)
    if att_entries:
        header["attachments"] = att_entries
    header.update({"codecProvider": container.CODEC_PROVIDER, "tokens": tokens, "caches": entries})
    try:  # the reader's checks, on the header about to be written: a save never writes a file they refuse
        translate(container.planned(path, header))
    except SnapshotError as e:
        raise SnapshotError(f"not saved: the file would not read back: {e}") from None
    return container.write_mlx_bun(
        path, header, arrays + att_arrays, layout=layout, block_bytes=block_bytes, progress=progress, fsync=fsync
    )


# -- description ------------------------------------------------------------------------------


def describe_mlx_bun(file: container.MlxBunFile) -> tuple[list, list, list]:
    """What ``mlxkv inspect`` prints for an open mlx-bun file: (general rows, table headers,
    rows)."""
    f = file.header
    path = f.path
    header, layers = translate(f)
    raw = f.header
    tokens = header["tokens"]
    shown = ", ".join(map(str, tokens[:16])) + (", ..." if len(tokens) > 16 else "")
    layout = (
        "whole: tensors in the file at 16 KiB-aligned offsets"
        if f.layout == "whole"
        else f"blocks: tensors in content-addressed blocks under {f.blocks_dir}"
    )
    general = [
        ("file", path),
        ("size", f"{f.file_size} bytes"),
        ("format", f"mlx-bun format v{f.version} ({layout})"),
        ("headerHash", f"{container.hex16(f.header_hash)} (wyhash of the {f.header_len}-byte JSON header; verified)"),
        ("dataStart", f.data_start),
        ("codecProvider", raw.get("codecProvider", f"{container.CODEC_PROVIDER} (absent: an early v3 file)")),
        ("createdAt", f"{raw['createdAt']} ({header['createdAt']})"),
    ]
    general += [(k, repr(raw[k]) if k == "ns" else raw[k]) for k in RECORDED_FIELDS if k in raw]
    general.append(("tokens", f"{len(tokens)} [{shown}]"))
    general += describe_checkpoint(header)
    for att, group in zip(raw.get("attachments", []), f.attachments):
        meta = json.dumps(att["metadata"], separators=(",", ":"))
        general.append(("attachment", f"{att['schema']}: {len(group)} tensors, metadata {meta}"))
    rows = []
    for i, (layer, rawe) in enumerate(zip(layers, raw.get("caches", []))):
        e = layer.entry
        fields = " ".join(
            f"{k}={v}" for k, v in e.items() if k not in ("kind", "offset", "tensors", "minimumReusableOffset")
        )
        floor = f"{layer.floor}" + ("" if "minimumReusableOffset" in rawe else " (absent)")
        slots = " ".join(
            f"{t['slot']}:{s.info.dtype}{list(s.info.shape)}@{s.off}" for t, s in zip(e["tensors"], layer.records)
        )
        rows.append([i, e["kind"], e["offset"], floor, fields or "-", sum(s.nbytes for s in layer.records), slots])
    return general, ["layer", "kind", "offset", "minReuse", "fields", "bytes", "tensors (slot:dtype[shape]@off)"], rows
