"""Kinds and capabilities: the codec registry and the string predicates of DESIGN section 3.

Every dispatch on a cache goes through ``kind`` (a string) and raises
:class:`~mlxkv.errors.UnknownKindError` for a kind nothing handles. A new persisted kind is
one line in ``CODECS``.
"""

from typing import Dict, List

from ..codecs.affine import AffineCodec, RotatingAffineCodec
from ..codecs.arrays import ArraysCodec
from ..codecs.base import Codec
from ..codecs.plain import PlainCodec
from ..codecs.qfilters import QFiltersCodec
from ..codecs.ring import RingCodec
from ..codecs.tova import TOVACodec
from ..codecs.turboquant import TurboQuantCodec
from ..errors import UnknownKindError
from ..caches.base import kind_of

CODECS: List[Codec] = [
    PlainCodec(),
    AffineCodec(),
    RingCodec(),
    RotatingAffineCodec(),
    ArraysCodec(),
    TurboQuantCodec(),
    TOVACodec(),
    QFiltersCodec(),
]


def register_codec(codec: Codec) -> None:
    if any(c.persisted_kind == codec.persisted_kind for c in CODECS):
        raise ValueError(f"persisted kind {codec.persisted_kind!r} is registered already")
    CODECS.append(codec)


def _by_persisted() -> Dict[str, Codec]:
    return {c.persisted_kind: c for c in CODECS}


def known_persisted_kinds() -> List[str]:
    return [c.persisted_kind for c in CODECS]


def codec_for_kind(kind: str) -> Codec:
    """The codec persisting live caches of ``kind``."""
    for c in CODECS:
        if c.handles(kind):
            return c
    if kind.startswith("kv:batched"):
        raise UnknownKindError(kind, "batched layouts have no codec: extract rows to serial caches first")
    raise UnknownKindError(kind, "no codec persists it")


def codec_for_persisted(persisted_kind: str) -> Codec:
    codec = _by_persisted().get(persisted_kind)
    if codec is None:
        raise UnknownKindError(persisted_kind, "persisted kind in a snapshot header")
    return codec


# -- capability predicates: string compares only --------------------------------------


def is_plain_kv_cache(cache) -> bool:
    return kind_of(cache) == "kv:plain"


def is_quantized_kv_cache(cache) -> bool:
    return kind_of(cache).startswith("kv:quant:")


def is_rotating_plain_cache(cache) -> bool:
    return kind_of(cache) == "kv:rotating-plain"


def is_rotating_quantized_cache(cache) -> bool:
    return kind_of(cache).startswith("kv:rotating-quant:")


def is_turboquant_cache(cache) -> bool:
    return kind_of(cache).startswith("kv:turboquant:")


def is_recurrent_cache(cache) -> bool:
    return kind_of(cache) == "ssm"


def is_eviction_cache(cache) -> bool:
    k = kind_of(cache)
    return k.startswith("kv:tova:") or k.startswith("kv:qfilters:")
