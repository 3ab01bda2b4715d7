"""mlxkv snapshots: every cache of a model in one safetensors file (docs/format.md).

``save_mlxkv`` encodes each cache through its kind's codec and streams the tensors to an
atomic write; ``load_mlxkv`` takes the file open once, checks the whole header
(``mlxkv_header``: version, provider, kinds, fields, slot shapes, byte ranges; then the
model's identity and geometry) before a single tensor is read, and reads every tensor
through that one descriptor, verifying its CRC-32. ``read_mlxkv_header`` is the check
without tensor I/O. ``mlxkv.save``, ``mlxkv.load`` and the others reach these through the
format table (``formats.table``); the prompt store uses ``encode``, ``write`` and ``read``.
"""

import json
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..errors import SnapshotError
from ..families import family_of_persisted
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
from ..kinds.entries import Layer, cache_layers, check_layers, decode_entries, layer_entries, read_layers
from ..state.checkpoint import describe as describe_checkpoint
from ..state.checkpoint import normalized
from ..state.identity import RECORDED_FIELDS, UNKNOWN, Identity, check_expected, check_for_model
from .mlxkv_header import (  # noqa: F401 - the header constants are part of this module's interface
    ACCEPTED_PROVIDERS,
    CODEC_PROVIDER,
    FORMAT_VERSION,
    META_CRC_KEY,
    META_KEY,
    check_header,
    looks_like_a_known_key,
)
from .snapshot import Carried, Snapshot, human_bytes, iso_created


def claims(file) -> bool:
    """Is an open safetensors file an mlxkv snapshot (or a damaged one, which its header
    check then refuses): a metadata key in mlxkv's namespace or close to one of its keys."""
    return any(looks_like_a_known_key(k) for k in file.header.metadata)


# -- writing ------------------------------------------------------------------------------


def _check_readable(base: dict, tensors) -> None:
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
        check_header(SafetensorsHeader("(to be written)", meta, infos, 0, at))
    except SnapshotError as e:
        raise SnapshotError(f"not saved: the snapshot would not read back: {e}") from None


def encode(caches: Sequence, tokens: Sequence[int], **kwargs) -> tuple[dict, list[tuple[str, mx.array]]]:
    """The snapshot of live ``caches`` in memory (``encode_layers`` documents the keywords)."""
    return encode_layers(cache_layers(list(caches), tokens), tokens, **kwargs)


def encode_layers(
    layers: Sequence[Layer],
    tokens: Sequence[int],
    *,
    identity: Identity = UNKNOWN,
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    created_at: str | int | None = None,
) -> tuple[dict, list[tuple[str, mx.array]]]:
    """The snapshot of ``layers`` in memory: its mlxkv header and its (name, array) tensors.

    The arrays are the layers' stored rows (views, nothing copied); each tensor entry of
    the header names its slot, and ``write`` adds dtype, shape and CRC-32. ``identity`` is
    recorded as ``Identity.header_fields`` says (its ``kv_scheme`` is a prompt store's,
    docs/store.md). ``attachments``: a JSON object
    of method state (mlx-bun's tensor attachments have no mlxkv form). ``created_at``: the
    ISO string to record, or milliseconds since the epoch (another format's). Everything is
    checked here, by the reader's own header checks among others, so a write of the result
    fails only for file-system reasons.
    """
    try:
        tokens = list(map(int, tokens))
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"tokens must be integers: {e}") from None
    if attachments and not isinstance(attachments, dict):
        raise SnapshotError(
            "attachments: an mlxkv snapshot's are a JSON object of method state; these carry tensors "
            "(mlx-bun's), which it does not hold, so nothing is written rather than drop them"
        )
    check_layers(layers, tokens)
    entries, tensors = layer_entries(list(layers))
    for name, a in tensors:
        check_storable(name, a)  # unsupported dtypes and ranks fail before any file is opened
    header = {
        "formatVersion": FORMAT_VERSION,
        "createdAt": iso_created(created_at),
        "codecProvider": CODEC_PROVIDER,
        **identity.header_fields(),
        "tokens": tokens,
        "caches": entries,
    }
    if generation_checkpoint is not None:  # format 1's layout is translated, any other checked
        header["generationCheckpoint"] = normalized(generation_checkpoint, tokens, identity.ns)
    if attachments:
        header["attachments"] = attachments
    try:
        text = json.dumps(header)
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot header is not JSON-serializable: {e}") from None
    _check_readable(json.loads(text), tensors)
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


def save_mlxkv(path: str, caches: Sequence, tokens: Sequence[int], **kwargs) -> dict:
    """Write ``caches`` and the ``tokens`` they encode to ``path`` as an mlxkv snapshot
    (``save_mlxkv_layers`` documents the keywords); returns the header written."""
    return save_mlxkv_layers(path, cache_layers(list(caches), tokens), tokens, **kwargs)


def save_mlxkv_layers(
    path: str,
    layers: Sequence[Layer],
    tokens: Sequence[int],
    *,
    identity: Identity = UNKNOWN,
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    created_at: str | int | None = None,
) -> dict:
    """Write ``layers`` and the ``tokens`` they encode to ``path`` as an mlxkv snapshot
    (``encode_layers``, then ``write``); returns the header written."""
    header, tensors = encode_layers(
        layers,
        tokens,
        identity=identity,
        generation_checkpoint=generation_checkpoint,
        attachments=attachments,
        created_at=created_at,
    )
    return write(path, header, tensors, progress=progress, fsync=fsync)


