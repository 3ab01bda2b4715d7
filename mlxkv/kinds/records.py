"""The kind table's records: one per cache family.

Each record joins what the layers below know of a family: its live kind (the live cache
says it), its codec (which declares the persisted kind, the header fields and tensor slots
of an entry and mlx-bun's form of it; docs/format.md lists them), its row layout, its
compiled decode steps and its scheme parser. Adding a family is one live cache module, one
codec module and one record here (or ``register_family`` from user code).
"""

from ..batched.arrays import arrays_rows
from ..batched.formats import affine_ring_rows, affine_rows, plain_rows, ring_rows, turbo_rows
from ..batched.qfilters import qfilters_rows
from ..batched.rows import merge_rows
from ..batched.step_builders import batched_attention_step, eviction_batch_step
from ..batched.tova import tova_rows
from ..caches.arrays import ArraysCache
from ..caches.plain import PLAIN_SCHEME, KVCache, plain_scheme
from ..caches.qfilters import QFILTERS_SCHEME, QFiltersKVCache, qfilters_scheme
from ..caches.quantized import AFFINE_SCHEME, QuantizedKVCache, affine_scheme
from ..caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from ..caches.step_builders import (
    affine_decode_step,
    eviction_decode_step,
    plain_decode_step,
    recurrent_decode_step,
    ring_decode_step,
    turbo_decode_step,
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
from ..families import Family, register_family, register_row_merge

PLAIN = Family(
    kind=KVCache.kind,
    codec=PlainCodec(),
    rows=plain_rows,
    decode_step=plain_decode_step,
    batched_decode_step=batched_attention_step,
    scheme=(PLAIN_SCHEME, plain_scheme),
)
AFFINE = Family(
    kind=QuantizedKVCache.kind_prefix,
    codec=AffineCodec(),
    rows=affine_rows,
    decode_step=affine_decode_step,
    batched_decode_step=batched_attention_step,
    scheme=(AFFINE_SCHEME, affine_scheme),
)
RING = Family(
    kind=RotatingKVCache.kind,
    codec=RingCodec(),
    rows=ring_rows,
    decode_step=ring_decode_step,
    batched_decode_step=batched_attention_step,
)
AFFINE_RING = Family(
    kind=RotatingQuantizedKVCache.kind_prefix,
    codec=RotatingAffineCodec(),
    rows=affine_ring_rows,
    decode_step=ring_decode_step,
    batched_decode_step=batched_attention_step,
)
RECURRENT = Family(
    kind=ArraysCache.kind,
    codec=ArraysCodec(),
    rows=arrays_rows,
    decode_step=recurrent_decode_step,
    batched_decode_step=recurrent_decode_step,
)
TURBO = Family(
    kind=TurboQuantKVCache.kind_prefix,
    codec=TurboQuantCodec(),
    rows=turbo_rows,
    decode_step=turbo_decode_step,
    batched_decode_step=batched_attention_step,
    scheme=(TURBO_SCHEME, turbo_scheme),
)
TOVA = Family(
    kind=TOVAKVCache.kind_prefix,
    codec=TOVACodec(),
    rows=tova_rows,
    decode_step=eviction_decode_step,
    batched_decode_step=eviction_batch_step,
    scheme=(TOVA_SCHEME, tova_scheme),
)
QFILTERS = Family(
    kind=QFiltersKVCache.kind_prefix,
    codec=QFiltersCodec(),
    rows=qfilters_rows,
    decode_step=eviction_decode_step,
    batched_decode_step=eviction_batch_step,
    scheme=(QFILTERS_SCHEME, qfilters_scheme),
)
FAMILIES = [PLAIN, AFFINE, RING, AFFINE_RING, RECURRENT, TURBO, TOVA, QFILTERS]

for _family in FAMILIES:
    register_family(_family)
register_row_merge(merge_rows)
