"""``make_cache(model, scheme)``: one mlxkv cache per layer of an mlx-lm model.

The model's own ``make_cache`` (when it has one; its caches mlx-lm's or mlxkv's) says what
each layer needs: full-attention layers get the scheme's cache, sliding-window layers (rings)
stay rotating-plain, recurrent layers stay arrays. A scheme string is parsed by the family
(``mlxkv.families``) whose scheme pattern matches it.

Parsing a scheme, its canonical form, ``mlxkv schemes`` and what a model says of its layers
import no live cache: ``make_cache`` imports the cache classes (and mlx-lm with them) when
it builds caches, so the kind table's header-level users stay light.
"""

import re
import warnings

from ..checks import is_int
from ..errors import SchemeError
from ..families import Scheme, scheme_families

RING_KEEP = 4  # the first positions a max_kv_size ring keeps (mlx-lm's choice)
#: mlx-lm's generate options that quantize caches; an mlxkv scheme says the same
MLX_LM_QUANTIZATION = ("kv_bits", "kv_group_size", "quantized_kv_start")


#: one scheme of each form, as errors and ``mlxkv schemes`` show them
SCHEME_EXAMPLES = (
    "bf16",
    "kv4",
    "kv8-g32",
    "kv4-start256",
    "turbo-k8v3",
    "turbo-k4v2-start256",
    "tova-b512-s4",
    "qfilters-b512-s4-r128",
)


def parse_scheme(scheme: str, options: dict | None = None) -> Scheme:
    """The scheme named ``scheme``, parsed by the family whose pattern matches it. An option
    the family does not read (``Scheme.options``) is refused by name, before any cache is
    built: a misspelt option would otherwise change nothing, silently."""
    for family in scheme_families():
        pattern, parse = family.scheme
        m = re.fullmatch(pattern, scheme) if isinstance(scheme, str) else None
        if m:
            parsed = parse(m, options or {})
            unknown = sorted(set(options or {}) - set(parsed.options))
            if unknown:
                got = ", ".join(map(repr, unknown))
                takes = (
                    f"its options are {', '.join(parsed.options)} (and make_cache's max_kv_size)"
                    if parsed.options
                    else "it takes no option but make_cache's max_kv_size"
                )
                raise SchemeError(f"scheme {scheme!r}: unknown option {got}; {takes}")
            return parsed
    raise SchemeError(
        f"unknown cache scheme {scheme!r}; schemes look like {', '.join(SCHEME_EXAMPLES)} (`mlxkv schemes` lists them)"
    )


def scheme_grammar() -> list[tuple[str, str]]:
    """(the form, the examples) of every registered family's schemes: ``kv<bits>[-g<group>]``
    read off its pattern."""
    out = []
    for family in scheme_families():
        pattern = family.scheme[0]
        form = re.sub(r"\(\?P<(\w+)>\\d\+\)", r"<\1>", pattern)
        form = re.sub(r"\(\?:([^()]*)\)\?", r"[\1]", form).replace("|", " | ")
        examples = [e for e in SCHEME_EXAMPLES if re.fullmatch(pattern, e)]
        out.append((form, ", ".join(examples) or "-"))
    return out


def check_pending(pending: dict, options: dict | None = None):
    """The parsed bf16-first scheme a snapshot entry's ``{"scheme", "start"}`` names, or
    :class:`SchemeError`; builds no cache (a header check imports no live cache)."""
    start = int(pending["start"])
    parsed = parse_scheme(f"{pending['scheme']}-start{start}", options)
    if parsed.start is None:
        raise SchemeError(f"scheme {pending['scheme']!r} has no bf16-first form")
    return parsed


def scheme_for_pending(pending: dict, options: dict | None = None):
    """Rebuild a pending conversion from its snapshot entry ``{"scheme", "start"}`` (with
    ``make_cache`` options such as TurboQuant's ``codes``; the read is not stored): the
    ``PendingConversion`` of the scheme's bf16-first cache."""
    return check_pending(pending, options).build(0, options or {}).pending


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


def layer_template(model) -> list | None:
    """The caches the model asks for, one per layer, as mlx-lm builds them (its own
    ``make_cache``; under ``mlxkv serve``'s factory the model's original one), or None for a
    model without one (one plain cache per ``model.layers``)."""
    make = getattr(model, "make_cache", None)
    make = getattr(make, "layer_template", make)
    return make() if make is not None else None


def layer_count(model) -> int:
    """How many caches the model takes: its own template's (mlx-lm's empty cache objects,
    the only statement a model makes of it), else one per ``model.layers``; no mlxkv cache
    is built."""
    template = layer_template(model)
    return len(template) if template is not None else len(model.layers)


def _check_ring(parsed: Scheme, scheme: str, max_kv_size) -> None:
    """``max_kv_size`` is a ring size the scheme can build (refused before any cache is)."""
    if parsed.ring is None:
        raise SchemeError(f"scheme {scheme!r} has no ring form: max_kv_size cannot be used with it")
    if not is_int(max_kv_size) or max_kv_size <= RING_KEEP:
        raise SchemeError(
            f"max_kv_size must be an integer above the {RING_KEEP} positions a ring keeps, got {max_kv_size!r}"
        )


