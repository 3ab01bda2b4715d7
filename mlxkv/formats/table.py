"""The file formats mlxkv reads and writes, one row each, and the functions that go through them.

A row says how a file is recognized (the container its magic opens it as, and within
safetensors whether the format claims the file) and what the format does with an open file:
read its header, load it, verify it, describe it, take a conversion's source from it; and,
for a format mlxkv writes, save. ``mlxkv.save``, ``load``, ``read_header``, ``verify`` and
``convert_prompt_cache``, ``mlxkv inspect`` and ``mlxkv convert`` read this table and
nothing else: no other module asks which format a file is.

Every function opens its file once (``io.containers.open_container``): the magic, the
header and every tensor come through that one descriptor, however the path is renamed over.
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import MLXKVError, SnapshotError
from ..io.containers import open_container
from ..io.mlxbun import MlxBunFile
from ..io.safetensors import SafetensorsFile
from ..io.tensor_file import TensorFile
from ..state.identity import Identity
from . import mlxbun, mlxkv, mlxlm
from .snapshot import Carried, Snapshot


@dataclass(frozen=True)
class Format:
    """One file format. The readers take the open file; ``save`` takes the path."""

    name: str
    #: the container its magic opens it as (``io.containers``)
    container: type[TensorFile]
    #: within that container, is the open file this format's (the first row that claims it)
    claims: Callable[[TensorFile], bool]
    read_header: Callable[[TensorFile], dict]
    load: Callable[..., Snapshot]
    verify: Callable[[TensorFile, Callable | None], dict]
    describe: Callable[[TensorFile], tuple[list, list, list]]
    #: ``(file, tokens) -> Carried``: what a conversion carries out of the file (its layers,
    #: no live cache); ``tokens`` only for a format that does not record them
    convert_source: Callable[[TensorFile, Sequence[int] | None], Carried]
    #: ``save(path, caches, tokens, *, identity, ..., created_at) -> header``; None: read only
    save: Callable[..., dict] | None = None
    #: ``save`` of layers (``kinds.entries.Layer``) instead of live caches: a conversion's writer
    save_layers: Callable[..., dict] | None = None


def _records_tokens(load):
    """The conversion source of a format that records its tokens: given tokens are refused."""

    def source(file, tokens):
        if tokens is not None:
            raise MLXKVError(
                f"{file.path}: a snapshot records its tokens; tokens are given for mlx-lm prompt-cache files only"
            )
        return load(file)

    return source


FORMATS = (
    Format(
        name="mlx-bun",
        container=MlxBunFile,
        claims=lambda file: True,
        read_header=mlxbun.read_mlx_bun_header,
        load=mlxbun.load_mlx_bun,
        verify=mlxbun.verify_mlx_bun,
        describe=mlxbun.describe_mlx_bun,
        convert_source=_records_tokens(mlxbun.layers_mlx_bun),
        save=mlxbun.save_mlx_bun,
        save_layers=mlxbun.save_mlx_bun_layers,
    ),
    Format(
        name="mlxkv",
        container=SafetensorsFile,
        claims=mlxkv.claims,
        read_header=mlxkv.read_mlxkv_header,
        load=mlxkv.load_mlxkv,
        verify=mlxkv.verify_mlxkv,
        describe=mlxkv.describe_mlxkv,
        convert_source=_records_tokens(mlxkv.layers_mlxkv),
        save=mlxkv.save_mlxkv,
        save_layers=mlxkv.save_mlxkv_layers,
    ),
    Format(
        name="mlx-lm",  # any other safetensors file: read as mlx-lm's prompt cache when converted
        container=SafetensorsFile,
        claims=lambda file: True,
        read_header=mlxlm.refuse,
        load=mlxlm.refuse,
        verify=mlxlm.refuse,
        describe=mlxlm.refuse,
        convert_source=mlxlm.convert_source,
        save=mlxlm.save_mlx_lm,
        save_layers=mlxlm.save_mlx_lm_layers,
    ),
)


def format_of(file: TensorFile) -> Format:
    """The format of an open file: the first row of its container that claims it."""
    return next(f for f in FORMATS if isinstance(file, f.container) and f.claims(file))


def writer(name: str) -> Format:
    """The format named ``name``, which mlxkv must be able to write."""
    for f in FORMATS:
        if f.name == name and f.save is not None:
            return f
    names = " or ".join(repr(f.name) for f in FORMATS if f.save is not None)
    raise SnapshotError(f"unknown snapshot format {name!r}: {names}")


#: the file-name ending that names a format (mlx-bun's cache files are ``<uuid>.mlxkv``);
#: any other name is written as an mlxkv snapshot unless a format is given
EXTENSIONS = {".mlxkv": "mlx-bun"}


def format_for(path: str, to: str | None) -> str:
    """The format a conversion writes to ``path``: ``to`` when given, else the one its
    extension names (``.mlxkv``: mlx-bun's), else mlxkv."""
    if to is not None:
        return to
    return next((name for ext, name in EXTENSIONS.items() if path.endswith(ext)), "mlxkv")


# -- the public functions -----------------------------------------------------------------


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
    cache-file format instead (docs/mlx-bun.md), ``format="mlx-lm"`` mlx-lm's prompt-cache
    file (``mlx_lm.models.cache.load_prompt_cache`` loads it; kinds mlx-lm lacks are refused,
    docs/sessions.md).
    """
    target = writer(format)
    identity = Identity.resolved(
        model, model_id=model_id, config_fingerprint=config_fingerprint, tokenizer_hash=tokenizer_hash, ns=ns
    )
    return target.save(
        path,
        caches,
        tokens,
        identity=identity,
        generation_checkpoint=generation_checkpoint,
        attachments=attachments,
        progress=progress,
        fsync=fsync,
        created_at=created_at,
    )


def read_header(path: str) -> dict:
    """The validated mlxkv header of ``path`` (an mlx-bun file's translated); no tensor
    bytes are read."""
    with open_container(path) as file:
        return format_of(file).read_header(file)


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
    """Restore a snapshot (mlxkv's or an mlx-bun file).

    With ``model``, the snapshot must have been computed by that model: a recorded
    fingerprint that differs from the model's refuses the load (``IdentityMismatchError``)
    unless ``allow_other_model=True``; the layer count and head geometry are always
    compared. ``expect`` takes model_id, config_fingerprint, tokenizer_hash, ns, each
    compared exactly. ``check(path, header)``, if given, runs after every header check and
    before any tensor is read (raise to refuse). ``verify`` checks every tensor's checksum
    as it is read. The file is opened once: a snapshot renamed over ``path`` meanwhile is
    never mixed with the one being read. Restored on ``model``, TurboQuant caches read as
    ``make_cache(model, ...)`` reads them (``fit_reads``).
    """
    with open_container(path) as file:
        snap = format_of(file).load(
            file, model, verify=verify, progress=progress, allow_other_model=allow_other_model, check=check, **expect
        )
    if model is not None:
        from ..caches.schemes import fit_reads  # the model's attention decides the read

        fit_reads(model, snap.caches)
    return snap


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every checksum of ``path`` without building caches; returns the header."""
    with open_container(path) as file:
        return format_of(file).verify(file, progress)


def describe(path: str) -> tuple[list, list, list]:
    """What ``mlxkv inspect`` prints for ``path``: (general rows, table headers, rows)."""
    with open_container(path) as file:
        return format_of(file).describe(file)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def _converted(source: Callable[[], Carried], src: str, dst: str, to: str | None, progress, identity) -> dict:
    """Write what ``source()`` takes from ``src`` as format ``to`` at ``dst`` (None: the one
    ``dst``'s extension names, :func:`format_for`): the same caches, tokens, identity
    (``identity`` overrides fields), checkpoint, attachments and creation time. Everything
    is refused before ``dst`` is written."""
    target = writer(format_for(dst, to))
    if _same_file(src, dst):
        raise SnapshotError(
            f"{dst}: is the file being converted ({src}): writing there would replace the source; "
            "choose another destination"
        )
    snap = source()  # the layers as read: no live cache is built (nor mlx-lm imported)
    return target.save_layers(
        dst,
        snap.layers,
        snap.tokens,
        identity=Identity.from_header(snap.header).replace(**identity),
        generation_checkpoint=snap.generation_checkpoint,
        attachments=snap.attachments,
        created_at=snap.created_at,
        progress=progress,
    )


def convert(
    src: str,
    dst: str,
    to: str | None = None,
    *,
    tokens: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    **identity,
) -> dict:
    """Rewrite ``src`` (an mlxkv snapshot, an mlx-bun file or an mlx-lm prompt-cache file) as
    format ``to`` at ``dst`` ("mlxkv", "mlx-bun" or "mlx-lm"; by default the one ``dst``'s
    extension names: ``.mlxkv`` is mlx-bun's, any other name mlxkv's); returns the written
    header. ``tokens``: the tokens an mlx-lm
    file's caches cover (``convert_prompt_cache``). Attachments cross only between files of
    one format (mlxkv's are JSON, mlx-bun's hold tensors): the conversion of a file with
    attachments to the other format is refused rather than drop them."""

    def source():
        with open_container(src) as file:
            return format_of(file).convert_source(file, tokens)

    return _converted(source, src, dst, to, progress, identity)


def convert_prompt_cache(
    src: str,
    dst: str,
    tokens: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    format: str | None = None,
    **identity,
) -> dict:
    """Convert the mlx-lm prompt-cache file ``src`` into the mlxkv snapshot ``dst``
    (``format="mlx-bun"``, or a ``dst`` ending in ``.mlxkv``: into an mlx-bun cache file).

    The snapshot records the exact tokens its caches cover, which mlx-lm files do not:
    they come from ``tokens`` or else from a ``tokens`` entry (a JSON list) in the file's
    metadata; with neither, the conversion is refused (MissingTokensError) rather than
    writing tokens that could make a prefix match lie. ``identity`` (model_id,
    config_fingerprint, tokenizer_hash, ns) goes to the header; ``model_id`` defaults to
    the ``model`` entry ``mlx_lm.cache_prompt`` writes. Returns the snapshot header.
    """

    def source():
        with SafetensorsFile(src) as file:  # read as mlx-lm's, whatever it claims to be
            return mlxlm.convert_source(file, tokens)

    return _converted(source, src, dst, format, progress, identity)
