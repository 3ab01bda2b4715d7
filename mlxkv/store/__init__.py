"""The prompt store (docs/store.md): saved prefixes reused across requests, sessions and
machines, in RAM, on disk and in Redis."""

from .adapter import StoreOptions, StorePromptCache
from .generate import generate, stream_generate
from .store import Hit, PromptStore
from .trust import namespace_key
from .writelog import FlushReport

__all__ = [
    "FlushReport",
    "Hit",
    "PromptStore",
    "StoreOptions",
    "StorePromptCache",
    "generate",
    "namespace_key",
    "stream_generate",
]