def canonical_scheme(scheme: str, max_kv_size: int | None = None, **options) -> str:
    """The canonical form of what ``make_cache(model, scheme, max_kv_size, **options)`` builds:
    two calls (on one model) give the same string exactly when their caches hold the same
    things. It is the scheme's canonical name (``Scheme.name``: ``kv4`` and ``kv4-g64`` are
    ``kv4-g64``) followed by ``+name=value`` for every option that changes what the caches
    hold, sorted by name: ``bf16+max_kv_size=256``, ``qfilters-b32-s4-r8+calib_tokens=16+sign=1``.
    Options that only change how a cache is read (TurboQuant's ``deferred`` and ``codes``) are
    left out: they change rounding, as the prefill chunk does, not what is stored.

    A bad scheme or option raises ``SchemeError`` here, as ``make_cache`` would."""
    parsed = parse_scheme(scheme, options)
    held = dict(parsed.held)
    if max_kv_size is not None:
        _check_ring(parsed, scheme, max_kv_size)
        held["max_kv_size"] = max_kv_size
    return parsed.name + "".join(f"+{k}={held[k]}" for k in sorted(held))


def codes_read(model, scheme: str, codes: bool | None) -> bool:
    """Whether a scheme with a codes read (TurboQuant's ``codes``) reads codes on ``model``:
    ``codes`` as given, or, unset, whether the model's attention hands the window straight
    to mlx-lm's SDPA (``mlxkv.caches.attention_sites``); else the decoded window. ``codes=True``
    on a model whose attention reads the window as arrays or passes sinks is refused: it
    would fail at the first decode."""
    from .attention_sites import window_reader

    if codes is not None and not codes:
        return False
    reason = window_reader(model)
    if codes and reason:
        raise SchemeError(
            f"scheme {scheme!r} with codes=True: this model's attention needs the decoded window ({reason}); "
            "leave codes unset (mlxkv then reads the decoded window for this model) or give codes=False"
        )
    return reason is None


def fit_reads(model, caches: list, codes: bool | None = None) -> list:
    """Give restored ``caches`` the read ``make_cache(model, ...)`` gives a new cache: a
    snapshot does not record how a cache is read (TurboQuant's ``codes``: a property of the
    model's attention, :func:`codes_read`), so a cache restored without its model reads
    codes. On ``model`` every TurboQuant cache, and every pending conversion to one, reads as
    ``codes_read(model, ..., codes)`` says. Returns ``caches``."""
    from .transition import Bf16FirstCache
    from .turboquant import TurboQuantKVCache

    def held(c):
        return c.inner if isinstance(c, Bf16FirstCache) else c

    pending = [
        c
        for c in caches
        if isinstance(c, Bf16FirstCache) and not c.converted and "codes" in check_pending(c.pending_conversion).options
    ]
    quantized = [c for c in caches if isinstance(held(c), TurboQuantKVCache)]
    if not pending and not quantized:
        return caches
    flag = codes_read(model, "restored TurboQuant caches", codes)
    for c in quantized:
        held(c).codes = flag
    for c in pending:
        c.pending = scheme_for_pending(c.pending_conversion, {"codes": flag})
    return caches


def make_cache(model, scheme: str = "bf16", max_kv_size: int | None = None, **options) -> list:
    """Build one mlxkv cache per layer; every cache shares one ``ForwardMasks``.

    ``max_kv_size`` turns full-attention layers into rings of that size keeping the first
    4 positions (mlx-lm's choice), rotating-quantized under an affine scheme.
    """
    from mlx_lm.models import cache as mlx_cache

    from .arrays import ArraysCache
    from .base import CacheContract
    from .masks import ForwardMasks
    from .rotating import RotatingKVCache

    mlx_lm_quantization = sorted(set(options) & set(MLX_LM_QUANTIZATION))
    if mlx_lm_quantization:
        bits, group = options.get("kv_bits", 4), options.get("kv_group_size", 64)
        start = options.get("quantized_kv_start")
        scheme = f"kv{bits}-g{group}" + ("" if start is None else f"-start{start}")
        raise SchemeError(
            f"make_cache: {', '.join(mlx_lm_quantization)} are mlx-lm's generate options, not mlxkv's: "
            f"give them in the scheme, make_cache(model, {scheme!r})"
        )
    parsed = parse_scheme(scheme, options)
    if max_kv_size is not None:
        _check_ring(parsed, scheme, max_kv_size)
    template = layer_template(model)
    if template is None:
        template = [mlx_cache.KVCache() for _ in model.layers]

    heads, dim = attention_geometry(model)
    layer_options = {"n_kv_heads": heads, "head_dim": dim, **options}  # builders check against it
    if "codes" in parsed.options:
        layer_options["codes"] = codes_read(model, scheme, options.get("codes"))
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
        elif isinstance(t, (mlx_cache.KVCache, mlx_cache.QuantizedKVCache, CacheContract)):
            # a full-attention layer: mlx-lm's caches, or mlxkv's (a model whose make_cache is mlxkv's)
            c = parsed.build(i, layer_options) if max_kv_size is None else parsed.ring(max_kv_size, RING_KEEP)
        else:
            cls = type(t)
            raise SchemeError(
                f"layer {i}: the model's make_cache gives a {cls.__module__}.{cls.__qualname__}, "
                "for which mlxkv has no cache yet"
            )
        c.masks = masks
        caches.append(c)
    return caches
