"""``ArraysCache`` (``ssm``): mlx-lm's recurrent state with mlxkv's contract.

``offset`` counts the tokens the model advanced the state by (mlx-lm models call
``cache.advance(N)`` once per forward); recurrent state cannot be trimmed.
"""

from mlx_lm.models import cache as mlx_cache

from . import names
from .base import CacheContract


class ArraysCache(CacheContract, mlx_cache.ArraysCache):
    kind = names.RECURRENT_KIND

    def __init__(self, size: int, left_padding=None):
        super().__init__(size, left_padding)
        self.offset = 0

    def advance(self, N: int):
        super().advance(N)
        self.offset += N

    def make_mask(self, N: int, **_):
        if self.left_padding is None and self.lengths is None:
            return self.masks.get(("ssm", N), lambda: None)
        return super().make_mask(N)

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0

    def dense_window(self):
        return None

    def adopt(self, arrays, offset: int):
        self.cache = list(arrays)
        self.offset = offset
        return self
