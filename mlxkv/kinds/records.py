"""The kind table's records: one per cache family.

Each record joins what the layers below know of a family: its live kind (the live cache
says it), its codec (which declares the persisted kind, the header fields and tensor slots
of an entry and mlx-bun's form of it; docs/format.md lists them), its row layout, its
compiled decode steps and its scheme parser. Adding a family is one live cache module, one
codec module and one record here (or ``register_family`` from user code).

A record imports the codecs and the live families' names (``caches/names.py``) only; the
row formats, decode steps and scheme parsers, which import the live cache classes and mlx-lm
with them, are named as :class:`~mlxkv.families.Deferred` functions, imported when the first
cache is built, joined or compiled. So a header read, a verification and ``mlxkv schemes``
read the whole table without importing mlx-lm.
"""

from ..caches import names
from ..codecs.affine import AffineCodec, RotatingAffineCodec
from ..codecs.arrays import ArraysCodec
from ..codecs.plain import PlainCodec
from ..codecs.qfilters import QFiltersCodec
from ..codecs.ring import RingCodec
from ..codecs.tova import TOVACodec
from ..codecs.turboquant import TurboQuantCodec
from ..families import Deferred, Family, register_family, register_row_merge

BATCHED_ATTENTION_STEP = Deferred("mlxkv.batched.step_builders:batched_attention_step")
RING_DECODE_STEP = Deferred("mlxkv.caches.step_builders:ring_decode_step")
EVICTION_DECODE_STEP = Deferred("mlxkv.caches.step_builders:eviction_decode_step")
EVICTION_BATCH_STEP = Deferred("mlxkv.batched.step_builders:eviction_batch_step")
RECURRENT_DECODE_STEP = Deferred("mlxkv.caches.step_builders:recurrent_decode_step")

PLAIN = Family(
    kind=names.PLAIN_KIND,
    codec=PlainCodec(),
    rows=Deferred("mlxkv.batched.formats:plain_rows"),
    decode_step=Deferred("mlxkv.caches.step_builders:plain_decode_step"),
    batched_decode_step=BATCHED_ATTENTION_STEP,
    scheme=(names.PLAIN_SCHEME, Deferred("mlxkv.caches.plain:plain_scheme")),
)
AFFINE = Family(
    kind=names.AFFINE_KIND_PREFIX,
    codec=AffineCodec(),
    rows=Deferred("mlxkv.batched.formats:affine_rows"),
    decode_step=Deferred("mlxkv.caches.step_builders:affine_decode_step"),
    batched_decode_step=BATCHED_ATTENTION_STEP,
    scheme=(names.AFFINE_SCHEME, Deferred("mlxkv.caches.quantizing_schemes:affine_scheme")),
)
RING = Family(
    kind=names.RING_KIND,
    codec=RingCodec(),
    rows=Deferred("mlxkv.batched.formats:ring_rows"),
    decode_step=RING_DECODE_STEP,
    batched_decode_step=BATCHED_ATTENTION_STEP,
)
AFFINE_RING = Family(
    kind=names.AFFINE_RING_KIND_PREFIX,
    codec=RotatingAffineCodec(),
    rows=Deferred("mlxkv.batched.formats:affine_ring_rows"),
    decode_step=RING_DECODE_STEP,
    batched_decode_step=BATCHED_ATTENTION_STEP,
)
RECURRENT = Family(
    kind=names.RECURRENT_KIND,
    codec=ArraysCodec(),
    rows=Deferred("mlxkv.batched.arrays:arrays_rows"),
    decode_step=RECURRENT_DECODE_STEP,
    batched_decode_step=RECURRENT_DECODE_STEP,
)
TURBO = Family(
    kind=names.TURBO_KIND_PREFIX,
    codec=TurboQuantCodec(),
    rows=Deferred("mlxkv.batched.formats:turbo_rows"),
    decode_step=Deferred("mlxkv.caches.step_builders:turbo_decode_step"),
    batched_decode_step=BATCHED_ATTENTION_STEP,
    scheme=(names.TURBO_SCHEME, Deferred("mlxkv.caches.quantizing_schemes:turbo_scheme")),
)
TOVA = Family(
    kind=names.TOVA_KIND_PREFIX,
    codec=TOVACodec(),
    rows=Deferred("mlxkv.batched.tova:tova_rows"),
    decode_step=EVICTION_DECODE_STEP,
    batched_decode_step=EVICTION_BATCH_STEP,
    scheme=(names.TOVA_SCHEME, Deferred("mlxkv.caches.tova:tova_scheme")),
)
QFILTERS = Family(
    kind=names.QFILTERS_KIND_PREFIX,
    codec=QFiltersCodec(),
    rows=Deferred("mlxkv.batched.qfilters:qfilters_rows"),
    decode_step=EVICTION_DECODE_STEP,
    batched_decode_step=EVICTION_BATCH_STEP,
    scheme=(names.QFILTERS_SCHEME, Deferred("mlxkv.caches.qfilters:qfilters_scheme")),
)
FAMILIES = [PLAIN, AFFINE, RING, AFFINE_RING, RECURRENT, TURBO, TOVA, QFILTERS]

for _family in FAMILIES:
    register_family(_family)
register_row_merge(Deferred("mlxkv.batched.rows:merge_rows"))
