"""Compiled-decode concat slots: the kind-dispatched entry to a compiled decode step.

A compiled decode graph cannot hold a cache object. ``decode_slot(cache)`` prepares, outside
the graph, the stored prefix in the form the cache's ordinary read attends (decoded for
TurboQuant, the (codes, scales, biases) tuples for affine) plus a pure ``step(prefix_keys, prefix_values, keys, values) -> (keys_window,
values_window, codes)`` to run inside ``mx.compile``; ``commit_decode(cache, codes)`` is the
write after the step. The joined window equals the ordinary read's window bit for bit.
Kinds without a slot raise :class:`~mlxkv.errors.UnknownKindError` naming the kind.
"""

import functools

import mlx.core as mx

from ..errors import UnknownKindError
from .transition import Bf16FirstCache
from .turboquant import DecodeSlot


def _plain_step(prefix_keys, prefix_values, keys, values):
    k = mx.concatenate([prefix_keys, keys], axis=2)
    v = mx.concatenate([prefix_values, values], axis=2)
    return k, v, (keys, values)


@functools.lru_cache(maxsize=None)
def _affine_step(group_size: int, bits: int):
    """The step for ``kv:quant:<bits>:<group>``, one function per layout (so ``mx.compile``
    traces it once): quantize the new position and join each of (codes, scales, biases)."""

    def step(prefix_keys, prefix_values, keys, values):
        def join(prefix, x):
            new = mx.quantize(x, group_size=group_size, bits=bits)
            return tuple(mx.concatenate([p, n], axis=2) for p, n in zip(prefix, new))

        # the commit quantizes the same bf16 position again: mx.quantize is deterministic
        return join(prefix_keys, keys), join(prefix_values, values), (keys, values)

    return step


def _storage(cache):
    if isinstance(cache, Bf16FirstCache):
        cache._maybe_convert()  # a due conversion happens before the step, as an append would
        return cache.inner
    return cache


def decode_slot(cache) -> DecodeSlot:
    """The concat slot of one decode step for ``cache`` (kinds ``kv:plain``,
    ``kv:quant:*``, ``kv:turboquant:*``)."""
    target = _storage(cache)
    kind = target.kind
    if kind == "kv:plain" or kind.startswith("kv:quant:"):
        if target.keys is None:
            raise UnknownKindError(kind, "a compiled decode slot needs a prefilled cache")
        pk, pv = target.keys_and_values()
        step = _plain_step if kind == "kv:plain" else _affine_step(target.group_size, target.bits)
        return DecodeSlot(pk, pv, step, False, None)
    if kind.startswith("kv:turboquant:"):
        return target.prepare_decode_step()
    raise UnknownKindError(kind, "no compiled-decode concat slot for this kind")


def commit_decode(cache, codes):
    """Store the step's new position; returns what to evaluate with the step."""
    target = _storage(cache)
    kind = target.kind
    if kind == "kv:plain" or kind.startswith("kv:quant:"):
        return target.update_and_fetch(*codes)
    if kind.startswith("kv:turboquant:"):
        return target.commit_decode_step(codes)
    raise UnknownKindError(kind, "no compiled-decode concat slot for this kind")
