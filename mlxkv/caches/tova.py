"""``TOVAKVCache`` (``kv:tova:<budget>:<nSink>``): memoryless current-step eviction.

After every appended token, if more than ``budget`` rows are stored, the incoming key is the
proxy query: ``softmax(K_stored_and_new . k / sqrt(D))`` in float32 over every stored row and
itself; the first ``n_sink`` rows are protected and the row with the lowest weight is dropped
(ties to the lowest index). No score survives a step. This runs per (batch, head) and token
by token inside a prefill block exactly as in decode; the tokens of a block that fit under
the budget are appended in one op, and only tokens that trigger an eviction enter the loop.
"""

import math

import mlx.core as mx

from ..errors import CacheConfigError
from .eviction import EvictionKVCache, check_budget, drop_one, gather_rows

#: evicting tokens of one block are processed in chunks of this many (bounds the logits
#: matrix to [B, H, budget + chunk, chunk] floats; the result does not depend on it)
TOVA_CHUNK = 64


# -- TOVA selection ------------------------------------------------------------------


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
    if R <= budget:
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


class TOVAKVCache(EvictionKVCache):
    """TOVA-adapted (key-as-query proxy): at most ``budget`` rows after every step, the first
    ``n_sink`` rows never evicted. Memoryless: the cache holds no score."""

    def __init__(self, budget: int = 512, n_sink: int = 4):
        check_budget(budget, n_sink, "TOVA")
        if n_sink >= budget:
            raise CacheConfigError(
                f"TOVA: n_sink={n_sink} must be below budget={budget}, or no row could ever be evicted"
            )
        super().__init__(budget, n_sink)

    @property
    def kind(self) -> str:
        return f"kv:tova:{self.budget}:{self.n_sink}"

    def _admit(self, keys, values, positions, n_new: int):
        self.keys, self.values, self.positions = tova_evict(keys, values, positions, self.budget, self.n_sink)

    def adopt(self, keys: mx.array, values: mx.array, positions: mx.array, offset: int) -> "TOVAKVCache":
        """Restore kept rows exactly (position-exact: no slack)."""
        if keys.shape[2] > self.budget:
            raise CacheConfigError(f"{self.kind}: {keys.shape[2]} rows exceed the budget {self.budget}")
        self._adopt_rows(keys, values, positions, offset)
        return self

    def __repr__(self):
        return f"TOVAKVCache(kind={self.kind!r}, offset={self.offset}, rows={self.rows})"


def tova_scheme(m, options):
    """``tova-b<budget>-s<nSink>``: every full-attention layer gets a TOVA cache."""
    from .schemes import Scheme  # late: schemes imports this module for its table

    budget, n_sink = int(m["budget"]), int(m["sink"])
    TOVAKVCache(budget, n_sink)  # validate now, not at the first layer
    return Scheme(m.string, lambda i, o: TOVAKVCache(budget, n_sink), False)


TOVA_SCHEME = r"tova-b(?P<budget>\d+)-s(?P<sink>\d+)"
