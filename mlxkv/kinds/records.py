"""The kind table's records: one per cache family.

Each record is everything mlxkv knows about a family (docs/format.md lists the persisted
kinds, their fields and slots): its live kind, persisted kind, live cache, codec, header
fields, row layout, compiled-decode slot and scheme parser. Adding a family is one live
cache module, one codec module and one record here (or ``register_family`` from user code).
"""

from ..batched.arrays import arrays_rows
from ..batched.formats import affine_ring_rows, affine_rows, plain_rows, ring_rows, turbo_rows
from ..batched.qfilters import qfilters_rows
from ..batched.slots import batched_attention_slot, eviction_batch_slot
from ..batched.tova import tova_rows
from ..caches.arrays import ArraysCache
from ..caches.plain import PLAIN_SCHEME, KVCache, plain_scheme
from ..caches.qfilters import QFILTERS_SCHEME, QFiltersKVCache, qfilters_scheme
from ..caches.quantized import AFFINE_SCHEME, QuantizedKVCache, affine_scheme
from ..caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from ..caches.slots import (
    affine_decode_slot,
    eviction_decode_slot,
    plain_decode_slot,
    recurrent_decode_slot,
    ring_decode_slot,
    turbo_decode_slot,
)
from ..caches.tova import TOVA_SCHEME, TOVAKVCache, tova_scheme
from ..caches.turboquant import TURBO_SCHEME, TurboQuantKVCache, turbo_scheme
from ..codecs.affine import AffineCodec, RotatingAffineCodec
from ..codecs.arrays import ArraysCodec
from ..codecs.base import check_fields
from ..codecs.plain import PlainCodec
from ..codecs.qfilters import QFiltersCodec
from ..codecs.ring import RingCodec
from ..codecs.tova import TOVACodec
from ..codecs.turboquant import TurboQuantCodec
from ..families import COUNT, FLAG, SIGN, Family, family_of_persisted, register_family

RING_FIELDS = {"offset": COUNT, "idx": COUNT, "maxSize": COUNT, "keep": COUNT}
AFFINE_FIELDS = {"groupSize": COUNT, "bits": COUNT}
BUDGET_FIELDS = {"offset": COUNT, "budget": COUNT, "nSink": COUNT}

PLAIN = Family(
    kind=KVCache.kind,
    persisted="kv",
    cache=KVCache,
    codec=PlainCodec(),
    fields={"offset": COUNT},
    rows=plain_rows,
    decode_slot=plain_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(PLAIN_SCHEME, plain_scheme),
)
AFFINE = Family(
    kind=QuantizedKVCache.kind_prefix,
    persisted="qkv",
    cache=QuantizedKVCache,
    codec=AffineCodec(),
    fields={"offset": COUNT, **AFFINE_FIELDS},
    rows=affine_rows,
    decode_slot=affine_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(AFFINE_SCHEME, affine_scheme),
)
RING = Family(
    kind=RotatingKVCache.kind,
    persisted="rotating",
    cache=RotatingKVCache,
    codec=RingCodec(),
    fields=RING_FIELDS,
    rows=ring_rows,
    decode_slot=ring_decode_slot,
    batched_slot=batched_attention_slot,
)
AFFINE_RING = Family(
    kind=RotatingQuantizedKVCache.kind_prefix,
    persisted="rotating-qkv",
    cache=RotatingQuantizedKVCache,
    codec=RotatingAffineCodec(),
    fields={**RING_FIELDS, **AFFINE_FIELDS},
    rows=affine_ring_rows,
    decode_slot=ring_decode_slot,
    batched_slot=batched_attention_slot,
)
RECURRENT = Family(
    kind=ArraysCache.kind,
    persisted="ssm",
    cache=ArraysCache,
    codec=ArraysCodec(),
    fields={"offset": COUNT, "size": COUNT},
    rows=arrays_rows,
    decode_slot=recurrent_decode_slot,
    batched_slot=recurrent_decode_slot,
)
TURBO = Family(
    kind=TurboQuantKVCache.kind_prefix,
    persisted="turboquant",
    cache=TurboQuantKVCache,
    codec=TurboQuantCodec(),
    fields={"offset": COUNT, "kBits": COUNT, "vBits": COUNT, "headDim": COUNT},
    rows=turbo_rows,
    decode_slot=turbo_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(TURBO_SCHEME, turbo_scheme),
)
TOVA = Family(
    kind=TOVAKVCache.kind_prefix,
    persisted="tova",
    cache=TOVAKVCache,
    codec=TOVACodec(),
    fields=BUDGET_FIELDS,
    rows=tova_rows,
    decode_slot=eviction_decode_slot,
    batched_slot=eviction_batch_slot,
    scheme=(TOVA_SCHEME, tova_scheme),
)
QFILTERS = Family(
    kind=QFiltersKVCache.kind_prefix,
    persisted="qfilters",
    cache=QFiltersKVCache,
    codec=QFiltersCodec(),
    fields={**BUDGET_FIELDS, "recent": COUNT, "sign": SIGN, "calibTokens": COUNT, "calibrated": FLAG},
    rows=qfilters_rows,
    decode_slot=eviction_decode_slot,
    batched_slot=eviction_batch_slot,
    scheme=(QFILTERS_SCHEME, qfilters_scheme),
)
FAMILIES = [PLAIN, AFFINE, RING, AFFINE_RING, RECURRENT, TURBO, TOVA, QFILTERS]

for _family in FAMILIES:
    register_family(_family)


def check_entry(entry: dict, shapes: dict):
    """Every check a header entry goes through before any tensor is read: its family's
    field types, then its codec's rules over fields and slot shapes. Returns the family."""
    family = family_of_persisted(entry.get("kind"))
    check_fields(entry, family.fields)
    family.codec.check(entry, shapes)
    return family
