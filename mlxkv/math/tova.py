"""TOVA's selection: which rows survive when tokens arrive one by one over a budget.

After every appended token, if more than ``budget`` rows are stored, the incoming key is the
proxy query: ``softmax(K_stored_and_new . k / sqrt(D))`` in float32 over every stored row and
itself; the first ``n_sink`` rows are protected and the row with the lowest weight is dropped
(ties to the lowest index). No score survives a step.
"""

import math

import mlx.core as mx

from .selection import drop_one, gather_rows

#: evicting tokens of one block are processed in chunks of this many (bounds the logits
#: matrix to [B, H, budget + chunk, chunk] floats; the result does not depend on it)
TOVA_CHUNK = 64


def tova_survivors(keys: mx.array, budget: int, n_sink: int) -> mx.array:
    """Rows kept when the rows after ``budget`` arrive one by one, each evicting one row.

    ``keys`` [B, H, budget + c, D]: the first ``budget`` rows are stored, the last c arrive
    in order. Returns the kept row indices, ascending, int32 [B, H, budget].

    The logits of every arriving key against every row are one matmul; the loop over the c
    arrivals then only masks, takes a softmax and an argmin over [B, H, budget + c]. Rows
    that have not arrived yet get -inf logits and +inf eviction cost (precomputed per step);
    evicted rows are tracked in ``gone`` (0 kept, +inf evicted).
    """
    B, H, R, D = keys.shape
    c = R - budget
    k32 = keys.astype(mx.float32)
    if c == 1:  # a decode step: one arrival, one victim, no bookkeeping
        weights = mx.softmax((k32 @ k32[:, :, budget:, :].swapaxes(-1, -2))[..., 0] * (1.0 / math.sqrt(D)), axis=-1)
        rows = mx.arange(R, dtype=mx.int32)
        return drop_one(mx.where(rows < n_sink, mx.inf, weights), lowest_index=True)
    logits = (k32 @ k32[:, :, budget:, :].swapaxes(-1, -2)) * (1.0 / math.sqrt(D))
    logits = mx.moveaxis(logits, -1, 0)  # [c, B, H, R]: step j reads one contiguous slab
    rows = mx.arange(R, dtype=mx.int32)
    future = rows[None, :] > budget + mx.arange(c, dtype=mx.int32)[:, None]  # [c, R]
    logits = mx.where(future[:, None, None, :], -mx.inf, logits)
    protected = mx.where(future | (rows[None, :] < n_sink), mx.inf, 0.0)  # [c, R]
    gone = mx.zeros((B, H, R), mx.float32)
    for j in range(c):
        weights = mx.softmax(logits[j] - gone, axis=-1)  # over the rows present at step j
        cost = weights + protected[j] + gone
        lowest = mx.min(cost, axis=-1, keepdims=True)
        victim = mx.min(mx.where(cost == lowest, rows, R), axis=-1, keepdims=True)  # lowest index
        gone = mx.where(rows == victim, mx.inf, gone)
    order = mx.where(gone == 0, rows, rows + R)  # kept rows first, each group ascending
    return mx.sort(order, axis=-1)[..., :budget]


def tova_evict(keys, values, positions, budget: int, n_sink: int, chunk: int = TOVA_CHUNK):
    """Apply TOVA to rows in temporal order whose first ``budget`` rows were stored before the
    rest arrived. Returns the kept (keys, values, positions), at most ``budget`` rows."""
    R = keys.shape[2]
    if budget >= R:
        return keys, values, positions
    kept = (keys[..., :budget, :], values[..., :budget, :], positions[..., :budget])
    for start in range(budget, R, chunk):
        end = min(start + chunk, R)
        if start == budget:
            window = (keys[..., :end, :], values[..., :end, :], positions[..., :end])
        else:
            window = (
                mx.concatenate([kept[0], keys[..., start:end, :]], axis=2),
                mx.concatenate([kept[1], values[..., start:end, :]], axis=2),
                mx.concatenate([kept[2], positions[..., start:end]], axis=2),
            )
        idx = tova_survivors(window[0], budget, n_sink)
        kept = tuple(gather_rows(a, idx) for a in window)
        if end < R:
            mx.eval(kept)  # keep the lazy graph one chunk deep
    return kept
