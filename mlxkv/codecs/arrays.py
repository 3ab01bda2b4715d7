"""``ssm``: one slot per recurrent state array, named by its index; absent arrays are absent."""

import re

from ..errors import CorruptSnapshotError, SnapshotError
from ..families import COUNT
from .base import BunForm, Codec

#: state arrays one ``ssm`` entry holds at most (mlx-lm's recurrent layers use 1 or 2)
MAX_SIZE = 256
_INDEX = re.compile(r"0|[1-9][0-9]{0,2}")  # decimal, no sign, no leading zero


class ArraysCodec(Codec):
    """Slots ``"0"`` .. ``str(size - 1)``, one per state array present."""

    persisted = "ssm"
    fields = {"offset": COUNT, "size": COUNT}
    bun = BunForm(implied={"size": 2}, slots=("0", "1"))  # mlx-bun's [conv, recurrent]
    positional = False

    def encode(self, cache):
        if len(cache.cache) > MAX_SIZE:
            raise SnapshotError(f"an ssm cache of {len(cache.cache)} arrays cannot be stored (at most {MAX_SIZE})")
        slots = [(str(i), a) for i, a in enumerate(cache.cache) if a is not None]
        return {"offset": cache.offset, "size": len(cache.cache)}, slots

    def check(self, entry, shapes):
        size, names = entry["size"], list(shapes)
        if size > MAX_SIZE:
            raise CorruptSnapshotError(f"ssm entry: size={size} exceeds the {MAX_SIZE} state arrays an entry may hold")
        idx = [int(n) if _INDEX.fullmatch(n) else -1 for n in names]
        if any(i < 0 or i >= size for i in idx) or idx != sorted(set(idx)):
            raise CorruptSnapshotError(f"ssm entry: slots {names} are not increasing indices below size={size}")

    def trimmable(self, entry, shapes):
        return False  # recurrent state has no token axis to cut

    def decode(self, entry, t):
        from ..caches.arrays import ArraysCache

        arrays = [t.get(str(i)) for i in range(entry["size"])]
        return ArraysCache(entry["size"]).adopt(arrays, entry["offset"])
