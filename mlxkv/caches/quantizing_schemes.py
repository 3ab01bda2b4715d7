"""The scheme parsers of the two families that quantize: affine (``kv<bits>...``) and
TurboQuant (``turbo-k<k>v<v>...``), the two with a bf16-first form.

A parse checks the scheme's numbers and says whether its caches start bf16
(``Scheme.start``) without importing a cache class: the classes (mlx-lm's subclasses, and
mlx-lm with them) are imported when the scheme builds its first cache. So a header's pending
conversion is checked (``schemes.check_pending``) by a header read, a verification and a
conversion that import nothing of mlx-lm.
"""

from ..families import Scheme
from ..math import turboquant as tq
from ..math.affine import check_affine


def _pending(target: str, start: int, convert):
    from .transition import Bf16FirstCache, PendingConversion

    return Bf16FirstCache(PendingConversion(target, start, convert))


def affine_scheme(m, options) -> Scheme:
    """``kv<bits>[-g<group>][-start<N>]``: mlx-lm's affine layout (group 64 by default), from
    token 0 or bf16-first until ``N`` positions are stored; rings of affine rows under
    ``max_kv_size``."""
    bits, group = int(m["bits"]), int(m["group"] or 64)
    check_affine(bits, group)  # now, not at the first layer or the conversion
    start, target = m["start"], f"kv{bits}-g{group}"
    if start is None:

        def build(i, o):
            from .quantized import QuantizedKVCache

            return QuantizedKVCache(group_size=group, bits=bits)

        def ring(n, keep):
            from .rotating import RotatingQuantizedKVCache

            return RotatingQuantizedKVCache(n, keep, group_size=group, bits=bits)

        return Scheme(target, build, True, ring, policy={"kvScheme": target})  # mlx-bun has no such cache

    def convert(c):
        from .quantized import QuantizedKVCache

        return QuantizedKVCache.from_cache(c, group_size=group, bits=bits)

    policy = {"kvBits": bits, "kvGroupSize": group, "quantizedKvStart": int(start)}
    build = lambda i, o: _pending(target, int(start), convert)
    return Scheme(f"{target}-start{int(start)}", build, True, policy=policy, start=int(start))


def turbo_scheme(m, opts) -> Scheme:
    """``turbo-k<k>v<v>`` and ``turbo-k<k>v<v>-start<N>``: bf16-first TurboQuant (start 0 if absent)."""
    k_bits, v_bits, start = int(m["k"]), int(m["v"]), int(m["start"] or 0)
    tq.check_bits(k_bits, v_bits)  # now, not at the conversion

    def build(i, o):
        from .turboquant import TurboQuantKVCache

        if o.get("head_dim") is not None:  # the model's, from make_cache: refused before any cache is built
            tq.check_head_dim(o["head_dim"])
        deferred, codes = bool(o.get("deferred", True)), bool(o.get("codes", True))
        convert = lambda c: TurboQuantKVCache.from_cache(c, k_bits, v_bits, deferred, codes)
        return _pending(f"turbo-k{k_bits}v{v_bits}", start, convert)

    policy = {"turboQuant": {"kBits": k_bits, "vBits": v_bits}, "quantizedKvStart": start}
    name = f"turbo-k{k_bits}v{v_bits}-start{start}"
    # deferred and codes choose reads, not what is held
    return Scheme(name, build, True, policy=policy, options=("deferred", "codes"), start=start)
