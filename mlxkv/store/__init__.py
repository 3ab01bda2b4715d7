"""The prompt store (docs/store.md): saved prefixes reused across requests, sessions and
machines, in RAM, on disk and in Redis."""

from .adapter import StorePromptCache
from .generate import generate, stream_generate
from .store import FlushReport, Hit, PromptStore

__all__ = ["FlushReport", "Hit", "PromptStore", "StorePromptCache", "generate", "stream_generate"]
