"""The kind-dispatched compiled-decode slot: same window as the ordinary read, loud errors."""

import mlx.core as mx
import pytest

import mlxkv
from mlxkv.caches.compiled import decode_slot
from mlxkv.caches.schemes import parse_scheme


def _filled(cache, T=12, seed=0):
    k = mx.random.normal((1, 2, T, 64), key=mx.random.key(seed)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, T, 64), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    cache.update_and_fetch(k, v)
    return cache


def _same(x, y):
    """Equal arrays, or equal tuples of arrays (the affine layout)."""
    if isinstance(x, tuple):
        return len(x) == len(y) and all(mx.array_equal(p, q).item() for p, q in zip(x, y))
    return mx.array_equal(x, y).item()


@pytest.mark.parametrize(
    "make",
    [mlxkv.KVCache, lambda: mlxkv.QuantizedKVCache(32, 4), lambda: mlxkv.TurboQuantKVCache(8, 3, deferred=False)],
    ids=["plain", "affine", "turbo"],
)
def test_compiled_step_joins_the_window_the_ordinary_read_sees(make):
    a, b = _filled(make()), _filled(make())
    step = None
    for i in range(3):  # consecutive steps reuse one traced function
        k = mx.random.normal((1, 2, 1, 64), key=mx.random.key(7 + 2 * i)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, 1, 64), key=mx.random.key(8 + 2 * i)).astype(mx.bfloat16)
        slot = decode_slot(a)
        assert step is None or slot.step is step
        step = slot.step
        kw, vw, codes = mx.compile(slot.step)(slot.prefix_keys, slot.prefix_values, k, v)
        mx.eval(slot.commit(codes))
        rk, rv = b.update_and_fetch(k, v)
        assert _same(kw, rk) and _same(vw, rv)
    assert a.offset == b.offset == 15
    assert all(mx.array_equal(x, y) for x, y in zip(a.dense_window(), b.dense_window()))


def test_bf16_first_cache_converts_before_its_slot():
    cache = parse_scheme("turbo-k4v2-start13").build(0, {})
    _filled(cache)
    slot = decode_slot(cache)  # short of its start: the slot is the plain one
    assert cache.kind == "kv:plain" and slot.prefix_keys.shape[2] == 12
    k = mx.zeros((1, 2, 1, 64), mx.bfloat16)
    mx.eval(slot.commit((k, k)))  # the commit reaches 13 behind the wrapper's back
    slot = decode_slot(cache)  # the conversion is due: the slot is TurboQuant's
    assert cache.kind == "kv:turboquant:4:2" and slot.prefix_keys.shape[2] == 13


def test_kinds_without_a_slot_are_named():
    with pytest.raises(mlxkv.UnknownKindError, match="kv:rotating-plain"):
        decode_slot(_filled(mlxkv.RotatingKVCache(32)))
    with pytest.raises(mlxkv.UnknownKindError, match="kv:tova:16:2"):
        decode_slot(_filled(mlxkv.TOVAKVCache(16, 2)))
