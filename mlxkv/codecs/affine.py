"""``qkv`` and ``rotating-qkv``: mlx-lm's affine triples, keys then values."""

from ..errors import CorruptSnapshotError
from ..families import COUNT
from ..math.affine import AFFINE_BITS, AFFINE_GROUPS
from . import ring
from .base import BunForm, Codec, cut, expect_slots, same_prefix

SLOTS = ("kPacked", "kScales", "kBiases", "vPacked", "vScales", "vBiases")
FIELDS = {"groupSize": COUNT, "bits": COUNT}


def affine_slots(keys, values, n=None):
    cut = (lambda a: a) if n is None else (lambda a: a[..., :n, :])
    return [(name, cut(a)) for name, a in zip(SLOTS, (*keys, *values))]


def triples(t, p=None):
    """(keys, values) affine triples of an entry's tensors, their first ``p`` positions."""
    keep = (lambda a: a) if p is None else (lambda a: cut(a, p))
    return tuple(keep(t[s]) for s in SLOTS[:3]), tuple(keep(t[s]) for s in SLOTS[3:])


def check_affine_entry(entry, shapes):
    bits, group = entry["bits"], entry["groupSize"]
    if bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
        raise CorruptSnapshotError(f"{entry['kind']} entry: unsupported bits={bits} groupSize={group}")
    expect_slots(entry, shapes, SLOTS)
    same_prefix(entry, shapes, SLOTS)
    for side in "kv":
        packed, scales, biases = (shapes[f"{side}{s}"] for s in ("Packed", "Scales", "Biases"))
        dim = packed[3] * 32 // bits
        if packed[3] * 32 % bits or scales[3] * group != dim or biases[3] != scales[3]:
            raise CorruptSnapshotError(
                f"{entry['kind']} entry: {side} packed width {packed[3]} words, scales {scales[3]}, "
                f"biases {biases[3]} do not describe one head_dim at bits={bits} group={group}"
            )


def affine_geometry(shapes, bits):
    p = shapes["kPacked"]
    return p[1], p[3] * 32 // bits


class AffineCodec(Codec):
    persisted = "qkv"
    fields = {"offset": COUNT, **FIELDS}
    slots = SLOTS
    bun = BunForm()

    def encode(self, cache):
        n = cache.offset
        fields = {"offset": n, "groupSize": cache.group_size, "bits": cache.bits}
        return fields, affine_slots(cache.keys, cache.values, n)

    def check(self, entry, shapes):
        check_affine_entry(entry, shapes)
        if shapes["kPacked"][2] != entry["offset"]:
            raise CorruptSnapshotError(
                f"qkv entry: slots hold {shapes['kPacked'][2]} positions but offset is {entry['offset']}"
            )

    def decode(self, entry, t):
        return self.prefix(entry, t, entry["offset"])

    def trimmable(self, entry, shapes):
        return True

    def prefix(self, entry, t, p):
        from ..caches.quantized import QuantizedKVCache

        c = QuantizedKVCache(group_size=entry["groupSize"], bits=entry["bits"])
        k, v = triples(t, p)
        return c.adopt(k, v, p)

    def geometry(self, entry, shapes):
        return affine_geometry(shapes, entry["bits"])


class RotatingAffineCodec(Codec):
    persisted = "rotating-qkv"
    fields = {**ring.FIELDS, **FIELDS}
    slots = SLOTS
    bun = ring.BUN_RING

    def encode(self, cache):
        fields = {
            "offset": cache.offset,
            "idx": cache._idx,
            "maxSize": cache.max_size,
            "keep": cache.keep,
            "groupSize": cache.group_size,
            "bits": cache.bits,
        }
        return fields, affine_slots(cache.keys, cache.values)

    def stored(self, entry, held):
        return ring.ring_stored(entry, held)

    def check(self, entry, shapes):
        check_affine_entry(entry, shapes)
        ring.check_ring(entry, shapes["kPacked"][2])

    def decode(self, entry, t):
        return self._ring(entry, *triples(t), entry["offset"], entry["idx"])

    def trimmable(self, entry, shapes):
        return ring.ring_trimmable(entry)

    def prefix(self, entry, t, p):
        rows, idx = ring.ring_prefix(entry, p)
        return self._ring(entry, *triples(t, rows), p, idx)

    @staticmethod
    def _ring(entry, keys, values, offset, idx):
        from ..caches.rotating import RotatingQuantizedKVCache

        c = RotatingQuantizedKVCache(entry["maxSize"], entry["keep"], entry["groupSize"], entry["bits"])
        return c.adopt(keys, values, offset, idx)

    def geometry(self, entry, shapes):
        return affine_geometry(shapes, entry["bits"])
