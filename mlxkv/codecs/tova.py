"""``tova``: TOVA's kept rows with their original positions.

Fields offset, budget, nSink. Slots, in order: ``keys`` [B, H, T, D] and ``values``
[B, H, T, Dv] in the cache dtype, ``positions`` int32 [B, H, T] (the original position of
every kept row, ascending per (batch, head)). TOVA holds at most ``budget`` rows after every
step, so T == min(offset, budget). Restores position-exact.
"""

import mlx.core as mx

from ..errors import CorruptSnapshotError
from ..families import COUNT
from .base import Codec, expect_slots, same_prefix

SLOTS = ("keys", "values", "positions")
FIELDS = {"offset": COUNT, "budget": COUNT, "nSink": COUNT}
FLOAT_DTYPES = ("BF16", "F16", "F32")


def slot_dtypes(entry: dict) -> dict:
    """slot -> declared safetensors dtype (the snapshot layer checked them against the file)."""
    return {t.get("slot"): t.get("dtype") for t in entry.get("tensors", []) if isinstance(t, dict)}


def check_rows(entry: dict, shapes: dict, dtypes: dict, scored=()):
    """keys/values rank 4 with one [B, H, T]; positions (and ``scored`` slots) [B, H, T]."""
    kind = entry.get("kind")
    for name in ("keys", "values"):
        if len(shapes[name]) != 4:
            raise CorruptSnapshotError(f"{kind} entry: slot {name} must be [B, H, T, D], got {list(shapes[name])}")
        if dtypes.get(name) not in FLOAT_DTYPES:
            raise CorruptSnapshotError(
                f"{kind} entry: slot {name} has dtype {dtypes.get(name)}, not one of {FLOAT_DTYPES}"
            )
    same_prefix(entry, shapes, ("keys", "values"))
    for name, dtype in (("positions", "I32"), *scored):
        if list(shapes[name]) != list(shapes["keys"][:3]):
            raise CorruptSnapshotError(
                f"{kind} entry: slot {name} has shape {list(shapes[name])}, expected [B, H, T] = "
                f"{list(shapes['keys'][:3])}"
            )
        if dtypes.get(name) != dtype:
            raise CorruptSnapshotError(f"{kind} entry: slot {name} must be {dtype}, got {dtypes.get(name)}")


def check_budget_fields(entry: dict):
    if entry["budget"] < 1 or entry["nSink"] >= entry["budget"]:
        raise CorruptSnapshotError(
            f"{entry.get('kind')} entry: offset={entry['offset']} budget={entry['budget']} "
            f"nSink={entry['nSink']} is not a configuration mlxkv writes"
        )


def has_evicted(entry: dict, shapes: dict) -> bool:
    """Fewer kept rows than positions seen: after that the cache no longer trims."""
    return shapes["keys"][2] < entry["offset"]


def check_positions(entry: dict, positions: mx.array) -> None:
    """The data rules of kept positions (read after their checksum passed): along T each
    head's positions strictly increase, all lie in 0 .. offset-1, and the first
    min(nSink, T) are 0, 1, ...: the sinks."""
    rows = positions.shape[2]
    if rows == 0:
        return
    p, sinks = positions, min(entry["nSink"], rows)
    ok = mx.logical_not(mx.any((p < 0) | (p >= entry["offset"])))
    if rows > 1:
        ok = ok & mx.all(p[..., 1:] > p[..., :-1])
    if sinks:
        ok = ok & mx.all(p[..., :sinks] == mx.arange(sinks, dtype=p.dtype))
    if not ok.item():
        raise CorruptSnapshotError(
            f"{entry.get('kind')} entry: kept positions are not increasing positions below offset={entry['offset']} "
            f"starting with the {sinks} sinks"
        )


class TOVACodec(Codec):
    persisted = "tova"
    fields = FIELDS
    slots = SLOTS

    def encode(self, cache):
        fields = {"offset": cache.offset, "budget": cache.budget, "nSink": cache.n_sink}
        return fields, [("keys", cache.keys), ("values", cache.values), ("positions", cache.positions)]

    def check(self, entry, shapes):
        check_budget_fields(entry)
        expect_slots(entry, shapes, SLOTS)
        check_rows(entry, shapes, slot_dtypes(entry))
        rows, offset, budget = shapes["keys"][2], entry["offset"], entry["budget"]
        if rows != min(offset, budget):
            raise CorruptSnapshotError(
                f"tova entry: {rows} kept rows, but TOVA keeps min(offset={offset}, budget={budget})"
            )

    def trimmable(self, entry, shapes):
        return not has_evicted(entry, shapes)

    def check_values(self, entry, t):
        check_positions(entry, t["positions"])

    def decode(self, entry, t):
        from ..caches.tova import TOVAKVCache

        self.check_values(entry, t)
        cache = TOVAKVCache(entry["budget"], entry["nSink"])
        return cache.adopt(t["keys"], t["values"], t["positions"], entry["offset"])

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]
