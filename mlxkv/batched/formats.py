"""Row formats of the linear, ring and TurboQuant attention families, for ``BatchedKVCache``.

A row format reads a serial cache's stored positions in temporal order (``read`` -> keys,
values, count, per-row extras) and builds a serial cache back (``restore``); its storage
says how positions are encoded. Its fields are the batch's geometry, so two batches join
only when their formats are equal. Each family's record names its format function
(``plain_rows``, ``affine_rows``, ...).
"""

from dataclasses import dataclass

import mlx.core as mx

from ..caches.plain import KVCache
from ..caches.quantized import QuantizedKVCache
from ..caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from ..caches.turboquant import TurboQuantKVCache
from .row_format import RowFormat
from .storages import AffineStorage, PlainStorage, TurboStorage


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@dataclass(frozen=True)
class LinearRows(RowFormat):
    """``kv:plain`` and ``kv:quant:<bits>:<group>``: positions ``[0, offset)``, stored as is."""

    storage: object

    def empty(self):
        s = self.storage
        return QuantizedKVCache(group_size=s.group_size, bits=s.bits) if s.affine else KVCache()

    def read(self, row):
        n = row.offset
        if row.keys is None or n == 0:
            return None, None, 0, {}
        cut = lambda t: tuple(a[..., :n, :] for a in _tuple(t))
        return cut(row.keys), cut(row.values), n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        row = self.empty()
        if keys is None:
            return row
        return row.adopt(keys, values, offset) if self.storage.affine else row.adopt(keys[0], values[0], offset)


@dataclass(frozen=True)
class RingRows(RowFormat):
    """``kv:rotating-plain`` and ``kv:rotating-quant:<bits>:<group>``: the positions the
    ring attends next in temporal order (``keep`` sinks first, then its most recent, at most
    ``max_size`` of them), restored position-exact.

    A ring holds up to ``max_size - 1 + S`` positions after an S-token append; the positions
    beyond ``max_size`` are evicted before its next append reads anything, so a row leaves
    them out (mlx-lm's ``BatchRotatingKVCache.merge`` takes the same ``size()`` positions)."""

    storage: object
    max_size: int = 0
    keep: int = 0

    def empty(self):
        s = self.storage
        if s.affine:
            return RotatingQuantizedKVCache(self.max_size, self.keep, group_size=s.group_size, bits=s.bits)
        return RotatingKVCache(self.max_size, self.keep)

    def read(self, row):
        if row.keys is None or row.offset == 0:
            return None, None, 0, {}
        k, v = _tuple(row._temporal_order(row.keys)), _tuple(row._temporal_order(row.values))
        n = k[0].shape[2]
        if n > self.max_size:
            recent = self.max_size - self.keep
            cut = lambda t: tuple(mx.concatenate([a[..., : self.keep, :], a[..., n - recent :, :]], axis=2) for a in t)
            k, v, n = cut(k), cut(v), self.max_size
        return k, v, n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        row = self.empty()
        if keys is None:
            return row
        if self.storage.affine:
            return row.adopt(keys, values, offset, count)
        return row.adopt(keys[0], values[0], offset, count)


@dataclass(frozen=True)
class TurboRows(RowFormat):
    """``kv:turboquant:<kBits>:<vBits>``: the five code arrays sliced to offset, copied as
    stored (never decoded and re-encoded)."""

    storage: TurboStorage
    deferred: bool = True

    def empty(self):
        s = self.storage
        return TurboQuantKVCache(s.k_bits, s.v_bits, self.deferred, codes=s.codes)

    def dtype_of(self, row):
        return row.dtype if row.storage is not None else None

    def read(self, row):
        n = row.offset
        if row.storage is None or n == 0:
            return None, None, 0, {}
        live = [a[..., :n, :] for a in row.storage]
        return tuple(live[:3]), tuple(live[3:]), n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        row = self.empty()
        if dtype is not None:
            row.dtype = dtype
        return row if keys is None else row.adopt(*keys, *values, offset=offset)


def plain_rows(row) -> LinearRows:
    return LinearRows(PlainStorage())


def affine_rows(row) -> LinearRows:
    return LinearRows(AffineStorage(row.bits, row.group_size))


def ring_rows(row) -> RingRows:
    return RingRows(PlainStorage(), row.max_size, row.keep)


def affine_ring_rows(row) -> RingRows:
    return RingRows(AffineStorage(row.bits, row.group_size), row.max_size, row.keep)


def turbo_rows(row) -> TurboRows:
    return TurboRows(TurboStorage(row.k_bits, row.v_bits, row.codes), row.deferred)
