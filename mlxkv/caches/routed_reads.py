"""Reads that mlx-lm's own attention hands back to mlxkv.

mlx-lm's models attend with ``mlx_lm.models.base.scaled_dot_product_attention(queries, keys,
values, cache=cache, scale=, mask=)``, which takes the module's
``quantized_scaled_dot_product_attention`` when ``hasattr(cache, "bits")`` and mx.fast's dense
kernel otherwise. A cache whose read is neither (a bf16-first batch whose rows attend in two
precisions, ``mlxkv.batched.bf16first``; TurboQuant's codes, ``mlxkv.caches.codes_window``)
returns a :class:`RoutedRead` from ``update_and_fetch`` as its keys and values and shows
``bits`` and ``group_size``; this module
wraps mlx-lm's quantized SDPA once, when it is imported, so that a ``RoutedRead`` attends
through its own ``attend(queries, scale, mask)``. Every other call reaches mlx-lm's function
unchanged, with the same arguments: no cache but an mlxkv routed read computes anything else.
"""

import functools

from mlx_lm.models import base as mlx_base


class RoutedRead:
    """What a cache's ``update_and_fetch`` returned, attended by the read itself."""

    def attend(self, queries, scale: float, mask):  # pragma: no cover - every read overrides it
        raise NotImplementedError

    def taken(self, rows):  # pragma: no cover - a read a split takes rows of overrides it
        """This read over the batch rows ``rows`` only (an int32 array of row indices)."""
        raise NotImplementedError


def _routing(original):
    @functools.wraps(original)
    def quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        if isinstance(q_keys, RoutedRead):
            return q_keys.attend(queries, scale, mask)
        return original(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    quantized_scaled_dot_product_attention.routes_mlxkv_reads = True
    return quantized_scaled_dot_product_attention


def install_route():
    """Wrap mlx-lm's quantized SDPA (once: a second call, or a reload, finds it wrapped)."""
    current = mlx_base.quantized_scaled_dot_product_attention
    if not getattr(current, "routes_mlxkv_reads", False):
        mlx_base.quantized_scaled_dot_product_attention = _routing(current)


install_route()
