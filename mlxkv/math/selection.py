"""Row selections the eviction caches share: gathers of kept rows and single-victim drops.

Everything is per (batch, head): arrays are ``[B, H, R, ...]`` with R stored rows.
"""

import mlx.core as mx


def position_rows(B: int, H: int, start: int, n: int) -> mx.array:
    """The original positions ``start .. start+n-1`` of n new rows, int32 [B, H, n]."""
    return mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32), (B, H, n))


def gather_rows(a: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` [B, H, K] of ``a`` [B, H, R, ...] -> [B, H, K, ...] per (batch, head).

    One ``take`` of whole rows from the flattened [B*H*R, ...] array rather than
    ``take_along_axis`` with an index broadcast over the head dimension (docs/tova.md has
    the timings)."""
    B, H, R = a.shape[:3]
    base = (mx.arange(B * H, dtype=mx.int32) * R).reshape(B, H, 1)
    flat = mx.take(a.reshape(B * H * R, *a.shape[3:]), (base + idx).reshape(-1), axis=0)
    return flat.reshape(B, H, idx.shape[2], *a.shape[3:])


def drop_one(cost: mx.array, lowest_index: bool) -> mx.array:
    """Indices [B, H, R-1] (ascending) of every row but the one with the minimum ``cost``
    [B, H, R]; among tied minima the lowest index goes (``lowest_index``) or the highest."""
    R = cost.shape[-1]
    rows = mx.arange(R, dtype=mx.int32)
    tied = cost == mx.min(cost, axis=-1, keepdims=True)
    if lowest_index:
        victim = mx.min(mx.where(tied, rows, R), axis=-1, keepdims=True)
    else:
        victim = mx.max(mx.where(tied, rows, -1), axis=-1, keepdims=True)
    kept = rows[: R - 1]
    return kept + (kept >= victim).astype(mx.int32)
