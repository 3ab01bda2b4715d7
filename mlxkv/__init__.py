"""mlxkv: the state and persistence layer for MLX key/value caches.

``import mlxkv`` is light: it imports the errors and the kind table's API, and nothing of
mlx-lm (nor transformers, which mlx-lm imports). Every other name is imported on first use
(PEP 562), and the kind table's records when the table is first read; ``from mlxkv import
KVCache`` works as before.
"""

import importlib

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
from .families import (
    COUNT,
    FLAG,
    SIGN,
    Family,
    Scheme,
    families,
    register_family,
    unregister_family,
)

__version__ = "0.1.0"

#: each public name imported on first use, and the module that defines it
_LAZY = {
    "extend": ".batched.rows",
    "extend_model_rows": ".batched.rows",
    "extract_model_row": ".batched.rows",
    "extract_row": ".batched.rows",
    "filter_model_rows": ".batched.rows",
    "filter_rows": ".batched.rows",
    "merge_model_rows": ".batched.rows",
    "merge_rows": ".batched.rows",
    "projected_bytes": ".batched.rows",
    "trim_model_rows": ".batched.rows",
    "trim_rows": ".batched.rows",
    "ArraysCache": ".caches.arrays",
    "CompiledDecoder": ".caches.compiled",
    "CompiledModel": ".caches.compiled",
    "compiled_model": ".caches.compiled",
    "KVCache": ".caches.plain",
    "QFiltersKVCache": ".caches.qfilters",
    "QuantizedKVCache": ".caches.quantized",
    "RotatingKVCache": ".caches.rotating",
    "RotatingQuantizedKVCache": ".caches.rotating",
    "make_cache": ".caches.schemes",
    "decode_phase": ".caches.step_builders",
    "TOVAKVCache": ".caches.tova",
    "Bf16FirstCache": ".caches.transition",
    "TurboQuantKVCache": ".caches.turboquant",
    "read_prompt_cache": ".formats.mlxlm",
    "Snapshot": ".formats.snapshot",
    "convert_prompt_cache": ".formats.table",
    "load": ".formats.table",
    "read_header": ".formats.table",
    "save": ".formats.table",
    "verify": ".formats.table",
    "is_eviction_cache": ".kinds.predicates",
    "is_plain_kv_cache": ".kinds.predicates",
    "is_quantized_kv_cache": ".kinds.predicates",
    "is_recurrent_cache": ".kinds.predicates",
    "is_rotating_plain_cache": ".kinds.predicates",
    "is_rotating_quantized_cache": ".kinds.predicates",
    "is_turboquant_cache": ".kinds.predicates",
    "Session": ".session",
    "request_key": ".session",
    "request_policy": ".session",
    "Checkpoint": ".state.checkpoint",
    "Sampler": ".state.sampler",
    "FlushReport": ".store",
    "Hit": ".store",
    "PromptStore": ".store",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
