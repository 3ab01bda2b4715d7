"""The kind table: one record per cache family, read by every dispatch on a kind.

A family names its live ``kind`` (exact, or a prefix ending in ``:`` for parameterized kinds
such as ``kv:quant:<bits>:<group>``), its codec (which declares the persisted kind written in
headers, the header fields and tensor slots of an entry, and mlx-bun's form of it), its row
layout, its compiled decode steps and its scheme parser. Saving, loading, joining rows,
building caches from a scheme and compiled decode all look the family up here; nothing else
routes on a kind.

The records are declared in ``mlxkv.kinds.records`` (they name classes of every layer) and
registered when the table is first read (``import mlxkv`` stays light); this module, at the
bottom of the package, only holds the table, so any layer may read it without importing the
layers above.

An unknown kind is a bug, not a route: every lookup raises
:class:`~mlxkv.errors.UnknownKindError` naming the kind.
"""

import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .errors import MLXKVError, UnknownKindError, UnsupportedKindError

#: field types of header entries: an integer >= 0, +1 or -1, a JSON bool
COUNT, SIGN, FLAG = "count", "sign", "flag"
BATCHED_PREFIX = "kv:batched-"


@dataclass(frozen=True)
class Family:
    """One cache family.

    - ``kind``: the live kind, exact (``"kv:plain"``) or a prefix ending in ``:`` (the live
      cache's ``kind`` or ``kind_prefix``);
    - ``codec``: the family's codec (``mlxkv.codecs.base.Codec``): its ``persisted`` kind,
      ``fields``, ``slots`` and ``bun`` form, and ``encode``, ``stored``, ``check``,
      ``check_values``, ``decode``, ``prefix``, ``trimmable``, ``capacity``, ``geometry``;
    - ``rows``: ``rows(serial_cache) -> row format`` whose ``merge(rows)`` builds the batched
      layout; None when rows of this family cannot share a batch;
    - ``decode_step``: ``decode_step(cache) -> DecodeStep``, the cache's part in one compiled
      decode step (its trace key, its graph inputs, its commit), or None;
    - ``batched_decode_step``: the same for a batch of this family's rows (its batched layout),
      or None;
    - ``scheme``: ``(pattern, parse)`` where ``parse(match, options) -> Scheme`` builds the
      caches of a scheme string matching ``pattern``; None for families no scheme names
      (rings and recurrent state follow the model's own layers).
    """

    kind: str
    codec: object
    rows: Callable | None = None
    decode_step: Callable | None = None
    batched_decode_step: Callable | None = None
    scheme: tuple[str, Callable] | None = None

    @property
    def persisted(self) -> str:
        """The kind written in snapshot headers (``"kv"``, ``"qkv"``, ...): the codec's."""
        return self.codec.persisted

    @property
    def fields(self) -> Mapping[str, str]:
        """The header fields of an entry besides ``kind``, ``tensors`` and
        ``minimumReusableOffset``, each with its type: the codec's."""
        return self.codec.fields

    def matches(self, kind: str) -> bool:
        """Is ``kind`` this family's live kind?"""
        return kind.startswith(self.kind) if self.kind.endswith(":") else kind == self.kind

    @property
    def batched_kind(self) -> str:
        """The kind (or prefix) of this family's batched layout (:func:`batched_kind`)."""
        return batched_kind(self.kind)


def batched_kind(kind: str) -> str:
    """The kind of a batch of ``kind`` rows: ``kv:batched-`` plus ``kind`` without its ``kv:``."""
    return BATCHED_PREFIX + kind.removeprefix("kv:")


@dataclass(frozen=True)
class Scheme:
    """A parsed cache scheme, what a family's ``scheme`` parser returns: how to build the
    cache of one full-attention layer."""

    #: the canonical spelling: aliases resolved and every number spelled out, defaults too
    #: (``fp16`` -> ``bf16``, ``kv4`` -> ``kv4-g64``, ``turbo-k8v3`` -> ``turbo-k8v3-start0``)
    name: str
    build: Callable[[int, dict], object]  # (layer index, options) -> cache
    quantizes: bool  # sliding-window layers stay bf16 under it (make_cache warns)
    ring: Callable[[int, int], object] | None = None  # (max_size, keep) -> ring cache
    #: what a generation's request key says of the scheme (docs/sessions.md): mlx-bun's fields
    #: where mlx-bun builds the same caches, else None: ``{"kvScheme": name}``
    policy: dict | None = None
    #: the ``make_cache`` options the family read that change what its caches hold (which
    #: positions they keep, how they encode them), by name, with the values in force (defaults
    #: too); options that only change how a cache is read are not here
    held: dict = field(default_factory=dict)
    #: the ``make_cache`` options the family reads, by name; any other is refused
    #: (``caches.schemes.parse_scheme``) before a cache is built
    options: tuple[str, ...] = ()
    #: a bf16-first scheme's conversion start (its caches are ``Bf16FirstCache``s holding
    #: bf16 until then); None for a scheme whose caches never convert
    start: int | None = None


