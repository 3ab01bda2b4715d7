"""Batched rows (docs/batched.md): join serial caches into one batched cache per layer,
retire rows, and take rows back out as owned serial caches.

Rows are left-padded and right-aligned; masks hide the padding and RoPE reads each row's
own position (``offset`` is a per-row array, as in mlx-lm's batch caches). Batched layouts
have their own kinds (``kv:batched-...``) and no codec: extract rows before saving.

The layout a row gets is its family's (``mlxkv.families``: ``rows(serial) -> row format``,
whose ``merge(rows)`` builds the batch; the layouts live in ``mlxkv.batched``). A kind no
family handles raises :class:`~mlxkv.errors.UnknownKindError` naming it.
"""

from collections.abc import Sequence

from ..errors import CacheConfigError, MLXKVError
from ..families import family_of_batched_kind, family_of_kind, kind_of
from .transition import settled


def is_row_batch(cache) -> bool:
    """Structural first (a batch can give rows back), then its kind must be a batched one."""
    if not hasattr(cache, "extract_row"):
        return False
    family_of_batched_kind(kind_of(cache))
    return True


def _require_batch(cache, what: str):
    if not is_row_batch(cache):
        raise MLXKVError(f"{what} needs a batched cache (made by merge_rows), got a {kind_of(cache)} cache")


def row_format(row):
    """The row format of a serial cache (its family's), or an error naming the kind."""
    family = family_of_kind(kind_of(row), "batched rows: no row layout handles it")
    if family.rows is None:
        raise CacheConfigError(f"{row.kind} rows cannot share a batch")
    return family.rows(row)


def merge_rows(rows: Sequence):
    """One batched cache for one layer from serial caches of one kind, one per request.

    The rows are not modified; the batch owns copies of their stored arrays.
    """
    rows = list(rows)
    if not rows:
        raise MLXKVError("merge_rows needs at least one row")
    for i, r in enumerate(rows):
        if hasattr(r, "extract_row"):
            raise MLXKVError(f"row {i} is already a batch ({kind_of(r)}): join batches with extend(batch, other)")
    rows = [settled(r, i) for i, r in enumerate(rows)]
    formats = [row_format(r) for r in rows]  # an unknown kind is named before a mixed batch
    kinds = [kind_of(r) for r in rows]
    for i, k in enumerate(kinds):
        if k != kinds[0]:
            raise CacheConfigError(f"row {i} is {k!r} but row 0 is {kinds[0]!r}: a batch holds one kind per layer")
    for i, f in enumerate(formats):
        if f != formats[0]:
            raise CacheConfigError(
                f"row {i} is a {kinds[i]} with {f}, row 0 has {formats[0]}: rows of one "
                "batch share one geometry (ring size and keep, budget, ...)"
            )
    return formats[0].merge(rows)


def extend(batch, more):
    """Join more rows into ``batch`` in place: a serial cache, a list of them, or a batch."""
    _require_batch(batch, "extend")
    if isinstance(more, (list, tuple)):
        more = merge_rows(more)
    elif not hasattr(more, "extract_row"):
        more = merge_rows([more])
    else:
        _require_batch(more, "extend")
    return batch.extend_rows(more)


def filter_rows(batch, keep: Sequence[int]):
    """Keep rows ``keep`` (in that order) in place; drops the padding common to survivors."""
    _require_batch(batch, "filter_rows")
    return batch.filter_rows(list(keep))


def extract_row(batch, i: int):
    """Row ``i`` as an owned serial cache of its own kind, at its own offset (a true copy)."""
    _require_batch(batch, "extract_row")
    return batch.extract_row(i)


# -- a model's caches: one list of per-layer caches per request ------------------------------


def merge_model_rows(requests: Sequence[Sequence]) -> list:
    """``requests[r][layer]`` -> one batched cache per layer."""
    requests = [list(r) for r in requests]
    if not requests:
        raise MLXKVError("merge_model_rows needs at least one request")
    layers = {len(r) for r in requests}
    if len(layers) != 1:
        raise CacheConfigError(f"requests hold different numbers of layers: {sorted(layers)}")
    return [merge_rows(layer) for layer in zip(*requests)]


def extend_model_rows(batch: Sequence, more: Sequence) -> list:
    """Join one request (its per-layer caches), several (a list of those) or a batched
    per-layer list into ``batch``, in place."""
    more = list(more)
    if more and isinstance(more[0], (list, tuple)):
        more = merge_model_rows(more)
    if len(more) != len(batch):
        raise CacheConfigError(f"the batch has {len(batch)} layers, the rows {len(more)}")
    for b, m in zip(batch, more):
        extend(b, m)
    return list(batch)


def filter_model_rows(batch: Sequence, keep: Sequence[int]) -> list:
    for b in batch:
        filter_rows(b, keep)
    return list(batch)


def extract_model_row(batch: Sequence, i: int) -> list:
    """Request ``i`` as a list of owned serial caches, one per layer (sharing one masks)."""
    return [extract_row(b, i) for b in batch]
