"""Row formats: how one serial attention kind stores its positions, for ``BatchedKVCache``.

A storage encodes positions (``encode_keys``), hands mlx-lm what it attends
(``fetch_keys``: the arrays for plain, the affine triple for affine so mlx-lm takes its
quantized SDPA, decoded keys for TurboQuant) and decodes for named block reads; its fill
values pad rows. A row format reads a serial cache's stored positions in temporal order
(``read`` -> keys, values, count, per-row extras) and builds a serial cache back
(``restore``); its fields are the batch's geometry, so two batches join only when their
formats are equal.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..math import bitpack
from ..math import turboquant as tq
from ..caches.plain import KVCache
from ..caches.quantized import QuantizedKVCache
from ..caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from ..caches.turboquant import TurboQuantKVCache


@dataclass(frozen=True)
class PlainStorage:
    affine = False
    key_fills = value_fills = (0,)

    def encode_keys(self, x):
        return (x,)

    encode_values = encode_keys

    def fetch_keys(self, t, dtype=None):
        return t[0]

    fetch_values = decode_keys = decode_values = fetch_keys


@dataclass(frozen=True)
class AffineStorage:
    """mlx-lm's affine triples (packed, scales, biases), quantized per token."""

    bits: int
    group_size: int
    affine = True
    key_fills = value_fills = (0, 0, 0)

    def encode_keys(self, x):
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    encode_values = encode_keys

    def fetch_keys(self, t, dtype=None):
        return t

    fetch_values = fetch_keys

    def decode_keys(self, t, dtype=None):
        return mx.dequantize(*t, group_size=self.group_size, bits=self.bits)

    decode_values = decode_keys


@dataclass(frozen=True)
class TurboStorage:
    """TurboQuant's five arrays: keys (kIdx, kScales, kZeros), values (vPacked, vScales).
    mlx-lm attends the eager decode; all-zero padding codes decode to zeros."""

    k_bits: int
    v_bits: int
    affine = False
    key_fills = (0, 0, 0)
    value_fills = (0, 0)

    def encode_keys(self, x):
        idx, scales, zeros = tq.encode_keys(x, self.k_bits)
        return tq.pack_keys(idx, self.k_bits), scales, zeros

    def encode_values(self, x):
        idx, scales = tq.encode_values(x, self.v_bits)
        return bitpack.pack(idx, self.v_bits), scales

    def decode_keys(self, t, dtype=mx.bfloat16):
        k_idx, scales, zeros = t
        d = scales.shape[-1] * tq.GROUP
        return tq.decode_keys(tq.unpack_keys(k_idx, self.k_bits, d), scales, zeros).astype(dtype)

    def decode_values(self, t, dtype=mx.bfloat16):
        packed, scales = t
        d = scales.shape[-1] * tq.GROUP
        return tq.decode_values(bitpack.unpack(packed, self.v_bits, d), scales, self.v_bits).astype(dtype)

    fetch_keys, fetch_values = decode_keys, decode_values


@dataclass(frozen=True)
class EvictionStorage:
    """Eviction rows: keys (keys, positions[..., None][, scores[..., None]]), values
    (values,). Padding positions are -1; mlx-lm attends the keys and values as stored."""

    scored: bool
    affine = False
    value_fills = (0,)

    @property
    def key_fills(self):
        return (0, -1, 0) if self.scored else (0, -1)

    def encode_keys(self, x):  # the batch encodes: positions depend on each row's offset
        raise NotImplementedError

    encode_values = encode_keys

    def fetch_keys(self, t, dtype=None):
        return t[0]

    fetch_values = decode_keys = decode_values = fetch_keys


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class _Format:
    max_size: Optional[int] = None
    keep: int = 0

    @property
    def batched_kind(self) -> str:
        """A row layout's own kind: ``kv:batched-`` plus the serial kind's tail."""
        return self.serial_kind.replace("kv:", "kv:batched-", 1)

    def dtype_of(self, row):
        return None


@dataclass(frozen=True)
class LinearRows(_Format):
    """``kv:plain`` and ``kv:quant:<bits>:<group>``: positions ``[0, offset)``, stored as is."""

    storage: object

    @property
    def serial_kind(self) -> str:
        s = self.storage
        return f"kv:quant:{s.bits}:{s.group_size}" if s.affine else "kv:plain"

    def read(self, row):
        n = row.offset
        if row.keys is None or n == 0:
            return None, None, 0, {}
        cut = lambda t: tuple(a[..., :n, :] for a in _tuple(t))
        return cut(row.keys), cut(row.values), n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        s = self.storage
        if s.affine:
            row = QuantizedKVCache(group_size=s.group_size, bits=s.bits)
            return row if keys is None else row.adopt(keys, values, offset)
        row = KVCache()
        return row if keys is None else row.adopt(keys[0], values[0], offset)


@dataclass(frozen=True)
class RingRows(_Format):
    """``kv:rotating-plain`` and ``kv:rotating-quant:<bits>:<group>``: the ring's stored
    positions in temporal order (``keep`` sinks first), restored position-exact."""

    storage: object
    max_size: int = 0
    keep: int = 0

    @property
    def serial_kind(self) -> str:
        s = self.storage
        return f"kv:rotating-quant:{s.bits}:{s.group_size}" if s.affine else "kv:rotating-plain"

    def read(self, row):
        if row.keys is None or row.offset == 0:
            return None, None, 0, {}
        k, v = _tuple(row._temporal_order(row.keys)), _tuple(row._temporal_order(row.values))
        return k, v, k[0].shape[2], {}

    def restore(self, keys, values, offset, count, dtype, extras):
        s = self.storage
        if s.affine:
            row = RotatingQuantizedKVCache(self.max_size, self.keep, group_size=s.group_size, bits=s.bits)
            return row if keys is None else row.adopt(keys, values, offset, count)
        row = RotatingKVCache(self.max_size, self.keep)
        return row if keys is None else row.adopt(keys[0], values[0], offset, count)


@dataclass(frozen=True)
class TurboRows(_Format):
    """``kv:turboquant:<kBits>:<vBits>``: the five code arrays sliced to offset, copied as
    stored (never decoded and re-encoded)."""

    storage: TurboStorage
    deferred: bool = False

    @property
    def serial_kind(self) -> str:
        return f"kv:turboquant:{self.storage.k_bits}:{self.storage.v_bits}"

    def dtype_of(self, row):
        return row.dtype if row.storage is not None else None

    def read(self, row):
        n = row.offset
        if row.storage is None or n == 0:
            return None, None, 0, {}
        live = [a[..., :n, :] for a in row.storage]
        return tuple(live[:3]), tuple(live[3:]), n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        s = self.storage
        row = TurboQuantKVCache(s.k_bits, s.v_bits, self.deferred)
        if dtype is not None:
            row.dtype = dtype
        return row if keys is None else row.adopt(*keys, *values, offset=offset)


def linear_format(row) -> LinearRows:
    if row.kind == "kv:plain":
        return LinearRows(PlainStorage())
    return LinearRows(AffineStorage(row.bits, row.group_size))


def ring_format(row) -> RingRows:
    storage = AffineStorage(row.bits, row.group_size) if row.kind.startswith("kv:rotating-quant:") else PlainStorage()
    return RingRows(storage, row.max_size, row.keep)


def turbo_format(row) -> TurboRows:
    return TurboRows(TurboStorage(row.k_bits, row.v_bits), row.deferred)