@dataclass(frozen=True)
class Deferred:
    """A function named by ``"module:name"``, imported at its first call. mlxkv's own records
    name their live parts so (row formats, decode steps, scheme parsers): those modules
    import the live cache classes, and with them mlx-lm, which a header read, a verification
    or ``mlxkv schemes`` never needs; the first cache built imports them."""

    target: str

    def __call__(self, *args, **kwargs):
        return _resolved(self.target)(*args, **kwargs)


@functools.cache
def _resolved(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


_FAMILIES: list[Family] = []
#: the module whose import registers mlxkv's own families
BUILTIN_RECORDS = "mlxkv.kinds.records"


def _table() -> list[Family]:
    """The registered families, mlxkv's own among them: their records are imported on the
    first lookup of the table, not by ``import mlxkv``. They import the codecs and the live
    families' names only (``Deferred`` names the rest), so reading the table imports no
    live cache and nothing of mlx-lm."""
    if BUILTIN_RECORDS not in sys.modules:
        importlib.import_module(BUILTIN_RECORDS)
    return _FAMILIES


def register_family(family: Family) -> Family:
    """Add a family to the table. Its kind and its codec's persisted kind must be new."""
    if not isinstance(family.persisted, str) or not family.persisted:
        raise ValueError(f"the codec of {family.kind!r} declares no persisted kind (Codec.persisted)")
    for f in _table():
        if f.persisted == family.persisted:
            raise ValueError(f"persisted kind {family.persisted!r} is registered already")
        if f.matches(family.kind) or family.matches(f.kind):
            raise ValueError(f"kind {family.kind!r} overlaps the registered kind {f.kind!r}")
    _FAMILIES.append(family)
    return family


def unregister_family(persisted: str) -> None:
    """Remove a family (a test that registered a toy family cleans up with this)."""
    table = _table()
    table[:] = [f for f in table if f.persisted != persisted]


def families() -> list[Family]:
    return list(_table())


def known_persisted_kinds() -> list[str]:
    return [f.persisted for f in _table()]


def _unknown(kind, where: str) -> UnknownKindError:
    return UnknownKindError(kind, where, known_persisted_kinds())


def family_of_kind(kind: str, where: str = "no family handles it") -> Family:
    """The family of a live ``kind``."""
    if isinstance(kind, str):
        for f in _table():
            if f.matches(kind):
                return f
        if kind.startswith(BATCHED_PREFIX):
            where = "batched layouts have no codec: extract rows to serial caches first"
    raise _unknown(kind, where)


def family_of_persisted(persisted, where: str = "persisted kind in a snapshot header") -> Family:
    """The family of a persisted kind (a snapshot header's ``kind``)."""
    for f in _table():
        if f.persisted == persisted:
            return f
    # a refusal of a file: a SnapshotError too
    raise UnsupportedKindError(persisted, str(_unknown(persisted, where)))


def family_of_batched_kind(kind: str) -> Family:
    """The family whose batched layout reports ``kind``."""
    if isinstance(kind, str):
        for f in _table():
            b = f.batched_kind
            if f.rows is not None and (kind.startswith(b) if b.endswith(":") else kind == b):
                return f
    raise _unknown(kind, "batched rows: not a batched layout mlxkv knows")


def step_builder(kind: str) -> Callable | None:
    """The compiled decode step builder of a live ``kind``: its family's ``decode_step``, or
    for a batched layout (``kv:batched-...``) its family's ``batched_decode_step``."""
    if isinstance(kind, str) and kind.startswith(BATCHED_PREFIX):
        return family_of_batched_kind(kind).batched_decode_step
    return family_of_kind(kind).decode_step


_ROW_MERGE: list[Callable] = []


def register_row_merge(merge: Callable) -> None:
    """Install the batched layer's ``merge_rows`` (``mlxkv.batched.rows``), registered with
    the kind records when the table is first read. A serial cache's ``merge`` (mlx-lm's batching
    entry point) calls it through :func:`row_merge`: the live caches sit below the batched
    layouts and never import them."""
    _ROW_MERGE[:] = [merge]


def row_merge() -> Callable:
    """The registered ``merge_rows(rows) -> batched cache``."""
    _table()  # the kind records register it
    if not _ROW_MERGE:
        raise MLXKVError("no batched layout is registered: import mlxkv (it registers the kind records) first")
    return _ROW_MERGE[0]


def scheme_families() -> list[Family]:
    return [f for f in _table() if f.scheme is not None]


def kind_of(cache) -> str:
    """The cache's ``kind``; a cache that declares none is an error, never a guess."""
    kind = getattr(cache, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise UnknownKindError(
            kind,
            f"{type(cache).__name__} declares no kind; build mlxkv caches with "
            "mlxkv.make_cache(model, scheme), or convert an mlx-lm prompt-cache file with `mlxkv convert`",
        )
    return kind
