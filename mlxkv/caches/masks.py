"""The per-forward mask object shared by every cache one ``make_cache`` call made.

mlx-lm asks one cache per forward for the mask and hands it to every layer; a serving
engine asks every layer. Either way equal inputs must give the same mask object, built once:
``ForwardMasks`` memoizes masks by the integers they are computed from, so the second layer
that asks in a forward gets the first layer's object back.
"""

from collections import OrderedDict
from collections.abc import Callable, Hashable

from mlx_lm.models.cache import create_attention_mask

_MISS = object()


class ForwardMasks:
    def __init__(self, capacity: int = 16):
        self._memo: OrderedDict[Hashable, object] = OrderedDict()
        self._capacity = capacity
        self.builds = 0  # how many masks were actually computed (tests read it)

    def get(self, key: Hashable, build: Callable[[], object]):
        hit = self._memo.get(key, _MISS)
        if hit is not _MISS:
            self._memo.move_to_end(key)
            return hit
        value = build()
        self.builds += 1
        self._memo[key] = value
        if len(self._memo) > self._capacity:
            self._memo.popitem(last=False)
        return value

    def causal(self, N: int, offset: int, window_size: int | None = None, return_array: bool = False):
        """mlx-lm's linear-cache mask: None for one query, "causal" or an array otherwise."""
        return self.get(
            ("causal", N, offset, window_size, return_array),
            lambda: create_attention_mask(N, offset, return_array, window_size),
        )
