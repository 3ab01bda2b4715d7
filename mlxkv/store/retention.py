"""Which RAM entry goes first when the store is over its cap.

- ``lru``: the least recently used (put or lent).

The policy keeps the store's one recency clock (``Entry.used``); the RAM tier lists its
entries by it.
- ``cost-size``: GreedyDual-Size-Frequency, as mlx-bun's prompt cache has it: an entry's
  priority is ``age + cost * uses / bytes`` (``cost``: the prefix it last served, in tokens,
  or its length when put; ``uses``: 1 at the put, one more per lending), the lowest priority
  goes first (ties: the least recently used), and the store's ``age`` rises to each evicted
  entry's priority, so entries that stop being used age out. It keeps small, often reused
  prefixes (system prompts) over large ones used once.

Pinned entries and entries still being written are never offered (the store filters them).
"""

import itertools

from ..errors import MLXKVError


class LRU:
    name = "lru"

    def __init__(self):
        self._clock = itertools.count()

    def on_put(self, entry) -> None:
        entry.used = next(self._clock)

    def on_lend(self, entry, p: int) -> None:
        entry.used = next(self._clock)

    def victim(self, candidates):
        return min(candidates, key=lambda e: e.used, default=None)

    def on_evict(self, entry) -> None:
        pass


class CostSize(LRU):
    name = "cost-size"

    def __init__(self):
        super().__init__()
        self.age = 0.0

    def _rank(self, entry, cost: int) -> None:
        entry.extra["priority"] = self.age + cost * entry.extra["uses"] / max(1, entry.nbytes)

    def on_put(self, entry) -> None:
        super().on_put(entry)
        entry.extra["uses"] = 1
        self._rank(entry, len(entry.tokens))

    def on_lend(self, entry, p: int) -> None:
        super().on_lend(entry, p)
        entry.extra["uses"] = entry.extra.get("uses", 0) + 1
        self._rank(entry, p)

    def victim(self, candidates):
        return min(candidates, key=lambda e: (e.extra["priority"], e.used), default=None)

    def on_evict(self, entry) -> None:
        self.age = max(self.age, entry.extra.get("priority", 0.0))


POLICIES = {"lru": LRU, "cost-size": CostSize}


def retention_policy(name: str):
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise MLXKVError(f"retention must be one of {sorted(POLICIES)}, got {name!r}") from None
