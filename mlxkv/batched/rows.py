"""Batched rows (DESIGN section 8): join serial caches into one batched cache per layer,
retire rows, and take rows back out as owned serial caches.

Rows are left-padded and right-aligned; masks hide the padding and RoPE reads each row's
own position (``offset`` is a per-row array, as in mlx-lm's batch caches). Batched layouts
have their own kinds (``kv:batched-...``) and no codec: extract rows before saving.

Which layout a row gets is decided by its serial ``kind`` string (``ROW_LAYOUTS``); a kind
no entry handles raises :class:`~mlxkv.errors.UnknownKindError` naming it.
"""

from typing import Callable, List, Sequence, Tuple

from ..errors import CacheConfigError, MLXKVError, UnknownKindError
from ..caches.base import kind_of
from .arrays import merge_arrays_rows
from .attention import merge_attention_rows
from .eviction import eviction_format, merge_eviction_rows
from .formats import linear_format, ring_format, turbo_format
from ..caches.plain import KVCache
from ..caches.transition import Bf16FirstCache


def _attention(format_of, merge_format=merge_attention_rows):
    def merge(rows):
        fmt = format_of(rows[0])
        for i, r in enumerate(rows):
            if format_of(r) != fmt:
                raise CacheConfigError(
                    f"row {i} is a {r.kind} with {format_of(r)}, row 0 has {fmt}: rows of one "
                    "batch share one geometry (ring size and keep, budget, ...)"
                )
        return merge_format(fmt, rows)

    return merge


# (does this entry handle the serial kind?, merge(rows) -> batched cache). Exact compares for
# fixed kinds, prefixes for parameterized ones. A new family adds one entry.
ROW_LAYOUTS: List[Tuple[Callable[[str], bool], Callable]] = [
    (lambda k: k == "kv:plain", _attention(linear_format)),
    (lambda k: k.startswith("kv:quant:"), _attention(linear_format)),
    (lambda k: k == "kv:rotating-plain", _attention(ring_format)),
    (lambda k: k.startswith("kv:rotating-quant:"), _attention(ring_format)),
    (lambda k: k.startswith("kv:turboquant:"), _attention(turbo_format)),
    (lambda k: k.startswith("kv:tova:"), _attention(eviction_format, merge_eviction_rows)),
    (lambda k: k.startswith("kv:qfilters:"), _attention(eviction_format, merge_eviction_rows)),
    (lambda k: k == "ssm", merge_arrays_rows),
]

# Kinds of the batched layouts (exact or, ending in ":", prefix).
BATCHED_KINDS: List[str] = [
    "kv:batched-plain",
    "kv:batched-quant:",
    "kv:batched-rotating-plain",
    "kv:batched-rotating-quant:",
    "kv:batched-turboquant:",
    "kv:batched-tova:",
    "kv:batched-qfilters:",
    "kv:batched-ssm",
]


def register_row_layout(handles: Callable[[str], bool], merge: Callable, batched_kind: str):
    """Add a family: ``handles(serial_kind)``, ``merge(rows)`` and its batched kind."""
    ROW_LAYOUTS.append((handles, merge))
    BATCHED_KINDS.append(batched_kind)


def _is_batchedkind_of(kind: str) -> bool:
    return any(kind == k or (k.endswith(":") and kind.startswith(k)) for k in BATCHED_KINDS)


def is_row_batch(cache) -> bool:
    """Structural first (a batch can give rows back), then its kind must be a batched one."""
    if not hasattr(cache, "extract_row"):
        return False
    kind = kind_of(cache)
    if not _is_batchedkind_of(kind):
        raise UnknownKindError(kind, "batched rows: not a batched layout mlxkv knows")
    return True


def _require_batch(cache, what: str):
    if not is_row_batch(cache):
        raise MLXKVError(
            f"{what} needs a batched cache (made by merge_rows), got a {kind_of(cache)} cache"
        )


def _settle(row, i: int):
    """The storage a serial row attends from its next append on.

    A bf16-first row whose conversion is due (its next append would convert it) is converted
    on a copy now, exactly as that append would; one still short of its start cannot share a
    batch, because a batch holds one storage per layer.
    """
    if not isinstance(row, Bf16FirstCache):
        return row
    p = row.pending
    if p is None:
        return row.inner
    plain = row.inner
    if plain.offset == 0 or plain.offset < p.start:
        raise CacheConfigError(
            f"row {i} is bf16-first and converts to {p.scheme} at position {p.start} "
            f"(it is at {plain.offset}): a batched layer holds one storage, so it cannot "
            "convert one row mid-batch; decode that row alone until it converts"
        )
    copy = KVCache()
    copy.keys, copy.values, copy.offset = plain.keys, plain.values, plain.offset
    copy.masks, copy.minimum_reusable_offset = plain.masks, plain.minimum_reusable_offset
    out = p.convert(copy)  # consumes the copy, never the caller's row
    if p.start > 0:
        out.minimum_reusable_offset = max(out.minimum_reusable_offset, plain.offset)
    return out


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
    rows = [_settle(r, i) for i, r in enumerate(rows)]
    kinds = [kind_of(r) for r in rows]
    merges = [_layout_for(k) for k in kinds]
    for i, k in enumerate(kinds):
        if k != kinds[0]:
            raise CacheConfigError(f"row {i} is {k!r} but row 0 is {kinds[0]!r}: a batch holds one kind per layer")
    return merges[0](rows)


def _layout_for(kind: str) -> Callable:
    for handles, merge in ROW_LAYOUTS:
        if handles(kind):
            return merge
    raise UnknownKindError(kind, "batched rows: no row layout handles it")


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
