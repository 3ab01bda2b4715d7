"""``kv:batched-qfilters:<budget>:<nSink>:<recent>``: batched rows of Q-Filters caches.

Each row keeps its own filter (calibrated, a frozen key-SVD fallback, or none yet) as
per-row state (``row_state``: ``filter`` float32 [B, H, D], ``frozen`` and ``calibrated``
bools); scores ride with the keys as a third stored array. The freeze and thaw rules are
the serial cache's (``mlxkv.math.qfilters``), applied to every row at once.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..caches.qfilters import QFiltersKVCache
from ..math.qfilters import freeze_due, key_svd_filter, projection_scores, qfilters_survivors, thaw_due
from .attention import merge_attention_rows
from .eviction import BatchedEvictionCache, EvictionRows


@dataclass(frozen=True)
class QFiltersRows(EvictionRows):
    recent: int = 0
    sign: int = 1
    calib_tokens: int = 0

    scored = True

    def empty(self, filters=None):
        """An empty serial cache (with ``filters``: calibrated ones)."""
        return QFiltersKVCache(self.budget, self.n_sink, self.recent, self.sign, self.calib_tokens, filters=filters)

    @staticmethod
    def batch_class():
        return BatchedQFiltersCache

    def read(self, row):
        extras = {"frozen": row.filter is not None, "calibrated": bool(row.calibrated)}
        if row.keys is None:
            return None, None, 0, extras
        keys = (row.keys, row.positions[..., None], row.scores[..., None])
        return keys, (row.values,), row.keys.shape[2], extras

    def restore(self, keys, values, offset, count, dtype, extras):
        calibrated, frozen = bool(extras["calibrated"][0]), bool(extras["frozen"][0])
        filt = extras["filter"] if frozen else None
        row = self.empty(filt if calibrated else None)
        if keys is None:
            return row
        return row.adopt(
            keys[0], values[0], keys[1][..., 0], keys[2][..., 0], offset, filter=filt, calibrated=calibrated
        )

    def merge(self, rows):
        batch = merge_attention_rows(self, rows, cls=BatchedQFiltersCache)
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


def qfilters_rows(row) -> QFiltersRows:
    return QFiltersRows(row.budget, row.n_sink, row.recent, row.sign, row.calib_tokens)


class BatchedQFiltersCache(BatchedEvictionCache):
    def _after_trim(self, counts):
        st = self.row_state
        thaw = thaw_due(st["frozen"], st["calibrated"], self.offsets, self.fmt.calib_tokens) & (counts > 0)
        if thaw.any():
            st["frozen"] = st["frozen"] & ~thaw
            t = mx.array(thaw)
            st["filter"] = mx.where(t[:, None, None], 0.0, st["filter"])
            self.key_arrays = self.key_arrays[:2] + (mx.where(t[:, None, None, None], 0.0, self.key_arrays[2]),)

    def extend_rows(self, other):
        self._compatible(other)
        sides = (self, other)  # a side that never saw a key has no filter shape yet
        like = next((c.row_state["filter"] for c in sides if c.row_state.get("filter") is not None), None)
        for c in sides:
            if like is not None and c.row_state.get("filter") is None:
                c.row_state["filter"] = mx.zeros((c.batch_size, *like.shape[1:]), mx.float32)
        return super().extend_rows(other)

    def _encode(self, keys, values):
        (k, pos), v = super()._encode(keys, values)
        if self.row_state.get("filter") is None:
            B, H, _, D = keys.shape
            self.row_state["filter"] = mx.zeros((B, H, D), mx.float32)
        frozen = mx.array(self.row_state["frozen"])[:, None, None]
        scores = projection_scores(keys, self.row_state["filter"], self.fmt.sign)
        return (k, pos, mx.where(frozen, scores, 0.0)[..., None]), v

    def _evicting(self):
        self._freeze_fallbacks()
        return self.row_state["frozen"] & (self.cols.counts > self.fmt.budget)

    def _freeze_fallbacks(self):
        """Rows whose key-SVD fallback freezes now: estimate from their first calib_tokens
        keys (nothing evicted yet, so those are positions 0..calib-1), score every row."""
        fmt, st = self.fmt, self.row_state
        due = freeze_due(st["frozen"], self.offsets, fmt.calib_tokens)
        if not due.any():
            return
        rows = np.nonzero(due)[0]
        rows_mx = mx.array(rows.astype(np.int32))
        sel = mx.take(self.key_arrays[0], rows_mx, axis=0)
        first = mx.array(self.cols.s[rows].astype(np.int32))[:, None] + mx.arange(fmt.calib_tokens)
        calib = mx.take_along_axis(sel, first[:, None, :, None], axis=2)
        filt = key_svd_filter(calib)
        scores = projection_scores(sel[..., : self.cols.idx, :], filt, fmt.sign)
        full = self.key_arrays[2]
        full[rows_mx, :, : self.cols.idx, :] = scores[..., None]
        st["filter"][rows_mx] = filt
        st["frozen"] = st["frozen"] | due

    def _kept(self, rows, R):
        (k, pos, scores), (v,) = self._stored(rows, R)
        keep = qfilters_survivors(scores[..., 0], self.fmt.budget, self.fmt.n_sink, self.fmt.recent)
        take = lambda a: mx.take_along_axis(a, keep[..., None], axis=2)
        return (take(k), take(pos), take(scores)), (take(v),)
