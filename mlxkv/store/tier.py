"""The tier interface: what RAM, the disk and Redis (and any further tier, a Redis Cluster)
implement, so that the store treats them alike.

The store keeps its tiers in order, fastest first, and

- finds a prefix by asking each tier in turn for a longer one than it has
  (``find(query, better_than)`` -> :class:`Found`, metadata only), then reading it
  (``read(found)`` -> the entry with its arrays, every check done, or None when it turned out
  damaged or gone: the tier forgets it and the store asks again);
- writes an entry to each lower tier on that tier's own writer thread (``write(entry)`` ->
  :class:`Written`, or raises), so a slow tier never delays another;
- publishes each tier's counters (``health``) and what opening it found (``opened``).

A tier that is reached over a network guards its own calls (``health.Breaker``): ``find``
and ``read`` then never wait longer than the tier's budget, and raise ``TierUnavailable``
while it is failing. ``local`` says the tier's index lives in this process, so the store
calls its ``find`` under its own lock (no I/O happens there).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..state.reuse import prefix_allowed
from .entry import Entry
from .health import Health
from .index import PrefixIndex


@dataclass(frozen=True)
class Query:
    """What a lookup is for: a prompt in a namespace, with its block chain (``keys.py``)."""

    space: str
    prompt: Sequence[int]
    chain: Sequence[bytes]
    seed: bytes


@dataclass
class Found:
    """A tier's best candidate for a query: it can serve ``prefix_len`` positions."""

    prefix_len: int
    record: object  # the tier's own handle (an entry, an index record, a manifest)


@dataclass
class Written:
    """A finished write: ``durable`` (on a device, fsync'd) or not; ``present`` when the tier
    had the entry already; ``record``: what the tier indexes for it (the disk's file);
    ``retry_in``: not written yet, ask again in that many seconds (another process holds the
    upload's lease)."""

    durable: bool = False
    retry_in: float | None = None
    present: bool = False
    record: Entry | None = None
    nbytes: int = 0


@dataclass
class Opened:
    """What opening a tier found, for a server's startup banner."""

    tier: str
    where: str
    entries: int | None = None  # None: not counted (a shared tier)
    detail: dict = field(default_factory=dict)

    def line(self) -> str:
        found = "" if self.entries is None else f", {self.entries} entries"
        more = "".join(f", {k} {len(v) if isinstance(v, list) else v}" for k, v in self.detail.items() if v)
        return f"{self.tier} ({self.where}){found}{more}"


class Tier:
    """The interface (see the module docstring). RAM, the disk and Redis implement it."""

    name = "tier"
    local = True  # the index is in this process: find runs under the store's lock
    durable = False  # a finished write survives the process (flush reports it durable)
    health: Health
    opened: Opened

    def find(self, query: Query, better_than: int) -> Found | None:
        raise NotImplementedError

    def read(self, found: Found) -> Entry | None:
        raise NotImplementedError

    def write(self, entry: Entry) -> Written:
        raise NotImplementedError

    def remove(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalTier(Tier):
    """A tier whose entries and prefix index live in this process (RAM; the disk's records
    of its files). Checkpoints are kept but not indexed: they are found by generation."""

    local = True

    def __init__(self, block: int):
        self._entries: dict[str, Entry] = {}
        self._index = PrefixIndex(block)
        self.nbytes = 0

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def get(self, key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def _file(self, entry: Entry, chain: Sequence[bytes]) -> None:
        self._unfile(entry.key)
        self._entries[entry.key] = entry
        self.nbytes += entry.nbytes
        if entry.checkpoint is None:
            self._index.add(entry.key, entry.space, entry.tokens, chain)

    def _unfile(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self._index.remove(key)
        return entry

    def prefixes(self, entry: Entry, chain: Sequence[bytes]) -> list[Entry]:
        """The indexed entries of ``entry``'s space whose tokens are a prefix of its own."""
        return [self._entries[k] for k in self._index.prefixes(entry.space, entry.tokens, chain)]

    def find(self, query: Query, better_than: int) -> Found | None:
        def usable(key, p):
            e = self._entries[key]
            return prefix_allowed(len(e.tokens), e.reuse, p)

        key, p = self._index.best(query.space, query.prompt, query.chain, usable, better_than)
        return Found(p, self._entries[key]) if key is not None else None
