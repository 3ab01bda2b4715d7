"""The storage both eviction caches share (TOVA in ``tova.py``, Q-Filters in ``qfilters.py``):
kept rows in temporal order with the original position of every row, ``offset`` = true
position, masks for gapped positions, trim until the first eviction, and the row gathers
their selections use.
"""

import itertools

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..checks import is_int
from ..errors import CacheConfigError
from ..math.selection import position_rows
from .base import CacheContract, DenseKeysAndValues, row_bytes

_STAMPS = itertools.count(1)  # a fresh stamp per mutation: window masks are memoized by it


class EvictionKVCache(DenseKeysAndValues, CacheContract, mlx_cache._BaseCache):
    """Kept rows ``keys`` [B, H, T, D], ``values`` [B, H, T, Dv] in temporal order and
    ``positions`` int32 [B, H, T], the original position of every kept row.

    ``offset`` counts every token ever appended (mlx-lm rotates the incoming key at
    ``offset``); survivors keep the rotation they were stored with, so gaps are expected.
    ``update_and_fetch`` returns the stored rows plus this call's rows (the mask was built
    before the call for exactly that layout); eviction applies to what is stored after.
    Subclasses implement ``_admit`` (choose what to store) and ``kind``.
    """

    def __init__(self, budget: int, n_sink: int):
        self.budget, self.n_sink = budget, n_sink
        self.keys = self.values = self.positions = None
        self.offset = 0
        self._stamp = next(_STAMPS)

    # -- layout ----------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Rows stored now (the same for every batch row and head)."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def has_evicted(self) -> bool:
        return self.rows < self.offset

    def _check_incoming(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise CacheConfigError(
                f"{self.kind}: keys and values must be [B, H, N, D] with equal B, H, N; got "
                f"{list(keys.shape)} and {list(values.shape)}"
            )
        if self.keys is not None:
            want = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.values.shape[3])
            got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            if got != want:
                raise CacheConfigError(f"{self.kind}: appending (B, H, D, Dv)={got} to a cache holding {want}")

    def _joined(self, keys, values):
        """Stored rows plus the new ones (keys, values, positions)."""
        B, H, N, _ = keys.shape
        pos = position_rows(B, H, self.offset, N)
        if self.keys is None:
            return keys, values, pos
        keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)
        cat = lambda a, b: mx.concatenate([a, b], axis=2)
        return cat(self.keys, keys), cat(self.values, values), cat(self.positions, pos)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_incoming(keys, values)
        k, v, p = self._joined(keys, values)
        self.offset += keys.shape[2]
        self._admit(k, v, p, keys.shape[2])
        self._stamp = next(_STAMPS)
        return k, v

    def _admit(self, keys, values, positions, n_new: int):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- masks -----------------------------------------------------------------------
    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask of the next ``update_and_fetch(N new rows)``: stored rows are all in the
        past, so mlx-lm's bottom-right causal mask over T + N columns is right as long as no
        window cuts the gapped stored positions; otherwise an array mask [B, H_kv, N, T + N]
        is built from the stored positions (per kv head: heads keep different rows; with
        grouped queries the caller repeats it to the query heads)."""
        T = self.rows
        if window_size is None or self.offset + N <= window_size:
            return self.masks.causal(N, T, None, return_array)
        if not self.has_evicted:  # positions are 0..offset-1: the ordinary windowed mask
            return self.masks.causal(N, T, window_size, return_array)
        key = ("eviction-window", self._stamp, N, window_size)
        return self.masks.get(key, lambda: self._window_mask(N, window_size))

    def _window_mask(self, N: int, window_size: int) -> mx.array:
        B, H = self.positions.shape[:2]
        keys_at = mx.concatenate([self.positions, position_rows(B, H, self.offset, N)], axis=2)
        queries_at = mx.arange(self.offset, self.offset + N, dtype=mx.int32)[:, None]
        k = keys_at[:, :, None, :]
        return (k <= queries_at) & (queries_at < k + window_size)

    # -- trim ------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        """Only until the first eviction: after it the rows no longer end at ``offset``."""
        return not self.has_evicted

    def trim(self, n: int) -> int:
        if self.has_evicted or n <= 0:
            return 0
        n = min(self.offset, n)
        self._trim_rows(self.rows - n)
        self.offset -= n
        self._stamp = next(_STAMPS)
        return n

    def _trim_rows(self, keep: int):
        if keep == 0:
            self.keys = self.values = self.positions = None
        else:
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
            self.positions = self.positions[..., :keep]

    # -- mlx-lm surface and accounting ------------------------------------------------
    @property
    def state(self):
        return () if self.keys is None else (self.keys, self.values, self.positions)

    @state.setter
    def state(self, v):
        self.keys, self.values, self.positions = v

    def size(self) -> int:
        return self.rows

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def bytes_per_token(self) -> int:
        """Bytes one stored row costs one batch row (keys, values, position)."""
        return 0 if self.keys is None else row_bytes(self.keys, self.values, self.positions)

    def dense_window(self):
        return None if self.keys is None else (self.keys, self.values)

    @property
    def tokens_seen(self) -> int:
        """(batch, head, position) rows ever appended: B * H * offset."""
        return 0 if self.keys is None else self.keys.shape[0] * self.keys.shape[1] * self.offset

    @property
    def tokens_kept(self) -> int:
        """(batch, head, position) rows stored now: B * H * rows."""
        return 0 if self.keys is None else self.keys.shape[0] * self.keys.shape[1] * self.rows

    @property
    def kept_bytes(self) -> int:
        """Bytes of the kept keys and values: tokens_kept * (D + Dv) * itemsize."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per token kept: 1.0 below the budget, offset / budget after."""
        return 1.0 if self.rows == 0 else self.offset / self.rows

    def _adopt_rows(self, keys, values, positions, offset: int):
        if keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or positions.shape != keys.shape[:3]:
            raise CacheConfigError(
                f"{self.kind}: adopt needs keys [B,H,T,D], values [B,H,T,Dv], positions [B,H,T]; "
                f"got {list(keys.shape)}, {list(values.shape)}, {list(positions.shape)}"
            )
        if keys.shape[2] > offset:
            raise CacheConfigError(f"{self.kind}: {keys.shape[2]} rows cannot come from {offset} tokens")
        self.keys, self.values = keys, values
        self.positions = positions.astype(mx.int32)
        self.offset = offset
        self._stamp = next(_STAMPS)


def check_budget(budget, n_sink, what: str):
    if not is_int(budget) or budget < 1:
        raise CacheConfigError(f"{what}: budget must be an integer >= 1, got {budget!r}")
    if not is_int(n_sink) or n_sink < 0:
        raise CacheConfigError(f"{what}: n_sink must be an integer >= 0, got {n_sink!r}")
