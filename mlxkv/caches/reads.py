"""Named reads: the decode, window and block reads of the cache contract (docs/caches.md).

Each returns an :class:`AttentionRead` whose ``attend(q, scale)`` runs attention over exactly
the positions that read may see. Which read it is comes from the method name, never from L.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from ..errors import MLXKVError


@dataclass
class AttentionRead:
    keys: Any
    values: Any
    mask: Any
    cache: Any = None  # passed to mlx-lm's SDPA so an affine cache takes the quantized path
    finish: Callable[[mx.array], mx.array] | None = None  # e.g. un-rotate deferred values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        out = scaled_dot_product_attention(
            queries, self.keys, self.values, cache=self.cache, scale=scale, mask=self.mask
        )
        return self.finish(out) if self.finish is not None else out


class NamedReads:
    """Mixin over ``update_and_fetch``/``make_mask``/``dense_window`` (the stored rows, dense)."""

    def append_decode(self, keys: mx.array, values: mx.array) -> AttentionRead:
        if keys.shape[2] != 1:
            raise MLXKVError(
                f"append_decode takes one position per row, got L={keys.shape[2]}; "
                "use append_window for several positions"
            )
        mask = self.make_mask(1)
        k, v = self.update_and_fetch(keys, values)
        return AttentionRead(k, v, mask, self)

    def append_window(self, keys: mx.array, values: mx.array) -> AttentionRead:
        mask = self.make_mask(keys.shape[2])
        k, v = self.update_and_fetch(keys, values)
        return AttentionRead(k, v, mask, self)

    def read_block(self, keys: mx.array, values: mx.array) -> AttentionRead:
        """Attend the stored positions plus the block, unmasked; nothing is appended."""
        stored = self.dense_window()
        if stored is None:
            return AttentionRead(keys, values, None)
        sk, sv = stored
        return AttentionRead(
            mx.concatenate([sk, keys.astype(sk.dtype)], axis=2),
            mx.concatenate([sv, values.astype(sv.dtype)], axis=2),
            None,
        )
