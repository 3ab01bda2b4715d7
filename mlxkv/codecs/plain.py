"""``kv``: keys and values sliced to offset; restores with slack capacity."""

from ..caches.plain import KVCache
from ..errors import CorruptSnapshotError
from .base import Codec, expect_slots, same_prefix

SLOTS = ("keys", "values")


class PlainCodec(Codec):
    def encode(self, cache):
        n = cache.offset
        return {"offset": n}, [("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])]

    def check(self, entry, shapes):
        expect_slots(entry, shapes, SLOTS)
        same_prefix(entry, shapes, SLOTS)
        if shapes["keys"][2] != entry["offset"]:
            raise CorruptSnapshotError(
                f"kv entry: keys hold {shapes['keys'][2]} positions but offset is {entry['offset']}"
            )

    def capacity(self, entry):
        return KVCache.capacity_for(entry["offset"])

    def decode(self, entry, tensors):
        # held as given: a reader allocated ``capacity`` rows already; arrays lent from
        # memory stay exact and are grown (copied) by the first append, never written into
        return KVCache().adopt(tensors["keys"], tensors["values"], entry["offset"], slack=False)

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]
