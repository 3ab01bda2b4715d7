"""The rows of a bf16-first batch that have not converted yet (``kv4-start256``,
``turbo-k8v3-start256``, ``turbo-k8v3``).

A bf16-first batch is the target's layout (affine or TurboQuant rows, ``BatchedKVCache``)
in which every row, converted or not, stores every position in the target's encoding: an
append encodes each position on its own, so the encoding a row accumulates is byte for byte
what its conversion would produce from its bf16 window. The rows still short of their start
also keep their positions in the model's dtype here, in the batch's own columns, and attend
those: a row attends bf16 until an append leaves it holding ``start`` positions and its
target encoding from the next append on, exactly as the serial ``Bf16FirstCache``. A row
converts by leaving this side store (``PendingConversion.due`` decides, per row, at the end
of each append). When no row is left, the batch is the target's batch and costs nothing more.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..caches.plain import KVCache
from .columns import Columns, gather_columns, source_columns, stack_left_padded


@dataclass(eq=False)
class Bf16Rows:
    """Batch rows ``rows`` (ascending) in the model's dtype: ``keys``/``values`` are
    ``[len(rows), H, capacity, D]`` over the batch's columns (None until something is stored)."""

    rows: np.ndarray
    keys: mx.array | None = None
    values: mx.array | None = None

    @classmethod
    def merge(cls, rows: np.ndarray, plains, counts: np.ndarray, end: int, width: int) -> "Bf16Rows":
        """From serial plain caches (one per entry of ``rows``) holding ``counts`` positions,
        right-aligned at column ``end`` of ``width`` columns, as the batch places them."""
        rows = np.asarray(rows, dtype=np.int64)
        full = [p for p, c in zip(plains, counts) if c > 0]
        if not full:
            return cls(rows)
        part = lambda p, c, name: (getattr(p if c > 0 else full[0], name)[..., :c, :],)
        (keys,) = stack_left_padded([part(p, c, "keys") for p, c in zip(plains, counts)], counts, width, end=end)
        (values,) = stack_left_padded([part(p, c, "values") for p, c in zip(plains, counts)], counts, width, end=end)
        return cls(rows, keys, values)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _pick(self, x: mx.array) -> mx.array:
        return mx.take(x, mx.array(self.rows.astype(np.int32)), axis=0)

    # -- appends --------------------------------------------------------------------------
    def write(self, keys: mx.array, values: mx.array, at: int, capacity: int):
        """Store the new positions of these rows at columns ``[at, at + N)``."""
        k, v = self._pick(keys), self._pick(values)
        if self.keys is None:
            shape = lambda x: (len(self.rows), x.shape[1], capacity, x.shape[3])
            self.keys, self.values = mx.zeros(shape(k), k.dtype), mx.zeros(shape(v), v.dtype)
        N = k.shape[2]
        self.keys[..., at : at + N, :] = k
        self.values[..., at : at + N, :] = v

    def regathered(self, cols: Columns, end: int, width: int, counts=None) -> "Bf16Rows":
        """These rows repacked as the batch repacks: right-aligned at column ``end`` of
        ``width`` columns from ``cols`` (each row's first ``counts[row]`` positions when given)."""
        if self.keys is None:
            return self
        own = np.arange(len(self.rows))
        kept = None if counts is None else np.asarray(counts)[self.rows]
        src, valid = source_columns(cols, self.rows, width, kept, end)
        keys, values = (gather_columns((a,), own, src, valid)[0] for a in (self.keys, self.values))
        return Bf16Rows(self.rows, keys, values)

    def window(self, lo: int, idx: int):
        return self.keys[..., lo:idx, :], self.values[..., lo:idx, :]

    def overlay(self, keys: mx.array, values: mx.array, lo: int, idx: int):
        """Dense batch windows with these rows' bf16 positions in place of their target
        encoding (each row attends its own precision)."""
        if self.keys is None:
            return keys, values
        k, v = self.window(lo, idx)
        sel = mx.array(self.rows.astype(np.int32))
        keys[sel] = k.astype(keys.dtype)
        values[sel] = v.astype(values.dtype)
        return keys, values

    # -- row surgery ------------------------------------------------------------------------
    def taken(self, keep: np.ndarray, shift: int) -> "Bf16Rows | None":
        """The side store after the batch keeps rows ``keep`` and drops its first ``shift``
        columns (None when no survivor is bf16)."""
        where = {int(r): j for j, r in enumerate(self.rows)}
        new_rows = np.array([j for j, r in enumerate(keep) if int(r) in where], dtype=np.int64)
        if not len(new_rows):
            return None
        out = Bf16Rows(new_rows)
        if self.keys is not None:
            own = mx.array(np.array([where[int(keep[j])] for j in new_rows], dtype=np.int32))
            out.keys = mx.take(self.keys, own, axis=0)[..., shift:, :]
            out.values = mx.take(self.values, own, axis=0)[..., shift:, :]
        return out

    def without(self, leaving: np.ndarray) -> "Bf16Rows | None":
        """The side store once ``leaving`` (batch row indices) have converted."""
        stay = ~np.isin(self.rows, leaving)
        if not stay.any():
            return None
        out = Bf16Rows(self.rows[stay])
        if self.keys is not None:
            sel = mx.array(np.nonzero(stay)[0].astype(np.int32))
            out.keys, out.values = mx.take(self.keys, sel, axis=0), mx.take(self.values, sel, axis=0)
        return out

    def widened(self, left: int, idx: int, slack: int) -> tuple[mx.array, mx.array] | None:
        """Arrays cut to ``idx`` columns, left-padded by ``left`` and right-padded by ``slack``
        (a batch joining another)."""
        if self.keys is None:
            return None
        pad = lambda a: mx.pad(a[..., :idx, :], [(0, 0), (0, 0), (left, slack), (0, 0)])
        return pad(self.keys), pad(self.values)

    def extract(self, i: int, count: int, idx: int, offset: int) -> KVCache:
        """Batch row ``i`` (one of ``rows``) as an owned plain cache of its ``count`` positions."""
        j = int(np.nonzero(self.rows == i)[0][0])
        row = KVCache()
        if self.keys is None or count == 0:
            return row
        cut = lambda a: mx.contiguous(a[j : j + 1, :, idx - count : idx, :])
        return row.adopt(cut(self.keys), cut(self.values), offset)
