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
        self._steps: OrderedDict[Hashable, object] = OrderedDict()
        self._capacity = capacity
        self.builds = 0  # how many masks were actually computed (tests read it)

    def get(self, key: Hashable, build: Callable[[], object]):
        value, built = _memoized(self._memo, self._capacity, key, build)
        self.builds += built
        return value

    def shared(self, key: Hashable, build: Callable[[], object]):
        """What else every layer of a forward computes alike from the same integers (a
        batch's append plan, its next offsets), memoized beside the masks: ``key`` must
        name every input of ``build``."""
        return _memoized(self._steps, self._capacity, key, build)[0]

    def causal(self, N: int, offset: int, window_size: int | None = None, return_array: bool = False):
        """mlx-lm's linear-cache mask: None for one query, "causal" or an array otherwise."""
        return self.get(
            ("causal", N, offset, window_size, return_array),
            lambda: create_attention_mask(N, offset, return_array, window_size),
        )


def _memoized(memo: OrderedDict, capacity: int, key: Hashable, build: Callable[[], object]):
    """(value, 1 if it was built now else 0), least recently used entries dropped."""
    hit = memo.get(key, _MISS)
    if hit is not _MISS:
        memo.move_to_end(key)
        return hit, 0
    value = build()
    memo[key] = value
    if len(memo) > capacity:
        memo.popitem(last=False)
    return value, 1
