"""The RAM tier: entries with their arrays, and their prefix index.

It keeps entries and answers lookups; which entry goes when the store is over its cap is
the store's decision (its retention policy, which also keeps the one recency clock, and the
writes still in flight).
"""

from collections.abc import Sequence

from ..state.reuse import prefix_allowed
from .entry import Entry
from .health import Health
from .index import PrefixIndex
from .tier import Found, Opened, Query, Tier


class RamTier(Tier):
    name = "ram"

    def __init__(self, block: int):
        self._entries: dict[str, Entry] = {}
        self._index = PrefixIndex(block)  # prompt entries only: checkpoints are found by generation
        self.nbytes = 0
        self.health = Health("ram", "memory")
        self.opened = Opened("ram", "memory", 0)

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def get(self, key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def oldest_first(self) -> list[Entry]:
        """Least recently used first (the retention policy's clock)."""
        return sorted(self._entries.values(), key=lambda e: e.used)

    def add(self, entry: Entry, chain: Sequence[bytes]) -> None:
        assert entry.key not in self._entries
        self._entries[entry.key] = entry
        self.nbytes += entry.nbytes
        if entry.checkpoint is None:
            self._index.add(entry.key, entry.space, entry.tokens, chain)

    def remove(self, key) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self._index.remove(key)
        return entry

    def find(self, query: Query, better_than: int) -> Found | None:
        def usable(key, p):
            e = self._entries[key]
            return prefix_allowed(len(e.tokens), e.reuse, p)

        key, p = self._index.best(query.space, query.prompt, query.chain, usable, better_than)
        return Found(p, self._entries[key]) if key is not None else None

    def read(self, found: Found) -> Entry | None:
        return found.record
