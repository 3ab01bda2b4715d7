"""What the batched rows of the eviction caches share (TOVA in ``batched.tova``, Q-Filters in
``batched.qfilters``).

A row stores, per head, its kept keys, values and their original positions (and any
per-row score) in temporal order; every head of a row keeps the same number of rows, so rows
are right-aligned and left-padded like the other attention layouts (padding positions are -1
and masked by the layout). After each append the policy runs per row, on all rows that hold
the same number of positions at once (in decode: every row over budget, one call); the kept
rows are written back right-aligned, nothing is re-encoded.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import MLXKVError
from .attention import BatchedKVCache
from .columns import Columns
from .row_format import RowFormat
from .storages import EvictionStorage


@dataclass(frozen=True)
class EvictionRows(RowFormat):
    """Rows of an eviction family; ``scored`` rows carry one float32 score per kept row."""

    budget: int
    n_sink: int

    scored = False

    @property
    def storage(self):
        return EvictionStorage(self.scored)


class BatchedEvictionCache(BatchedKVCache):
    """Eviction rows: the mask hides padding, the policy evicts per row after each append.

    A policy implements ``_evicting()`` (which rows are over budget and may evict now) and
    ``_kept(rows, R)`` (the kept key tuple and values of ``rows``, each holding R positions
    that end at ``idx``, with at most ``budget`` rows each)."""

    def _evicted_any(self) -> bool:
        return bool((self.cols.counts < self.offsets).any())

    def make_mask(self, N, window_size=None, return_array=False, **_):
        if window_size is not None and self._evicted_any():
            raise MLXKVError(
                f"{self.kind}: a windowed mask over rows that have evicted needs per-head positions; "
                "batched eviction rows support full attention only"
            )
        return super().make_mask(N, window_size, return_array)

    def is_trimmable(self) -> bool:
        return not self._evicted_any()

    def _trimmable_rows(self) -> np.ndarray:
        return self.cols.counts >= self.offsets  # rows that have not evicted

    def _stored_limit(self) -> int:
        return self.fmt.budget

    def _positions(self, B: int, H: int, N: int) -> mx.array:
        """The original positions of N new positions per row, [B, H, N, 1] int32."""
        pos = mx.array(self.offsets.astype(np.int32))[:, None, None] + mx.arange(N, dtype=mx.int32)
        return mx.broadcast_to(pos[..., None], (B, H, N, 1))

    def _encode(self, keys, values):
        B, H, N, _ = keys.shape
        return (keys, self._positions(B, H, N)), (values,)

    def _evicting(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _kept(self, rows: np.ndarray, R: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def _stored(self, rows: np.ndarray, R: int):
        """(keys tuple, values tuple) of ``rows``: their last R columns, ending at ``idx``."""
        idx = self.cols.idx
        rows_mx = mx.array(rows.astype(np.int32))
        part = lambda a: mx.take(a, rows_mx, axis=0)[..., idx - R : idx, :]
        return tuple(part(a) for a in self.key_arrays), tuple(part(a) for a in self.value_arrays)

    def _after_append(self, N: int):
        evicting = self._evicting()
        counts = self.cols.counts
        for R in np.unique(counts[evicting]):  # one policy call per distinct row length
            rows = np.nonzero(evicting & (counts == R))[0]
            kept_keys, kept_values = self._kept(rows, int(R))
            self._write_right_aligned(rows, kept_keys, kept_values)

    def _write_right_aligned(self, rows: np.ndarray, kept_keys, kept_values):
        idx, budget = self.cols.idx, self.fmt.budget
        rows_mx = mx.array(rows.astype(np.int32))
        lo = idx - budget
        for a, kept in zip(self.key_arrays + self.value_arrays, tuple(kept_keys) + tuple(kept_values)):
            a[rows_mx, :, lo:idx, :] = kept
        s = self.cols.s.copy()
        s[rows] = lo
        self.cols = Columns(s, s.copy(), s.copy(), idx)
