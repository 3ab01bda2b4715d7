"""The RAM tier: entries with their arrays, in least-recently-used order, and their index.

It keeps entries and answers lookups; which entry goes when the store is over its cap is
the store's decision (it also knows what the write queue still holds).
"""

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ..state.reuse import prefix_for
from .entry import Entry
from .index import PrefixIndex, best_prefix


class RamTier:
    def __init__(self, block: int):
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # oldest use first
        self._index = PrefixIndex(block)  # prompt entries only: checkpoints are found by generation
        self.nbytes = 0

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def get(self, key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

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

    def touch(self, key) -> None:
        self._entries.move_to_end(key)

    def oldest_first(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def find(self, space: str, prompt: Sequence[int], chain: Sequence[bytes]) -> tuple[Entry | None, int]:
        def usable(key, start):
            e = self._entries[key]
            return prefix_for(e.tokens, e.reuse, prompt, start)

        key, p = best_prefix(self._index, space, prompt, chain, usable)
        return (self._entries[key], p) if key is not None else (None, 0)
