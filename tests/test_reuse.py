"""Prefix-reuse rules (docs/caches.md), on real caches."""

import mlx.core as mx
import pytest
from generation import run

import mlxkv
from mlxkv.caches.schemes import make_cache
from mlxkv.models.seeded import prompt
from mlxkv.state.reuse import reuse_prefix, usable_prefix


def test_reused_prefix_gives_the_logits_of_a_fresh_prefill(models):
    model = models("llama")
    entry = prompt(20)
    caches = make_cache(model, "bf16")
    run(model, caches, entry)
    new_prompt = entry[:15] + prompt(6, seed=9)
    lent, rest, p = reuse_prefix(entry, caches, new_prompt)
    assert p == 15 and rest == new_prompt[15:] and lent[0].offset == 15
    assert caches[0].offset == 20  # the donor is untouched
    fresh = make_cache(model, "bf16")
    assert mx.array_equal(run(model, lent, rest), run(model, fresh, new_prompt))


def test_at_least_one_token_is_forwarded(models):
    model = models("llama")
    entry = prompt(10)
    caches = make_cache(model, "bf16")
    run(model, caches, entry)
    assert usable_prefix(entry, caches, entry) == 9
    lent, rest, p = reuse_prefix(entry, caches, entry)
    assert rest == entry[9:] and lent[0].offset == 9 and caches[0].offset == 10


def test_minimum_reusable_offset_and_untrimmable_caches(models):
    model = models("llama")
    entry = prompt(24)
    caches = make_cache(model, "kv4-start8")
    run(model, caches, entry[:10])
    run(model, caches, entry[10:])  # converted at offset 10
    assert caches[0].minimum_reusable_offset == 10
    assert usable_prefix(entry, caches, entry[:9] + [1, 2]) is None
    assert usable_prefix(entry, caches, entry[:12] + [1, 2]) == 12
    assert usable_prefix(entry, caches, entry[:12] + [1], attachments={"x": 1}) is None
    hybrid = make_cache(models("hybrid"), "bf16")
    run(models("hybrid"), hybrid, entry)
    assert usable_prefix(entry, hybrid, entry[:12] + [1]) is None  # recurrent state never trims
    assert usable_prefix(entry, hybrid, entry + [1]) == 24  # the whole entry needs no trim
    with pytest.raises(mlxkv.MLXKVError, match="no usable prefix"):
        reuse_prefix(entry, hybrid, [999])
