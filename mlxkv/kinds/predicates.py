"""The capability predicates (docs/caches.md): which family a cache belongs to, by its kind,
as its family's record matches it."""

from ..families import kind_of
from .records import AFFINE, AFFINE_RING, PLAIN, QFILTERS, RECURRENT, RING, TOVA, TURBO


def is_plain_kv_cache(cache) -> bool:
    return PLAIN.matches(kind_of(cache))


def is_quantized_kv_cache(cache) -> bool:
    return AFFINE.matches(kind_of(cache))


def is_rotating_plain_cache(cache) -> bool:
    return RING.matches(kind_of(cache))


def is_rotating_quantized_cache(cache) -> bool:
    return AFFINE_RING.matches(kind_of(cache))


def is_turboquant_cache(cache) -> bool:
    return TURBO.matches(kind_of(cache))


def is_recurrent_cache(cache) -> bool:
    return RECURRENT.matches(kind_of(cache))


def is_eviction_cache(cache) -> bool:
    kind = kind_of(cache)
    return TOVA.matches(kind) or QFILTERS.matches(kind)
