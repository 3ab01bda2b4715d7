"""mlx-lm's ``kv_bits`` refused when generation starts, not once ``quantized_kv_start`` is reached.

``mlx_lm.generate(..., kv_bits=4)`` hands every step's caches to
``mlx_lm.generate.maybe_quantize_kv_cache``, which swaps each cache at ``offset >=
quantized_kv_start`` (5000 by default) for mlx-lm's own kind-less ``QuantizedKVCache``. An
mlxkv cache refuses the swap (``CacheContract.to_quantized``); this module wraps mlx-lm's
function once, when it is imported (``caches/base.py`` imports it, so before any mlxkv
cache exists), so the refusal comes at the first call, before any token
is generated, instead of thousands of tokens in. Calls without ``kv_bits`` or without mlxkv
caches reach mlx-lm's function unchanged.

The wrap is installed only if ``mlx_lm.generate`` is already imported, which it always is
where mlx-lm generates: mlx-lm's package ``__init__`` imports it, and importing any mlxkv
cache imports ``mlx_lm.models.cache`` and so the package first (tests/test_mlx_lm_kv_bits.py
checks it in a fresh process). Importing it here instead would cost a process that bypasses
mlx-lm's package (the fresh-interpreter stress scripts) transformers' 2 s.
"""

import functools
import sys


def _refusing(original):
    @functools.wraps(original)
    def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
        if kv_bits is not None:
            for c in prompt_cache:
                if isinstance(getattr(c, "kind", None), str):  # an mlxkv cache (mlx-lm's declare no kind)
                    c.to_quantized(group_size=kv_group_size, bits=kv_bits)  # CacheContract's: raises SchemeError
        return original(prompt_cache, quantized_kv_start, kv_group_size, kv_bits)

    maybe_quantize_kv_cache.refuses_mlxkv_caches = True
    return maybe_quantize_kv_cache


def install_refusal():
    """Wrap mlx-lm's ``maybe_quantize_kv_cache`` (once: a second call finds it wrapped)."""
    mlx_generate = sys.modules.get("mlx_lm.generate")  # the module; its attribute ``generate`` is a function
    if mlx_generate is None:
        return
    current = mlx_generate.maybe_quantize_kv_cache
    if not getattr(current, "refuses_mlxkv_caches", False):
        mlx_generate.maybe_quantize_kv_cache = _refusing(current)


install_refusal()
