"""Storages: how a batched layout encodes positions, what it hands mlx-lm to attend and how it
decodes them for block reads; their fill values pad rows.

- ``encode_keys``/``encode_values``: new positions ``[B, H, N, D]`` -> the stored tuple;
- ``fetch``: the stored key and value tuples -> the (keys, values) ``update_and_fetch``
  returns: the arrays for plain rows; for affine rows the triples and for TurboQuant rows
  their codes (``codes``; decoded with ``codes=False``), which mlx-lm hands to its quantized
  SDPA: ``quantized_window`` says so, and such a storage names its ``bits`` and
  ``group_size``;
- ``decode_keys``/``decode_values``: the stored tuple -> dense arrays;
- ``shown``/``replaced``: the stored tuple as mlx-lm shows a cache's ``keys``/``values``
  (one array, or a tuple where mlx-lm's own cache holds one), and the tuple with that
  replaced.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..caches import codes_window
from ..math import bitpack
from ..math import turboquant as tq


class ShowsFirstArray:
    """Storages whose ``keys``/``values`` show the first stored array (the keys or values
    themselves; positions and scores ride behind them)."""

    def shown(self, t):
        return t[0]

    def replaced(self, t, shown):
        return None if shown is None else (shown, *(t or ())[1:])


class ShowsTuple:
    """Storages whose ``keys``/``values`` show the whole stored tuple."""

    def shown(self, t):
        return t

    def replaced(self, t, shown):
        return None if shown is None else tuple(shown)


@dataclass(frozen=True)
class PlainStorage(ShowsFirstArray):
    affine = False
    quantized_window = False
    key_fills = value_fills = (0,)

    def encode_keys(self, x):
        return (x,)

    encode_values = encode_keys

    def fetch(self, keys, values, dtype=None):
        return keys[0], values[0]

    def decode_keys(self, t, dtype=None):
        return t[0]

    decode_values = decode_keys

    def head_dim(self, keys) -> int:
        return keys[0].shape[3]


@dataclass(frozen=True)
class AffineStorage(ShowsTuple):
    """mlx-lm's affine triples (packed, scales, biases), quantized per token."""

    bits: int
    group_size: int
    affine = True
    quantized_window = True
    key_fills = value_fills = (0, 0, 0)

    def encode_keys(self, x):
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    encode_values = encode_keys

    def fetch(self, keys, values, dtype=None):
        return keys, values

    def decode_keys(self, t, dtype=None):
        return mx.dequantize(*t, group_size=self.group_size, bits=self.bits)

    decode_values = decode_keys

    def head_dim(self, keys) -> int:
        return keys[0].shape[3] * 32 // self.bits


@dataclass(frozen=True)
class TurboStorage(ShowsTuple, codes_window.CodesReader):
    """TurboQuant's five arrays: keys (kIdx, kScales, kZeros), values (vPacked, vScales).
    mlx-lm attends the codes (``codes``) or the eager decode; all-zero padding codes decode
    to zeros (and are masked either way)."""

    k_bits: int
    v_bits: int
    codes: bool = True
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

    def fetch(self, keys, values, dtype=mx.bfloat16):
        if self.codes:
            return codes_window.window((*keys, *values), self.k_bits, self.v_bits)
        return self.decode_keys(keys, dtype), self.decode_values(values, dtype)

    def head_dim(self, keys) -> int:
        return keys[1].shape[3] * tq.GROUP


@dataclass(frozen=True)
class EvictionStorage(ShowsFirstArray):
    """Eviction rows: keys (keys, positions[..., None][, scores[..., None]]), values
    (values,). Padding positions are -1; mlx-lm attends the keys and values as stored."""

    scored: bool
    affine = False
    quantized_window = False
    value_fills = (0,)

    @property
    def key_fills(self):
        return (0, -1, 0) if self.scored else (0, -1)

    def encode_keys(self, x):  # the batch encodes: positions depend on each row's offset
        raise NotImplementedError

    encode_values = encode_keys

    def fetch(self, keys, values, dtype=None):
        return keys[0], values[0]

    def decode_keys(self, t, dtype=None):
        return t[0]

    decode_values = decode_keys

    def head_dim(self, keys) -> int:
        return keys[0].shape[3]
