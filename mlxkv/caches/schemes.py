"""``make_cache(model, scheme)``: one mlxkv cache per layer of an mlx-lm model.

The model's own ``make_cache`` (when it has one) says what each layer needs: full-attention
layers get the scheme's cache, sliding-window layers stay rotating-plain, recurrent layers
stay arrays. A scheme is parsed by the first entry of ``SCHEMES`` whose pattern matches it;
a new cache family adds one entry.
"""

import re
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

from mlx_lm.models import cache as mlx_cache

from ..errors import SchemeError
from .arrays import ArraysCache
from .masks import ForwardMasks
from .plain import KVCache
from .qfilters import QFILTERS_SCHEME, qfilters_scheme
from .quantized import QuantizedKVCache
from .rotating import RotatingKVCache, RotatingQuantizedKVCache
from .tova import TOVA_SCHEME, tova_scheme
from .transition import Bf16FirstCache, PendingConversion
from .turboquant import TURBO_SCHEME, turbo_scheme


@dataclass(frozen=True)
class Scheme:
    """A parsed scheme: builds the cache of one full-attention layer."""

    name: str
    build: Callable[[int, dict], object]  # (layer index, options) -> cache
    quantizes: bool
    ring: Optional[Callable[[int, int], object]] = None  # (max_size, keep) -> ring cache


def _bf16(m, opts):
    return Scheme(m.string, lambda i, o: KVCache(), False, lambda n, keep: RotatingKVCache(n, keep))


def _affine(m, opts):
    bits, group = int(m["bits"]), int(m["group"] or 64)
    start = m["start"]
    if start is None:
        return Scheme(
            m.string,
            lambda i, o: QuantizedKVCache(group_size=group, bits=bits),
            True,
            lambda n, keep: RotatingQuantizedKVCache(n, keep, group_size=group, bits=bits),
        )
    QuantizedKVCache(group_size=group, bits=bits)  # validate now, not at the conversion
    pending = PendingConversion(
        f"kv{bits}-g{group}",
        int(start),
        lambda c: QuantizedKVCache.from_cache(c, group_size=group, bits=bits),
    )
    return Scheme(m.string, lambda i, o: Bf16FirstCache(pending), True)


SCHEMES: List[tuple] = [
    (r"bf16|fp16|plain", _bf16),
    (r"kv(?P<bits>\d+)(?:-g(?P<group>\d+))?(?:-start(?P<start>\d+))?", _affine),
    (TURBO_SCHEME, turbo_scheme),
    (TOVA_SCHEME, tova_scheme),
    (QFILTERS_SCHEME, qfilters_scheme),
]


def register_scheme(pattern: str, parse: Callable):
    """Add a scheme family: ``parse(match, options) -> Scheme``."""
    SCHEMES.append((pattern, parse))


def parse_scheme(scheme: str, options: Optional[dict] = None) -> Scheme:
    for pattern, parse in SCHEMES:
        m = re.fullmatch(pattern, scheme)
        if m:
            return parse(m, options or {})
    raise SchemeError(
        f"unknown cache scheme {scheme!r}; schemes look like bf16, kv4, kv8-g32, kv4-start256, "
        "turbo-k8v3, turbo-k4v2-start256, tova-b512-s4, qfilters-b512-s4-r128"
    )


def scheme_for_pending(pending: dict) -> PendingConversion:
    """Rebuild a pending conversion from its snapshot entry ``{"scheme", "start"}``."""
    start = int(pending["start"])
    parsed = parse_scheme(f"{pending['scheme']}-start{start}")
    cache = parsed.build(0, {})
    if not isinstance(cache, Bf16FirstCache):
        raise SchemeError(f"scheme {pending['scheme']!r} has no bf16-first form")
    return cache.pending


def model_config(model) -> dict:
    """The model's config: the seeded models' ``mlxkv_config``, else mlx-lm's ``args``."""
    cfg = getattr(model, "mlxkv_config", None)
    if cfg is None:
        args = getattr(model, "args", None)
        cfg = dict(vars(args)) if args is not None else {}
    return cfg


def attention_geometry(model):
    """(kv heads, head dim) of the model's attention layers, from its config; None if unknown."""
    cfg = model_config(model)
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    dim = cfg.get("head_dim")
    if dim is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return heads, dim


def make_cache(model, scheme: str = "bf16", max_kv_size: Optional[int] = None, **options) -> list:
    """Build one mlxkv cache per layer; every cache shares one ``ForwardMasks``.

    ``max_kv_size`` turns full-attention layers into rings of that size keeping the first
    4 positions (mlx-lm's choice), rotating-quantized under an affine scheme.
    """
    parsed = parse_scheme(scheme, options)
    if max_kv_size is not None and parsed.ring is None:
        raise SchemeError(f"scheme {scheme!r} has no ring form: max_kv_size cannot be used with it")
    if hasattr(model, "make_cache"):
        template = model.make_cache()
    else:
        template = [mlx_cache.KVCache() for _ in model.layers]

    heads, dim = attention_geometry(model)
    layer_options = {"n_kv_heads": heads, "head_dim": dim, **options}  # builders check against it
    masks = ForwardMasks()
    caches, warned = [], False
    for i, t in enumerate(template):
        if isinstance(t, mlx_cache.RotatingKVCache):
            if parsed.quantizes and not warned:
                warnings.warn(
                    f"scheme {scheme!r}: sliding-window layers stay rotating-plain (bf16)",
                    stacklevel=2,
                )
                warned = True
            c = RotatingKVCache(t.max_size, t.keep)
        elif isinstance(t, mlx_cache.ArraysCache):
            c = ArraysCache(len(t.cache))
        elif isinstance(t, mlx_cache.KVCache):
            c = parsed.build(i, layer_options) if max_kv_size is None else parsed.ring(max_kv_size, 4)
        else:
            raise SchemeError(
                f"layer {i}: the model asks for an mlx-lm {type(t).__name__}, which has no "
                "mlxkv equivalent yet"
            )
        c.masks = masks
        caches.append(c)
    return caches
