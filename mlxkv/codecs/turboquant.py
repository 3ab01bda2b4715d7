"""``turboquant``: the five TurboQuant storage arrays, sliced to offset.

Header fields ``offset``, ``kBits``, ``vBits``, ``headDim``; slots in this order (all
``[B, H, offset, width]``):

=========  =====================  ===========================
slot       dtype                  width
=========  =====================  ===========================
kIdx       I8 (kBits 8) else U8   headDim (kBits 8) else headDim*kBits/8
kScales    F16                    headDim/32
kZeros     F16                    headDim/32
vPacked    U8                     headDim*vBits/8
vScales    F16                    headDim/32
=========  =====================  ===========================

``check`` refuses a header without ``headDim``, unsupported bits or head_dim, a wrong dtype,
or widths inconsistent with headDim and the bits, before any tensor is read. The read mode
(eager or deferred) is not storage and is not persisted: a restored cache reads as a new one
(deferred named reads).
"""

from ..errors import CacheConfigError, CorruptSnapshotError
from ..families import COUNT
from ..math import turboquant as tq
from .base import BunForm, Codec, cut, expect_slots, same_prefix

SLOTS = ("kIdx", "kScales", "kZeros", "vPacked", "vScales")


def slot_layout(head_dim: int, k_bits: int, v_bits: int):
    """slot -> (safetensors dtype, last-axis width)."""
    g = head_dim // tq.GROUP
    return {
        "kIdx": ("I8" if k_bits == 8 else "U8", tq.key_width(head_dim, k_bits)),
        "kScales": ("F16", g),
        "kZeros": ("F16", g),
        "vPacked": ("U8", tq.value_width(head_dim, v_bits)),
        "vScales": ("F16", g),
    }


class TurboQuantCodec(Codec):
    persisted = "turboquant"
    fields = {"offset": COUNT, "kBits": COUNT, "vBits": COUNT, "headDim": COUNT}
    slots = SLOTS
    bun = BunForm(floor_at_offset=True)

    def encode(self, cache):
        n = cache.offset
        fields = {"offset": n, "kBits": cache.k_bits, "vBits": cache.v_bits, "headDim": cache.head_dim}
        return fields, list(zip(SLOTS, cache.state))

    def check(self, entry, shapes):
        kind = entry.get("kind")
        k_bits, v_bits, d, n = entry["kBits"], entry["vBits"], entry["headDim"], entry["offset"]
        try:
            tq.check_bits(k_bits, v_bits)
            tq.check_head_dim(d)
        except CacheConfigError as e:
            raise CorruptSnapshotError(f"{kind} entry: {e}") from None
        expect_slots(entry, shapes, SLOTS)
        for slot, shape in shapes.items():
            if len(shape) != 4:
                raise CorruptSnapshotError(
                    f"{kind} entry: slot {slot} has rank {len(shape)}, expected 4 [B, H, T, width]"
                )
        same_prefix(entry, shapes, SLOTS)
        if shapes["kIdx"][2] != n:
            raise CorruptSnapshotError(f"{kind} entry: slots hold {shapes['kIdx'][2]} positions but offset is {n}")
        dtypes = {t.get("slot"): t.get("dtype") for t in entry.get("tensors", [])}
        for slot, (dtype, width) in slot_layout(d, k_bits, v_bits).items():
            if shapes[slot][3] != width:
                raise CorruptSnapshotError(
                    f"{kind} entry: slot {slot} is {shapes[slot][3]} wide; headDim={d} kBits={k_bits} "
                    f"vBits={v_bits} stores {width}"
                )
            if dtypes.get(slot) != dtype:
                raise CorruptSnapshotError(f"{kind} entry: slot {slot} has dtype {dtypes.get(slot)}, expected {dtype}")

    def decode(self, entry, t):
        return self.prefix(entry, t, entry["offset"])

    def trimmable(self, entry, shapes):
        return True  # a code group never spans two positions

    def prefix(self, entry, t, p):
        from ..caches.turboquant import TurboQuantKVCache

        c = TurboQuantKVCache(entry["kBits"], entry["vBits"], head_dim=entry["headDim"])
        return c.adopt(*(cut(t[s], p) for s in SLOTS), offset=p)

    def geometry(self, entry, shapes):
        return shapes["kIdx"][1], entry["headDim"]
