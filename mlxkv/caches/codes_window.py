"""TurboQuant codes as the window mlx-lm's attention reads (codes mode).

``update_and_fetch`` returns one :class:`CodesWindow` as both its keys and its values: the
five stored arrays over the attended rows, nothing decoded. The cache shows ``bits``, so
mlx-lm's attention takes its quantized SDPA, which mlxkv routes back to the window
(``mlxkv.caches.routed_reads``): ``attend`` runs attention straight from the codes
(``mlxkv.math.turboquant_attention``).
"""

from dataclasses import dataclass

import mlx.core as mx

from ..math import turboquant_attention as tqa
from .routed_reads import RoutedRead


@dataclass(frozen=True, eq=False)
class CodesWindow(RoutedRead):
    """``stored``: ``(kIdx, kScales, kZeros, vPacked, vScales)``, each ``[B, H, T, width]``."""

    stored: tuple
    k_bits: int
    v_bits: int

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        return tqa.attend(queries, self.stored, self.k_bits, self.v_bits, scale, mask)


def window(stored, k_bits: int, v_bits: int) -> tuple[CodesWindow, CodesWindow]:
    """The stored arrays as the (keys, values) pair a codes read returns: one window, twice."""
    w = CodesWindow(tuple(stored), k_bits, v_bits)
    return w, w
