"""Batched rows of the eviction caches: ``kv:batched-tova:<budget>:<nSink>`` and
``kv:batched-qfilters:<budget>:<nSink>:<recent>``.

A row stores, per head, its kept keys, values and their original positions (and Q-Filters
insertion scores) in temporal order; every head of a row keeps the same number of rows, so
rows are right-aligned and left-padded like the other attention layouts (padding positions
are -1 and masked by the layout). After each append the serial policy runs per row, on all
rows that hold the same number of positions at once (in decode: every row over budget, one
call): the kept rows are written back right-aligned, nothing is re-encoded. Q-Filters keeps
each row's filter (calibrated, frozen fallback, or none yet) as per-row state.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import MLXKVError
from .attention import BatchedKVCache, merge_attention_rows
from .columns import Columns
from .formats import EvictionStorage, _Format
from ..caches.qfilters import QFiltersKVCache, key_svd_filter, projection_scores, qfilters_survivors
from ..caches.tova import TOVAKVCache, tova_evict


@dataclass(frozen=True)
class EvictionRows(_Format):
    """TOVA (``recent`` unused) or Q-Filters rows; the fields are the serial parameters."""

    policy: str  # "tova" or "qfilters"
    budget: int
    n_sink: int
    recent: int = 0
    sign: int = 1
    calib_tokens: int = 0

    @property
    def storage(self):
        return EvictionStorage(self.policy == "qfilters")

    @property
    def serial_kind(self) -> str:
        tail = f":{self.recent}" if self.policy == "qfilters" else ""
        return f"kv:{self.policy}:{self.budget}:{self.n_sink}{tail}"

    def read(self, row):
        frozen = self.policy == "qfilters" and row.filter is not None
        extras = {"frozen": frozen, "calibrated": bool(getattr(row, "calibrated", False))}
        if row.keys is None:
            return None, None, 0, extras
        keys = (row.keys, row.positions[..., None])
        if self.policy == "qfilters":
            keys += (row.scores[..., None],)
        return keys, (row.values,), row.keys.shape[2], extras

    def restore(self, keys, values, offset, count, dtype, extras):
        if self.policy == "tova":
            row = TOVAKVCache(self.budget, self.n_sink)
            return row if keys is None else row.adopt(keys[0], values[0], keys[1][..., 0], offset)
        calibrated, frozen = bool(extras["calibrated"][0]), bool(extras["frozen"][0])
        filt = extras["filter"] if frozen else None
        row = QFiltersKVCache(
            self.budget, self.n_sink, self.recent, self.sign, self.calib_tokens,
            filters=filt if calibrated else None,
        )
        if keys is None:
            return row
        return row.adopt(keys[0], values[0], keys[1][..., 0], keys[2][..., 0], offset, filter=filt, calibrated=calibrated)


def eviction_format(row) -> EvictionRows:
    if row.kind.startswith("kv:tova:"):
        return EvictionRows("tova", row.budget, row.n_sink)
    return EvictionRows("qfilters", row.budget, row.n_sink, row.recent, row.sign, row.calib_tokens)


class BatchedEvictionCache(BatchedKVCache):
    """Eviction rows: the mask hides padding, the serial policy evicts per row afterwards."""

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

    def trim(self, n: int) -> int:
        n = super().trim(n)
        fmt = self.fmt
        if n and fmt.policy == "qfilters":
            # a fallback filter estimated from keys that are gone unfreezes, as serially
            thaw = self.row_state["frozen"] & ~self.row_state["calibrated"] & (self.offsets < fmt.calib_tokens)
            if thaw.any():
                self.row_state["frozen"] = self.row_state["frozen"] & ~thaw
                t = mx.array(thaw)
                self.row_state["filter"] = mx.where(t[:, None, None], 0.0, self.row_state["filter"])
                self.keys = self.keys[:2] + (mx.where(t[:, None, None, None], 0.0, self.keys[2]),)
        return n

    def _filter_state(self, keys: mx.array):
        if self.row_state.get("filter") is None:
            B, H, _, D = keys.shape
            self.row_state["filter"] = mx.zeros((B, H, D), mx.float32)

    def extend_rows(self, other):
        self._compatible(other)
        if self.fmt.policy == "qfilters":  # a side that never saw a key has no filter shape yet
            sides = (self, other)
            like = next((c.row_state["filter"] for c in sides if c.row_state.get("filter") is not None), None)
            for c in sides:
                if like is not None and c.row_state.get("filter") is None:
                    c.row_state["filter"] = mx.zeros((c.batch_size, *like.shape[1:]), mx.float32)
        return super().extend_rows(other)

    def _encode(self, keys, values):
        B, H, N, _ = keys.shape
        pos = mx.array(self.offsets.astype(np.int32))[:, None, None] + mx.arange(N, dtype=mx.int32)
        stored = (keys, mx.broadcast_to(pos[..., None], (B, H, N, 1)))
        if self.fmt.policy == "qfilters":
            self._filter_state(keys)
            frozen = mx.array(self.row_state["frozen"])[:, None, None]
            scores = projection_scores(keys, self.row_state["filter"], self.fmt.sign)
            stored += (mx.where(frozen, scores, 0.0)[..., None],)
        return stored, (values,)

    def _after_append(self, N: int):
        fmt = self.fmt
        if fmt.policy == "qfilters":
            self._freeze_fallbacks()
            evicting = self.row_state["frozen"] & (self.cols.counts > fmt.budget)
        else:
            evicting = self.cols.counts > fmt.budget
        counts = self.cols.counts
        for R in np.unique(counts[evicting]):  # one policy call per distinct row length
            self._evict_rows(np.nonzero(evicting & (counts == R))[0], int(R))

    def _freeze_fallbacks(self):
        """Rows whose key-SVD fallback freezes now: estimate from their first calib_tokens
        keys (nothing evicted yet, so those are positions 0..calib-1), score every row."""
        fmt, st = self.fmt, self.row_state
        due = ~st["frozen"] & (self.offsets >= fmt.calib_tokens)
        if not due.any():
            return
        rows = np.nonzero(due)[0]
        rows_mx = mx.array(rows.astype(np.int32))
        sel = mx.take(self.keys[0], rows_mx, axis=0)
        first = mx.array(self.cols.s[rows].astype(np.int32))[:, None] + mx.arange(fmt.calib_tokens)
        calib = mx.take_along_axis(sel, first[:, None, :, None], axis=2)
        filt = key_svd_filter(calib)
        scores = projection_scores(sel[..., : self.cols.idx, :], filt, fmt.sign)
        full = self.keys[2]
        full[rows_mx, :, : self.cols.idx, :] = scores[..., None]
        st["filter"][rows_mx] = filt
        st["frozen"] = st["frozen"] | due

    def _evict_rows(self, rows: np.ndarray, R: int):
        """The serial policy on ``rows`` (all holding R positions, ending at ``idx``)."""
        fmt, idx = self.fmt, self.cols.idx
        rows_mx = mx.array(rows.astype(np.int32))
        part = lambda a: mx.take(a, rows_mx, axis=0)[..., idx - R : idx, :]
        k, pos = part(self.keys[0]), part(self.keys[1])[..., 0]
        v = part(self.values[0])
        if fmt.policy == "tova":
            k, v, pos = tova_evict(k, v, pos, fmt.budget, fmt.n_sink)
            kept_keys = (k, pos[..., None])
        else:
            scores = part(self.keys[2])[..., 0]
            keep = qfilters_survivors(scores, fmt.budget, fmt.n_sink, fmt.recent)
            take = lambda a: mx.take_along_axis(a, keep[..., None], axis=2)
            kept_keys = (take(k), take(pos[..., None]), take(scores[..., None]))
            v = take(v)
        lo = idx - fmt.budget
        for a, kept in zip(self.keys + self.values, kept_keys + (v,)):
            a[rows_mx, :, lo:idx, :] = kept
        s = self.cols.s.copy()
        s[rows] = lo
        self.cols = Columns(s, s.copy(), s.copy(), idx)


def merge_eviction_rows(fmt: EvictionRows, rows) -> BatchedEvictionCache:
    batch = merge_attention_rows(fmt, rows, cls=BatchedEvictionCache)
    if fmt.policy == "qfilters":
        shapes = [r.filter.shape[1:] for r in rows if r.filter is not None]
        shapes += [(r.keys.shape[1], r.keys.shape[3]) for r in rows if r.keys is not None]
        if shapes:
            zeros = mx.zeros((1, *shapes[0]), mx.float32)
            batch.row_state["filter"] = mx.concatenate(
                [zeros if r.filter is None else mx.broadcast_to(r.filter, zeros.shape) for r in rows], axis=0
            )
        else:
            batch.row_state["filter"] = None
    return batch
