"""``kv``: keys and values sliced to offset; restores with slack capacity."""

from ..errors import CorruptSnapshotError
from ..families import COUNT
from .base import BunForm, Codec, cut, expect_slots, same_prefix


class PlainCodec(Codec):
    persisted = "kv"
    fields = {"offset": COUNT}
    slots = ("keys", "values")
    bun = BunForm()

    def encode(self, cache):
        n = cache.offset
        return {"offset": n}, [("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])]

    def check(self, entry, shapes):
        expect_slots(entry, shapes, self.slots)
        same_prefix(entry, shapes, self.slots)
        if shapes["keys"][2] != entry["offset"]:
            raise CorruptSnapshotError(
                f"kv entry: keys hold {shapes['keys'][2]} positions but offset is {entry['offset']}"
            )

    def capacity(self, entry):
        from ..caches.plain import KVCache

        return KVCache.capacity_for(entry["offset"])

    def decode(self, entry, tensors):
        from ..caches.plain import KVCache

        # held as given: a reader allocated ``capacity`` rows already; arrays lent from
        # memory stay exact and are grown (copied) by the first append, never written into
        return KVCache().adopt(tensors["keys"], tensors["values"], entry["offset"], slack=False)

    def trimmable(self, entry, shapes):
        return True

    def prefix(self, entry, tensors, p):
        from ..caches.plain import KVCache

        return KVCache().adopt(cut(tensors["keys"], p), cut(tensors["values"], p), p, slack=False)

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]
