"""Batched rows (docs/batched.md): join serial caches into one batched cache per layer,
retire rows, and take rows back out as owned serial caches.

Rows are left-padded and right-aligned; masks hide the padding and RoPE reads each row's
own position (``offset`` is a per-row array, as in mlx-lm's batch caches). Batched layouts
have their own kinds (``kv:batched-...``) and no codec: extract rows before saving.

The layout a row gets is its family's (``mlxkv.families``: ``rows(serial) -> row format``,
whose ``merge(rows)`` builds the batch; the layouts live beside this module). A kind no
family handles raises :class:`~mlxkv.errors.UnknownKindError` naming it. Bf16-first rows
(``Bf16FirstCache``) join a batch of their target's layout, each row in its own precision
until its own start.

The model-level functions are transactions: a change to a model's batch (one batched cache
per layer) applies to every layer or, when any layer refuses, to none.
"""

import contextlib
import copy
from collections.abc import Sequence

import numpy as np

from ..caches.plain import KVCache
from ..caches.transition import Bf16FirstCache
from ..errors import CacheConfigError, MLXKVError
from ..families import family_of_batched_kind, family_of_kind, kind_of


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


def _common_format(rows):
    """The one row format of ``rows`` (one kind, one geometry), or an error naming the odd row."""
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
    return formats[0]


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
    if any(isinstance(r, Bf16FirstCache) for r in rows):
        return _merge_bf16_first(rows)
    return _common_format(rows).merge(rows)


def _merge_bf16_first(rows):
    """Bf16-first rows (and rows already in their target's storage) in one batch of the
    target's layout; a row not converted yet is stored as its conversion would encode it
    and keeps its bf16 positions beside (``mlxkv.batched.bf16first``)."""
    pending = next(r.pending for r in rows if isinstance(r, Bf16FirstCache))
    targets, plains = [], {}
    for i, r in enumerate(rows):
        p = getattr(r, "pending", None)
        if isinstance(r, Bf16FirstCache) and (p.scheme, p.start) != (pending.scheme, pending.start):
            raise CacheConfigError(
                f"row {i} converts to {p.scheme} at {p.start}, row 0 to {pending.scheme} at {pending.start}: "
                "a batch holds one scheme per layer"
            )
        inner = r.inner if isinstance(r, Bf16FirstCache) else r
        if isinstance(r, Bf16FirstCache) and not r.converted:
            plains[i] = inner
            twin = KVCache()  # the conversion consumes its source: give it a view of the row
            twin.keys, twin.values, twin.offset = inner.keys, inner.values, inner.offset
            twin.masks = inner.masks
            inner = pending.convert(twin)
            inner.minimum_reusable_offset = r.minimum_reusable_offset
        targets.append(inner)
    fmt = _common_format(targets)
    return fmt.merge_bf16_first(targets, pending, plains)


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


def trim_rows(batch, counts: Sequence[int]):
    """Trim row i of ``batch`` by ``counts[i]`` positions, in place (all rows or none)."""
    _require_batch(batch, "trim_rows")
    return batch.trim_rows(counts)


# -- a model's caches: one list of per-layer caches per request ------------------------------


@contextlib.contextmanager
def transaction(layers: Sequence):
    """Apply a change to every layer of a model's batch or to none: each layer's attributes
    are kept (stored arrays are values, never written in place by row surgery) and put
    back if any layer raises."""
    saved = [_saved(c) for c in layers]
    try:
        yield
    except BaseException:
        for restore in saved:
            restore()
        raise


def _saved(cache):
    """A function that puts ``cache``'s attributes back as they are now: mutable containers
    copied one level deep, and the batches it is made of (a bf16-first batch's two) saved
    the same way."""
    attrs = dict(cache.__dict__)
    parts = []
    for name, value in attrs.items():
        if isinstance(value, (dict, list)):
            attrs[name] = copy.copy(value)
        elif hasattr(value, "extract_row"):
            parts.append(_saved(value))

    def restore():
        cache.__dict__.clear()
        cache.__dict__.update(attrs)
        for part in parts:
            part()

    return restore


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
    per-layer list into ``batch``, in place: every layer joins or none does."""
    more = list(more)
    if more and isinstance(more[0], (list, tuple)):
        more = merge_model_rows(more)
    if len(more) != len(batch):
        raise CacheConfigError(f"the batch has {len(batch)} layers, the rows {len(more)}")
    with transaction(batch):
        for b, m in zip(batch, more):
            extend(b, m)
    return list(batch)


def filter_model_rows(batch: Sequence, keep: Sequence[int]) -> list:
    """Keep rows ``keep`` (in that order) in every layer, or, if any layer refuses, in none."""
    with transaction(batch):
        for b in batch:
            filter_rows(b, keep)
    return list(batch)


def trim_model_rows(batch: Sequence, counts: Sequence[int]) -> list:
    """Trim request i by ``counts[i]`` positions in every layer (speculative decoding's
    per-row rollback), or in none. Recurrent state cannot trim: a count > 0 on a model
    with recurrent layers is refused."""
    with transaction(batch):
        for b in batch:
            trim_rows(b, counts)
    return list(batch)


def extract_model_row(batch: Sequence, i: int) -> list:
    """Request ``i`` as a list of owned serial caches, one per layer (sharing one masks)."""
    return [extract_row(b, i) for b in batch]


def projected_bytes(batch: Sequence, rows: Sequence[int] = (), tokens: int = 0) -> int:
    """What a model's batch will hold, in bytes, once requests holding ``rows`` positions
    each have joined and every request has appended ``tokens`` more: what an admission
    controller asks before a join or a longer generation. Within one allocation step (256
    columns of every row) of the bytes the batch then holds; a layer that has stored
    nothing yet does not know its geometry and counts what it holds."""
    rows = [int(n) for n in rows]
    if any(n < 0 for n in rows) or tokens < 0:
        raise MLXKVError(f"projected_bytes needs counts >= 0, got rows={rows}, tokens={tokens}")
    return int(sum(np.int64(b.projected_bytes(rows, tokens)) for b in batch))
