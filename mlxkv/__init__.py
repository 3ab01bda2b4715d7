"""mlxkv: the state and persistence layer for MLX key/value caches."""

from .caches.arrays import ArraysCache
from .caches.plain import KVCache
from .caches.qfilters import QFiltersKVCache
from .caches.quantized import QuantizedKVCache
from .caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from .caches.rows import (
    extend,
    extend_model_rows,
    extract_model_row,
    extract_row,
    filter_model_rows,
    filter_rows,
    merge_model_rows,
    merge_rows,
    projected_bytes,
    trim_model_rows,
    trim_rows,
)
from .caches.schemes import make_cache
from .caches.tova import TOVAKVCache
from .caches.transition import Bf16FirstCache
from .caches.turboquant import TurboQuantKVCache
from .errors import (
    CacheConfigError,
    CorruptSnapshotError,
    EmptyCacheError,
    FormatVersionError,
    GeometryMismatchError,
    IdentityMismatchError,
    MLXKVError,
    RowIndexError,
    SchemeError,
    SnapshotError,
    SnapshotWriteError,
    UnknownKindError,
)
from .families import COUNT, FLAG, SIGN, Family, families, register_family, unregister_family
from .state.kinds import (
    is_eviction_cache,
    is_plain_kv_cache,
    is_quantized_kv_cache,
    is_recurrent_cache,
    is_rotating_plain_cache,
    is_rotating_quantized_cache,
    is_turboquant_cache,
)
from .state.prompt_cache import convert_prompt_cache, read_prompt_cache
from .state.session import Sampler, Session
from .state.snapshot import Snapshot, load, read_header, save, verify

__version__ = "0.1.0"

__all__ = [
    "ArraysCache",
    "Bf16FirstCache",
    "CacheConfigError",
    "convert_prompt_cache",
    "CorruptSnapshotError",
    "COUNT",
    "EmptyCacheError",
    "extend",
    "extend_model_rows",
    "extract_model_row",
    "extract_row",
    "families",
    "Family",
    "filter_model_rows",
    "filter_rows",
    "FLAG",
    "FormatVersionError",
    "GeometryMismatchError",
    "IdentityMismatchError",
    "is_eviction_cache",
    "is_plain_kv_cache",
    "is_quantized_kv_cache",
    "is_recurrent_cache",
    "is_rotating_plain_cache",
    "is_rotating_quantized_cache",
    "is_turboquant_cache",
    "KVCache",
    "load",
    "make_cache",
    "merge_model_rows",
    "merge_rows",
    "projected_bytes",
    "MLXKVError",
    "QFiltersKVCache",
    "QuantizedKVCache",
    "read_header",
    "read_prompt_cache",
    "register_family",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "RowIndexError",
    "Sampler",
    "save",
    "SchemeError",
    "Session",
    "SIGN",
    "Snapshot",
    "SnapshotError",
    "SnapshotWriteError",
    "TOVAKVCache",
    "trim_model_rows",
    "trim_rows",
    "TurboQuantKVCache",
    "UnknownKindError",
    "unregister_family",
    "verify",
]
