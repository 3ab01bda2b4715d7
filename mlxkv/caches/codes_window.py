"""TurboQuant codes as the window mlx-lm's attention reads (codes mode).

``update_and_fetch`` returns one :class:`CodesWindow` as both its keys and its values: the
five stored arrays over the attended rows, nothing decoded. The cache shows ``bits``, so
mlx-lm's attention takes its quantized SDPA, which mlxkv routes back to the window
(``mlxkv.caches.routed_reads``): ``attend`` runs attention straight from the codes
(``mlxkv.math.turboquant_attention``).
"""

from dataclasses import dataclass

import mlx.core as mx

from ..math import turboquant as tq
from ..math import turboquant_attention as tqa
from .routed_reads import RoutedRead


@dataclass(frozen=True, eq=False)
class CodesWindow(RoutedRead):
    """``stored``: ``(kIdx, kScales, kZeros, vPacked, vScales)``, each ``[B, H, T, width]``;
    only the first ``rows`` rows hold positions (None: all of them).

    A cache hands its whole buffer with ``rows`` set, so a decode step reads the arrays as
    they are: a slice of them (a view across the heads' strides) would be copied by the
    first product that reads it. One query position unmasked attends the first ``rows``
    with the rest masked, which gives the same floats as attending exactly those rows (the
    masked scores are exactly zero after the softmax, and add nothing), as the compiled
    step does; any other query is attended over the sliced rows."""

    stored: tuple
    k_bits: int
    v_bits: int
    rows: int | None = None

    def taken(self, rows: mx.array) -> "CodesWindow":
        return CodesWindow(tuple(mx.take(a, rows, axis=0) for a in self.stored), self.k_bits, self.v_bits, self.rows)

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        stored, rows = self.stored, self.rows
        if rows is not None and rows < stored[0].shape[2]:
            if mask is None and queries.shape[2] == 1:
                mask = mx.arange(stored[0].shape[2]) < rows
            else:
                stored = tuple(a[..., :rows, :] for a in stored)
        return tqa.attend(queries, stored, self.k_bits, self.v_bits, scale, mask)


class CodesReader:
    """Mixin of a TurboQuant store or storage with ``k_bits``, ``v_bits`` and ``codes``: its
    window is a quantized window (mlx-lm routes on ``bits``) when it reads the codes, named by
    kBits and the 32-group."""

    group_size = tq.GROUP

    @property
    def quantized_window(self) -> bool:
        return self.codes

    @property
    def bits(self) -> int:
        return self.k_bits


def window(stored, k_bits: int, v_bits: int, rows: int | None = None) -> tuple[CodesWindow, CodesWindow]:
    """The stored arrays as the (keys, values) pair a codes read returns: one window, twice."""
    w = CodesWindow(tuple(stored), k_bits, v_bits, rows)
    return w, w
