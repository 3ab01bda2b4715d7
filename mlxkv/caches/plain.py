"""``KVCache`` (``kv:plain``): mlx-lm's growing bf16 cache with mlxkv's contract."""

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..families import Scheme
from . import names
from .base import CacheContract, row_bytes
from .rotating import RotatingKVCache


class KVCache(CacheContract, mlx_cache.KVCache):
    kind = names.PLAIN_KIND

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        return self.masks.causal(N, self.offset, window_size, return_array)

    def bytes_per_token(self) -> int:
        return row_bytes(self.keys, self.values)

    def dense_window(self):
        return None if self.keys is None or self.offset == 0 else self.keys_and_values()

    @classmethod
    def capacity_for(cls, offset: int) -> int:
        """Rows a restored cache holds: offset plus slack up to the next step boundary, so
        the next append writes in place."""
        return (offset // cls.step + 1) * cls.step

    def adopt(self, keys: mx.array, values: mx.array, offset: int, slack: bool = True):
        """Take ``keys``/``values`` whose first ``offset`` rows are the cache; with ``slack``,
        rows short of ``capacity_for(offset)`` are added as zero slack (a copy); without it
        the arrays are held as given and the first append that needs room grows them."""
        B, H, T, _ = keys.shape
        pad = self.capacity_for(offset) - T if slack else 0

        def grow(a):
            if pad <= 0:
                return a
            return mx.concatenate([a, mx.zeros((B, H, pad, a.shape[3]), a.dtype)], axis=2)

        self.keys, self.values, self.offset = grow(keys), grow(values), offset
        return self


def plain_scheme(m, options) -> Scheme:
    """``bf16`` (also ``fp16``, ``plain``): plain caches, rings of plain rows under ``max_kv_size``."""
    return Scheme("bf16", lambda i, o: KVCache(), False, lambda n, keep: RotatingKVCache(n, keep), policy={})
