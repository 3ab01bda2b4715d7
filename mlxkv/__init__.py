"""mlxkv: the state and persistence layer for MLX key/value caches."""

from .batched.rows import (
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
from .caches.arrays import ArraysCache
from .caches.compiled import CompiledDecoder, CompiledModel, compiled_model
from .caches.plain import KVCache
from .caches.qfilters import QFiltersKVCache
from .caches.quantized import QuantizedKVCache
from .caches.rotating import RotatingKVCache, RotatingQuantizedKVCache
from .caches.schemes import make_cache
from .caches.step_builders import decode_phase
from .caches.tova import TOVAKVCache
from .caches.transition import Bf16FirstCache
from .caches.turboquant import TurboQuantKVCache
from .errors import (
    CacheConfigError,
    CorruptSnapshotError,
    EagerDecodeWarning,
    EmptyCacheError,
    FormatVersionError,
    GenerationFinishedError,
    GeometryMismatchError,
    IdentityMismatchError,
    MLXKVError,
    RowIndexError,
    SchemeError,
    SnapshotError,
    SnapshotWriteError,
    StoreCapacityError,
    StoreTrustError,
    UnknownKindError,
    UnsupportedKindError,
)
from .families import COUNT, FLAG, SIGN, Family, Scheme, families, register_family, unregister_family
from .formats.mlxlm import read_prompt_cache
from .formats.snapshot import Snapshot
from .formats.table import convert_prompt_cache, load, read_header, save, verify
from .kinds.predicates import (
    is_eviction_cache,
    is_plain_kv_cache,
    is_quantized_kv_cache,
    is_recurrent_cache,
    is_rotating_plain_cache,
    is_rotating_quantized_cache,
    is_turboquant_cache,
)
from .session import Session, request_key, request_policy
from .state.checkpoint import Checkpoint
from .state.sampler import Sampler
from .store import FlushReport, Hit, PromptStore

__version__ = "0.1.0"

__all__ = [
    "ArraysCache",
    "Checkpoint",
    "Bf16FirstCache",
    "CacheConfigError",
    "CompiledDecoder",
    "CompiledModel",
    "compiled_model",
    "convert_prompt_cache",
    "CorruptSnapshotError",
    "COUNT",
    "decode_phase",
    "EagerDecodeWarning",
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
    "FlushReport",
    "FormatVersionError",
    "GenerationFinishedError",
    "GeometryMismatchError",
    "Hit",
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
    "PromptStore",
    "projected_bytes",
    "MLXKVError",
    "QFiltersKVCache",
    "QuantizedKVCache",
    "read_header",
    "read_prompt_cache",
    "register_family",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "request_key",
    "request_policy",
    "RowIndexError",
    "Sampler",
    "save",
    "Scheme",
    "SchemeError",
    "Session",
    "SIGN",
    "Snapshot",
    "SnapshotError",
    "SnapshotWriteError",
    "StoreCapacityError",
    "StoreTrustError",
    "TOVAKVCache",
    "trim_model_rows",
    "trim_rows",
    "TurboQuantKVCache",
    "UnknownKindError",
    "UnsupportedKindError",
    "unregister_family",
    "verify",
]
