"""What one compiled decode step needs from a cache, prepared outside the compiled graph.

A compiled graph cannot hold a cache object. A cache's slot carries the stored prefix in the
form its ordinary read attends, a pure ``step(prefix_keys, prefix_values, keys, values) ->
(keys_window, values_window, codes)`` to run inside ``mx.compile``, and ``commit(codes)``,
the write after the step (it returns what to evaluate with the step's outputs).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class DecodeSlot:
    prefix_keys: Any  # [B, H, offset, D] as the read attends it (a tuple for affine layouts)
    prefix_values: Any
    step: Callable  # pure and compilable; one function object per layout, so traced once
    commit: Callable  # codes -> stored arrays to evaluate with the step
    rotated: bool = False  # values are in TurboQuant's rotated domain
    finish: Callable[[mx.array], mx.array] | None = None  # e.g. un-rotate the attention output
