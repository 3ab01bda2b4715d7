"""A parsed cache scheme: how to build the cache of one full-attention layer.

Each family that a scheme string can name (``bf16``, ``kv4``, ``turbo-k8v3``, ...) declares
``(pattern, parse)`` in its kind record; ``parse(match, options)`` returns a :class:`Scheme`.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str
    build: Callable[[int, dict], object]  # (layer index, options) -> cache
    quantizes: bool  # sliding-window layers stay bf16 under it (make_cache warns)
    ring: Callable[[int, int], object] | None = None  # (max_size, keep) -> ring cache
    #: what a generation's request key says of the scheme (docs/sessions.md): mlx-bun's fields
    #: where mlx-bun builds the same caches, else None: ``{"kvScheme": name}``
    policy: dict | None = None
