"""``rotating``: the whole ring as laid out, with its write index."""

from ..errors import CorruptSnapshotError
from ..families import COUNT
from .base import BunForm, Codec, cut, expect_slots, refuse_prefix, same_prefix

FIELDS = {"offset": COUNT, "idx": COUNT, "maxSize": COUNT, "keep": COUNT}
#: mlx-bun's rings are mlx-lm's with keep=0, persisted whole
BUN_RING = BunForm(implied={"keep": 0}, ring=True)


def check_ring(entry, rows):
    off, idx, size, keep = entry["offset"], entry["idx"], entry["maxSize"], entry["keep"]
    if size <= 0 or not 0 <= keep < size or not 0 <= idx <= rows or rows > off or rows < min(off, size):
        raise CorruptSnapshotError(
            f"{entry['kind']} entry: ring of {rows} rows with offset={off} idx={idx} "
            f"maxSize={size} keep={keep} is not a ring mlxkv writes"
        )


def ring_stored(entry, held):
    """A ring's stored rows: the ring as laid out, cut to its offset (rows past it are the
    unwritten tail of a ring not yet full, which mlx-bun's files keep and mlxkv's do not)."""
    n = min(entry["offset"], held[0][1].shape[2])
    return [(slot, a[..., :n, :]) for slot, a in held]


def ring_trimmable(entry) -> bool:
    """A ring trims until it wraps (mlx-lm's ``is_trimmable``): while ``offset < maxSize``."""
    return entry["offset"] < entry["maxSize"]


def ring_prefix(entry, p: int):
    """(rows kept, write index) of a ring entry cut to its first ``p`` positions: a ring that
    has not wrapped holds them in order, and its write index moves back with its offset."""
    if not ring_trimmable(entry):
        refuse_prefix(entry, p)
    return p, entry["idx"] - (entry["offset"] - p)


class RingCodec(Codec):
    persisted = "rotating"
    fields = FIELDS
    slots = ("keys", "values")
    bun = BUN_RING

    def encode(self, cache):
        fields = {"offset": cache.offset, "idx": cache._idx, "maxSize": cache.max_size, "keep": cache.keep}
        return fields, [("keys", cache.keys), ("values", cache.values)]

    def stored(self, entry, held):
        return ring_stored(entry, held)

    def check(self, entry, shapes):
        expect_slots(entry, shapes, self.slots)
        same_prefix(entry, shapes, self.slots)
        check_ring(entry, shapes["keys"][2])

    def decode(self, entry, t):
        from ..caches.rotating import RotatingKVCache

        c = RotatingKVCache(entry["maxSize"], entry["keep"])
        return c.adopt(t["keys"], t["values"], entry["offset"], entry["idx"])

    def trimmable(self, entry, shapes):
        return ring_trimmable(entry)

    def prefix(self, entry, t, p):
        from ..caches.rotating import RotatingKVCache

        rows, idx = ring_prefix(entry, p)
        c = RotatingKVCache(entry["maxSize"], entry["keep"])
        return c.adopt(cut(t["keys"], rows), cut(t["values"], rows), p, idx)

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]
