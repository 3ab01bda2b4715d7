"""The RAM tier: entries with their arrays, and their prefix index.

It keeps entries and answers lookups; which entry goes when the store is over its cap is
the store's decision (its retention policy, which also keeps the one recency clock, and the
writes still in flight).
"""

from collections.abc import Sequence

from .entry import Entry
from .health import Health
from .tier import Found, LocalTier, Opened


class RamTier(LocalTier):
    name = "ram"

    def __init__(self, block: int):
        super().__init__(block)
        self.health = Health("ram", "memory")
        self.opened = Opened("ram", "memory", 0)

    def oldest_first(self) -> list[Entry]:
        """Least recently used first (the retention policy's clock)."""
        return sorted(self._entries.values(), key=lambda e: e.used)

    def add(self, entry: Entry, chain: Sequence[bytes]) -> None:
        assert entry.key not in self._entries
        self._file(entry, chain)

    def remove(self, key) -> Entry | None:
        return self._unfile(key)

    def read(self, found: Found) -> Entry | None:
        return found.record
