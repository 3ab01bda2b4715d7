"""``ssm``: one slot per recurrent state array, named by its index; absent arrays are absent."""

from ..caches.arrays import ArraysCache
from ..errors import CorruptSnapshotError
from .base import Codec


class ArraysCodec(Codec):
    def encode(self, cache):
        slots = [(str(i), a) for i, a in enumerate(cache.cache) if a is not None]
        return {"offset": cache.offset, "size": len(cache.cache)}, slots

    def check(self, entry, shapes):
        names = list(shapes)
        idx = [int(n) if n.isdigit() else -1 for n in names]
        if any(i < 0 or i >= entry["size"] for i in idx) or idx != sorted(set(idx)):
            raise CorruptSnapshotError(
                f"ssm entry: slots {names} are not increasing indices below size={entry['size']}"
            )

    def decode(self, entry, t):
        arrays = [t.get(str(i)) for i in range(entry["size"])]
        return ArraysCache(entry["size"]).adopt(arrays, entry["offset"])
