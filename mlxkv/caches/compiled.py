"""Compiled-decode concat slots for the plain and affine layouts, and the kind-dispatched
entry ``decode_slot(cache)``.

A slot's step joins the new position to the stored prefix exactly as the ordinary append
does, so the joined window equals the ordinary read's window bit for bit. Which slot a cache
gets is its family's (``mlxkv.families``); a family without one raises
:class:`~mlxkv.errors.UnknownKindError` naming the kind.
"""

import functools

import mlx.core as mx

from ..errors import UnknownKindError
from ..families import family_of_kind, kind_of
from .decode_slot import DecodeSlot
from .transition import Bf16FirstCache


def _plain_step(prefix_keys, prefix_values, keys, values):
    k = mx.concatenate([prefix_keys, keys], axis=2)
    v = mx.concatenate([prefix_values, values], axis=2)
    return k, v, (keys, values)


@functools.cache
def _affine_step(group_size: int, bits: int):
    """The step for ``kv:quant:<bits>:<group>``, one function per layout (so ``mx.compile``
    traces it once): quantize the new position and join each of (codes, scales, biases)."""

    def step(prefix_keys, prefix_values, keys, values):
        def join(prefix, x):
            new = mx.quantize(x, group_size=group_size, bits=bits)
            return tuple(mx.concatenate([p, n], axis=2) for p, n in zip(prefix, new))

        # the commit quantizes the same position again: mx.quantize is deterministic
        return join(prefix_keys, keys), join(prefix_values, values), (keys, values)

    return step


def _prefilled(cache):
    if cache.keys is None:
        raise UnknownKindError(cache.kind, "a compiled decode slot needs a prefilled cache")
    return cache.keys_and_values()


def plain_decode_slot(cache) -> DecodeSlot:
    pk, pv = _prefilled(cache)
    return DecodeSlot(pk, pv, _plain_step, lambda codes: cache.update_and_fetch(*codes))


def affine_decode_slot(cache) -> DecodeSlot:
    pk, pv = _prefilled(cache)
    step = _affine_step(cache.group_size, cache.bits)
    return DecodeSlot(pk, pv, step, lambda codes: cache.update_and_fetch(*codes))


def decode_slot(cache) -> DecodeSlot:
    """The concat slot of one decode step for ``cache``. A bf16-first cache whose conversion
    is due converts first, as its next append would."""
    if isinstance(cache, Bf16FirstCache):
        cache._maybe_convert()
        cache = cache.inner
    kind = kind_of(cache)
    slot = family_of_kind(kind).decode_slot
    if slot is None:
        raise UnknownKindError(kind, "no compiled-decode concat slot for this kind")
    return slot(cache)