# -- reading ------------------------------------------------------------------------------


def read_mlxkv_header(file: SafetensorsFile) -> dict:
    """The checked mlxkv header of an open snapshot; no tensor bytes are read."""
    return check_header(file.header)


def read(
    path: str,
    model=None,
    *,
    verify: bool = True,
    slack: bool = True,
    progress: Callable[[int, int], None] | None = None,
    allow_other_model: bool = False,
    check: Callable[[str, dict], None] | None = None,
    **expect,
) -> tuple[dict, dict[str, mx.array]]:
    """The checked header of ``path`` and its tensors by name, before any cache is built.

    The file is opened once: header and tensors come from it however the path is renamed
    over meanwhile. ``slack`` gives growing caches their restore capacity
    (``Codec.capacity``); without it every tensor holds exactly its stored rows (a prompt
    store keeps them so). See ``load_mlxkv`` for ``model``, ``allow_other_model``, ``check``."""
    with SafetensorsFile(path) as file:
        return _read(file, model, verify, slack, progress, allow_other_model, check, expect)


def _read(file: SafetensorsFile, model, verify, slack, progress, allow_other_model, check, expect):
    """``read`` on a file already open."""
    path = file.path
    header = check_header(file.header)
    check_expected(path, header, expect)
    if model is not None:
        check_for_model(path, header, model, allow_other_model)
    if check is not None:
        check(path, header)
    requests = []
    for entry in header["caches"]:
        rows = family_of_persisted(entry["kind"]).codec.capacity(entry) if slack else None
        requests += [(t["name"], t["crc32"] if verify else None, rows) for t in entry["tensors"]]
    arrays = TensorReader(file).read_all(requests, progress)
    return header, arrays


def load_mlxkv(
    file: SafetensorsFile,
    model=None,
    *,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    allow_other_model: bool = False,
    check: Callable[[str, dict], None] | None = None,
    **expect,
) -> Snapshot:
    """Restore an open snapshot (``mlxkv.load`` documents the keywords): every header
    check, then every tensor through the one descriptor, then the caches."""
    path = file.path
    header, arrays = _read(file, model, verify, True, progress, allow_other_model, check, expect)
    caches = decode_entries(header, arrays, path)
    del arrays
    for cache in caches:
        mx.eval(cache.state)  # a codec that transforms its slots does it one cache at a time
    return Snapshot(caches, list(header["tokens"]), header, path, header.get("attachments"))


def layers_mlxkv(file: SafetensorsFile) -> Carried:
    """What a conversion carries out of an open snapshot: every header check, every tensor
    (checksums verified, no slack rows), its layers (``kinds.entries.read_layers``)."""
    header, arrays = _read(file, None, True, False, None, False, None, {})
    layers = read_layers(header, arrays, file.path)
    return Carried(layers, list(header["tokens"]), header, file.path, header.get("attachments"))


def verify_mlxkv(file: SafetensorsFile, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every checksum of an open snapshot without building caches; returns the header."""
    st = file.header
    header = check_header(st)
    done, total = 0, st.file_size - st.data_start
    reader = TensorReader(file)
    for entry in header["caches"]:
        for t in entry["tensors"]:
            reader.verify(t["name"], t["crc32"])
            info = st.tensors[t["name"]]
            done += info.end - info.begin
            if progress:
                progress(done, total)
    return header


def describe_mlxkv(file: SafetensorsFile) -> tuple[list, list, list]:
    """What ``mlxkv inspect`` prints for an open snapshot: (general rows, table headers, rows)."""
    st = file.header
    header = check_header(st)
    tokens = header["tokens"]
    shown = ", ".join(map(str, tokens[:16])) + (", ..." if len(tokens) > 16 else "")
    general = [
        ("file", file.path),
        ("size", f"{st.file_size} bytes ({human_bytes(st.file_size)})"),
        ("formatVersion", header.get("formatVersion")),
        ("codecProvider", header.get("codecProvider")),
        ("createdAt", header.get("createdAt")),
        *((k, repr(header.get(k, "")) if k == "ns" else header.get(k)) for k in RECORDED_FIELDS),
        ("tokens", f"{len(tokens)} [{shown}]"),
    ]
    general += describe_checkpoint(header)
    if header.get("attachments"):
        general.append(("attachments", ", ".join(sorted(header["attachments"]))))
    rows = []
    for i, entry in enumerate(header["caches"]):
        fields = {k: v for k, v in entry.items() if k not in ("kind", "offset", "tensors", "minimumReusableOffset")}
        slots = " ".join(f"{t['slot']}:{t['dtype']}{t['shape']}" for t in entry["tensors"])
        size = sum(st.tensors[t["name"]].end - st.tensors[t["name"]].begin for t in entry["tensors"])
        rows.append(
            [
                i,
                entry["kind"],
                entry.get("offset", ""),
                entry["minimumReusableOffset"],
                " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in fields.items()) or "-",
                size,
                slots or "-",
            ]
        )
    return general, ["layer", "kind", "offset", "minReuse", "fields", "bytes", "tensors (slot:dtype[shape])"], rows
