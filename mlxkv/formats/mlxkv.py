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

from ..errors import (
    GeometryMismatchError,
    IdentityMismatchError,
    SnapshotError,
)
from ..families import family_of_persisted
from ..io.containers import open_container
from ..io.mlxbun import MlxBunFile
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
from ..kinds.entries import decode_entries, encode_entries
from ..state.checkpoint import normalized
from ..state.identity import Identity, check_expected, legacy_config_fingerprint, model_fingerprint, model_geometry
from .mlxkv_header import (  # noqa: F401 - the header constants are part of this module's interface
    ACCEPTED_PROVIDERS,
    CODEC_PROVIDER,
    FORMAT_VERSION,
    META_CRC_KEY,
    META_KEY,
    check_header,
)


@dataclass
class Snapshot:
    caches: list
    tokens: list[int]
    header: dict
    path: str = ""

    @property
    def generation_checkpoint(self) -> dict | None:
        return self.header.get("generationCheckpoint")


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


def encode(
    caches: Sequence,
    tokens: Sequence[int],
    *,
    model=None,
    model_id: str | None = None,
    config_fingerprint: str | None = None,
    tokenizer_hash: str | None = None,
    ns: str | None = None,
    kv_scheme: str | None = None,
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    created_at: str | None = None,
) -> tuple[dict, list[tuple[str, mx.array]]]:
    """The snapshot of ``caches`` in memory: its mlxkv header and its (name, array) tensors.

    The arrays are the caches' own stored rows (views, nothing copied); each tensor entry of
    the header names its slot, and ``write`` adds dtype, shape and CRC-32. ``model`` gives
    the identity fields (its id and fingerprint, ``mlxkv.state.identity``) the keywords do
    not; ``kv_scheme`` is a prompt store's (docs/store.md). Everything is checked here, by
    the reader's own header checks among others, so a write of the result fails only for
    file-system reasons.
    """
    try:
        tokens = [int(t) for t in tokens]
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"tokens must be integers: {e}") from None
    entries, tensors = encode_entries(list(caches), tokens)
    for name, a in tensors:
        check_storable(name, a)  # unsupported dtypes and ranks fail before any file is opened
    identity = Identity.resolved(
        model,
        model_id=model_id,
        config_fingerprint=config_fingerprint,
        tokenizer_hash=tokenizer_hash,
        ns=ns,
        kv_scheme=kv_scheme,
    )
    header = {
        "formatVersion": FORMAT_VERSION,
        "createdAt": created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "codecProvider": CODEC_PROVIDER,
        **identity.header_fields(),
        "tokens": tokens,
        "caches": entries,
    }
    if generation_checkpoint is not None:  # format 1's layout is translated, any other checked
        header["generationCheckpoint"] = normalized(generation_checkpoint, tokens, ns)
    if attachments:
        header["attachments"] = attachments
    try:
        json.dumps(header)
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot header is not JSON-serializable: {e}") from None
    _check_readable(json.loads(json.dumps(header)), tensors)
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
    format: str = "mlxkv",
) -> dict:
    """Write ``caches`` and the ``tokens`` they encode to ``path``; returns the header.

    ``model`` records the identity derived from it (its id and fingerprint,
    ``mlxkv.state.identity``), so that loading into another model is refused; the
    identity keywords, when given, override it. Everything is checked before the file is
    opened; the write is atomic, so a snapshot already at ``path`` survives any failure.
    ``created_at`` pins the timestamp (fixtures). ``format="mlx-bun"`` writes mlx-bun's
    cache-file format instead (docs/mlx-bun.md).
    """
    identity = Identity.resolved(
        model, model_id=model_id, config_fingerprint=config_fingerprint, tokenizer_hash=tokenizer_hash, ns=ns
    ).keywords()
    if format == "mlx-bun":  # hook: mlx-bun's format lives in state/mlxbun.py
        from .mlxbun import save_mlx_bun

        return save_mlx_bun(
            path,
            caches,
            tokens,
            **identity,
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
        **identity,
        generation_checkpoint=generation_checkpoint,
        attachments=attachments,
        created_at=created_at,
    )
    return write(path, header, tensors, progress=progress, fsync=fsync)


# -- reading ------------------------------------------------------------------------------


def parse_header(st: SafetensorsHeader) -> dict:
    """Every header check of section 8 of docs/format.md over a safetensors header (a file's,
    or one a prompt store's shared tier assembled from a manifest); returns the mlxkv header."""
    return check_header(st)


def read_header(path: str) -> dict:
    """The validated mlxkv header of ``path``; no tensor bytes are read."""
    with open_container(path) as file:
        if isinstance(file, MlxBunFile):  # hook: an mlx-bun file, translated (state/mlxbun.py)
            from .mlxbun import read_mlx_bun_header

            return read_mlx_bun_header(file)
        return check_header(file.header)


def check_model_identity(path, header, model):
    """A snapshot that records a model fingerprint loads only into that model."""
    recorded = header.get("configFingerprint")
    if not recorded:
        return  # saved without a model: nothing to compare (the geometry still is)
    mine = model_fingerprint(model)
    if recorded != mine and recorded != legacy_config_fingerprint(model):
        raise IdentityMismatchError(
            f"{path}: the snapshot was computed by another model (fingerprint {recorded[:16]}..., "
            f"this model's is {mine[:16]}...; modelId {header.get('modelId')!r}): its caches would make this "
            "model generate garbage. Pass allow_other_model=True to load it anyway"
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


def check_for_model(path, header, model, allow_other_model: bool = False):
    """What loading ``header`` into ``model`` needs: its recorded fingerprint (unless
    ``allow_other_model``), then its layer count and head geometry."""
    if not allow_other_model:
        check_model_identity(path, header, model)
    check_geometry(path, header, model)


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
    store keeps them so). See ``load`` for ``model``, ``allow_other_model``, ``check``."""
    with SafetensorsFile(path) as file:
        return _read(file, model, verify, slack, progress, allow_other_model, check, expect)


def _read(file: SafetensorsFile, model, verify, slack, progress, allow_other_model, check, expect):
    """``read`` on a file already open (``load`` opens it with ``open_container``)."""
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
    with open_container(path) as file:
        if isinstance(file, MlxBunFile):  # hook: an mlx-bun file (state/mlxbun.py)
            from .mlxbun import load_mlx_bun

            return load_mlx_bun(
                file,
                model,
                verify=verify,
                progress=progress,
                allow_other_model=allow_other_model,
                check=check,
                **expect,
            )
        header, arrays = _read(file, model, verify, True, progress, allow_other_model, check, expect)
    caches = decode_entries(header, arrays, path)
    del arrays
    for cache in caches:
        mx.eval(cache.state)  # a codec that transforms its slots does it one cache at a time
    return Snapshot(caches, list(header["tokens"]), header, path)


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every checksum of ``path`` without building caches; returns the header."""
    with open_container(path) as file:
        if isinstance(file, MlxBunFile):  # hook: an mlx-bun file (state/mlxbun.py)
            from .mlxbun import verify_mlx_bun

            return verify_mlx_bun(file, progress)
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
