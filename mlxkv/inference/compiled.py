"""Compiled-decode concat slots: the kind-dispatched entry to a compiled decode step.

A compiled decode graph cannot hold a cache object. ``decode_slot(cache)`` prepares, outside
the graph, the stored prefix in the form the cache's ordinary read attends (decoded for
TurboQuant) plus a pure ``step(prefix_keys, prefix_values, keys, values) -> (keys_window,
values_window, codes)`` to run inside ``mx.compile``; ``commit_decode(cache, codes)`` is the
write after the step. The joined window equals the ordinary read's window bit for bit.
Kinds without a slot raise :class:`~mlxkv.errors.UnknownKindError` naming the kind.
"""

import mlx.core as mx

from ..errors import UnknownKindError
from .transition import Bf16FirstCache
from .turboquant import DecodeSlot


def _plain_step(prefix_keys, prefix_values, keys, values):
    k = mx.concatenate([prefix_keys, keys], axis=2)
    v = mx.concatenate([prefix_values, values], axis=2)
    return k, v, (keys, values)


def _storage(cache):
    if isinstance(cache, Bf16FirstCache):
        cache._maybe_convert()  # a due conversion happens before the step, as an append would
        return cache.inner
    return cache


def decode_slot(cache) -> DecodeSlot:
    """The concat slot of one decode step for ``cache`` (kinds ``kv:plain``, ``kv:turboquant:*``)."""
    target = _storage(cache)
    kind = target.kind
    if kind == "kv:plain":
        if target.keys is None:
            raise UnknownKindError(kind, "a compiled decode slot needs a prefilled cache")
        pk, pv = target.keys_and_values()
        return DecodeSlot(pk, pv, _plain_step, False, None)
    if kind.startswith("kv:turboquant:"):
        return target.prepare_decode_step()
    raise UnknownKindError(kind, "no compiled-decode concat slot for this kind")


def commit_decode(cache, codes):
    """Store the step's new position; returns what to evaluate with the step."""
    target = _storage(cache)
    kind = target.kind
    if kind == "kv:plain":
        return target.update_and_fetch(*codes)
    if kind.startswith("kv:turboquant:"):
        return target.commit_decode_step(codes)
    raise UnknownKindError(kind, "no compiled-decode concat slot for this kind")
