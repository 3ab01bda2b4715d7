"""``BatchedArraysCache`` (``kv:batched-ssm``): rows of recurrent state (``ssm``).

Recurrent state has no token axis: a row is its state arrays, so rows are stacked on the
batch axis and need no padding. ``offset`` is the per-row count of tokens the state has
absorbed.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from ..caches.arrays import ArraysCache
from ..caches.base import CacheContract
from ..errors import CacheConfigError
from ..families import batched_kind
from .columns import RowOffsets, check_row


class BatchedArraysCache(RowOffsets, CacheContract, mlx_cache.ArraysCache):
    kind = batched_kind(ArraysCache.kind)

    def __init__(self, arrays, offsets, min_reuse=None, masks=None):
        super().__init__(len(arrays))
        self.cache = list(arrays)
        self._init_rows(offsets, min_reuse)
        self._remaining = None
        if masks is not None:
            self.masks = masks

    def prepare(self, *, lengths=None, right_padding=None, left_padding=None, **_):
        """mlx-lm's right-padded prefill: the model reads ``lengths`` to stop each row's state
        at its own last token; the offsets advance by each row's own tokens only."""
        if right_padding is not None and max(right_padding, default=0) > 0:
            super().prepare(lengths=lengths)
            self._remaining = np.asarray(lengths, dtype=np.int64).reshape(-1)

    def finalize(self):
        super().finalize()
        self._remaining = None

    def advance(self, N: int):
        super().advance(N)
        real = np.full(self.batch_size, N, dtype=np.int64)
        if getattr(self, "_remaining", None) is not None:
            real = np.minimum(self._remaining, real)
            self._remaining = self._remaining - real
        self._set_offsets(self.offsets + real)

    def make_mask(self, N: int, **_):
        if self.left_padding is None and self.lengths is None:
            return self.masks.get(("batched-ssm", N), lambda: None)
        return super().make_mask(N)

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0

    def bytes_per_token(self) -> int:
        return 0

    def projected_bytes(self, rows=(), tokens: int = 0) -> int:
        """Recurrent state does not grow with tokens: each joining row adds one row of state."""
        B = self.batch_size
        return self.nbytes if B == 0 else self.nbytes + len(rows) * self.nbytes // B

    def trim_rows(self, counts) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if counts.any():
            raise CacheConfigError(f"{self.kind}: recurrent state cannot be trimmed; nothing was trimmed")
        return counts

    def dense_window(self):
        return None

    # -- row surgery ----------------------------------------------------------------------
    def extend_rows(self, other: "BatchedArraysCache"):
        """Join ``other``'s rows: a batch of the same state arrays, or one serial row (mlx-lm's
        ``ArraysCache`` is its own batch, so mlx-lm's code extends a batch with one)."""
        if isinstance(other, ArraysCache):
            other = merge_arrays_rows([other])
        if not isinstance(other, BatchedArraysCache) or len(other.cache) != len(self.cache):
            raise CacheConfigError(
                f"cannot join {getattr(other, 'kind', type(other).__name__)} rows into a "
                f"{self.kind} batch of {len(self.cache)} state arrays"
            )
        mlx_cache.ArraysCache.extend(self, other)
        self._set_offsets(np.concatenate([self.offsets, other.offsets]))
        self.row_minimum_reusable_offsets = np.concatenate(
            [self.row_minimum_reusable_offsets, other.row_minimum_reusable_offsets]
        )
        return self

    def filter_rows(self, keep):
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        for i in keep:
            check_row(int(i), self.batch_size)
        mlx_cache.ArraysCache.filter(self, mx.array(keep.astype(np.int32)))
        self._set_offsets(self.offsets[keep])
        self.row_minimum_reusable_offsets = self.row_minimum_reusable_offsets[keep]
        return self

    def extract_row(self, i: int) -> ArraysCache:
        i = check_row(i, self.batch_size)
        pick = mx.array([i])
        arrays = [None if a is None else mx.take(a, pick, axis=0) for a in self.cache]
        row = ArraysCache(len(arrays)).adopt(arrays, int(self.offsets[i]))
        row.masks = self.masks
        row.minimum_reusable_offset = int(self.row_minimum_reusable_offsets[i])
        return row

    # mlx-lm's names for the same surgery (its BatchGenerator calls these)
    extend, filter, extract = extend_rows, filter_rows, extract_row


@dataclass(frozen=True)
class ArraysRows:
    """The row format of ``ssm`` state: rows of one batch hold the same number of arrays."""

    size: int

    def merge(self, rows) -> BatchedArraysCache:
        """Stack the rows' state arrays; a row without a state array gets zeros there."""
        return merge_arrays_rows(rows)


def arrays_rows(row) -> ArraysRows:
    return ArraysRows(len(row.cache))


def merge_arrays_rows(rows) -> BatchedArraysCache:
    """The batch of ``rows``. Rows that all hold no state yet get mlx-lm's ``left_padding`` of
    zeros (its ``ArraysCache.merge`` does the same): ``make_mask`` then gives mlx-lm's all-True
    ``[B, N]`` mask until ``finalize``, ``extend`` carries it into the joined batch, and a
    batch with state gets it once such rows join it."""
    arrays = []
    for entry in zip(*(r.cache for r in rows)):
        ref = next((a for a in entry if a is not None), None)
        if ref is None:
            arrays.append(None)
            continue
        zero = mx.zeros((1, *ref.shape[1:]), ref.dtype)
        arrays.append(mx.concatenate([zero if a is None else a for a in entry], axis=0))
    offsets = [int(r.offset) for r in rows]
    min_reuse = [int(getattr(r, "minimum_reusable_offset", 0)) for r in rows]
    batch = BatchedArraysCache(arrays, offsets, min_reuse, rows[0].masks)
    if all(a is None for a in arrays):
        batch.left_padding = mx.zeros((len(rows),), mx.int32)
    return batch
