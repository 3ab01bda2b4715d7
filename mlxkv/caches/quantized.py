"""``QuantizedKVCache`` (``kv:quant:<bits>:<group>``): mlx-lm's affine layout.

It really is mlx-lm's layout, so it exposes ``bits`` and ``group_size`` and mlx-lm takes its
quantized SDPA for it.
"""

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..math.affine import check_affine
from . import names
from .base import CacheContract, row_bytes


class QuantizedKVCache(CacheContract, mlx_cache.QuantizedKVCache):
    kind_prefix = names.AFFINE_KIND_PREFIX

    def __init__(self, group_size: int = 64, bits: int = 8):
        check_affine(bits, group_size)
        super().__init__(group_size=group_size, bits=bits)

    @property
    def kind(self) -> str:
        return f"{self.kind_prefix}{self.bits}:{self.group_size}"

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        return self.masks.causal(N, self.offset, window_size, return_array)

    @property
    def nbytes(self) -> int:
        """0 while empty (mlx-lm's own sums the triples it does not have yet, and its server
        and batch engine sum ``nbytes`` over the caches of queued requests)."""
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))

    def bytes_per_token(self) -> int:
        return 0 if self.keys is None else row_bytes(*self.keys, *self.values)

    def dense_window(self):
        if self.keys is None or self.offset == 0:
            return None
        k, v = self.keys_and_values()
        deq = lambda t: mx.dequantize(*t, group_size=self.group_size, bits=self.bits)
        return deq(k), deq(v)

    @classmethod
    def from_cache(cls, source, group_size: int = 64, bits: int = 8) -> "QuantizedKVCache":
        """Quantize a plain cache's live window once; ``offset`` and
        ``minimum_reusable_offset`` carry over and the source is consumed."""
        out = cls(group_size=group_size, bits=bits)
        out.masks = source.masks
        out.offset = source.offset
        out.minimum_reusable_offset = source.minimum_reusable_offset
        if source.keys is not None and source.offset > 0:
            k, v = source.keys[..., : source.offset, :], source.values[..., : source.offset, :]
            out.keys = mx.quantize(k, group_size=group_size, bits=bits)
            out.values = mx.quantize(v, group_size=group_size, bits=bits)
        source.keys = source.values = None
        source.offset = 0
        return out

    def adopt(self, keys: tuple, values: tuple, offset: int):
        self.keys, self.values, self.offset = tuple(keys), tuple(values), offset
        return self
