"""The kind table's records: one per cache family.

Each record joins what the layers below know of a family: its live kind (the live cache
says it), its codec (which declares the persisted kind, the header fields and tensor slots
of an entry and mlx-bun's form of it; docs/format.md lists them), its row layout, its
compiled-decode slots and its scheme parser. Adding a family is one live cache module, one
codec module and one record here (or ``register_family`` from user code).
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
from ..codecs.plain import PlainCodec
from ..codecs.qfilters import QFiltersCodec
from ..codecs.ring import RingCodec
from ..codecs.tova import TOVACodec
from ..codecs.turboquant import TurboQuantCodec
from ..families import Family, register_family

PLAIN = Family(
    kind=KVCache.kind,
    codec=PlainCodec(),
    rows=plain_rows,
    decode_slot=plain_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(PLAIN_SCHEME, plain_scheme),
)
AFFINE = Family(
    kind=QuantizedKVCache.kind_prefix,
    codec=AffineCodec(),
    rows=affine_rows,
    decode_slot=affine_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(AFFINE_SCHEME, affine_scheme),
)
RING = Family(
    kind=RotatingKVCache.kind,
    codec=RingCodec(),
    rows=ring_rows,
    decode_slot=ring_decode_slot,
    batched_slot=batched_attention_slot,
)
AFFINE_RING = Family(
    kind=RotatingQuantizedKVCache.kind_prefix,
    codec=RotatingAffineCodec(),
    rows=affine_ring_rows,
    decode_slot=ring_decode_slot,
    batched_slot=batched_attention_slot,
)
RECURRENT = Family(
    kind=ArraysCache.kind,
    codec=ArraysCodec(),
    rows=arrays_rows,
    decode_slot=recurrent_decode_slot,
    batched_slot=recurrent_decode_slot,
)
TURBO = Family(
    kind=TurboQuantKVCache.kind_prefix,
    codec=TurboQuantCodec(),
    rows=turbo_rows,
    decode_slot=turbo_decode_slot,
    batched_slot=batched_attention_slot,
    scheme=(TURBO_SCHEME, turbo_scheme),
)
TOVA = Family(
    kind=TOVAKVCache.kind_prefix,
    codec=TOVACodec(),
    rows=tova_rows,
    decode_slot=eviction_decode_slot,
    batched_slot=eviction_batch_slot,
    scheme=(TOVA_SCHEME, tova_scheme),
)
QFILTERS = Family(
    kind=QFiltersKVCache.kind_prefix,
    codec=QFiltersCodec(),
    rows=qfilters_rows,
    decode_slot=eviction_decode_slot,
    batched_slot=eviction_batch_slot,
    scheme=(QFILTERS_SCHEME, qfilters_scheme),
)
FAMILIES = [PLAIN, AFFINE, RING, AFFINE_RING, RECURRENT, TURBO, TOVA, QFILTERS]

for _family in FAMILIES:
    register_family(_family)
