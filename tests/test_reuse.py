"""Prefix-reuse rules (docs/caches.md), on real caches."""

import mlx.core as mx
import pytest
from generation import run
from mlx.utils import tree_flatten

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


# -- every family: a prefix is cut by its codec, and a header answers what live caches do ------

FAMILY_CASES = {  # (arch, scheme, options, tokens): each persisted kind, evicted and not
    "kv": ("llama", "bf16", {}, 12),
    "qkv": ("llama", "kv4", {}, 12),
    "rotating": ("gemma3", "bf16", {}, 12),
    "rotating-qkv": ("llama", "kv8-g32", {"max_kv_size": 16}, 12),
    "rotating-wrapped": ("llama", "bf16", {"max_kv_size": 8}, 12),
    "ssm": ("hybrid", "bf16", {}, 12),
    "turboquant": ("llama", "turbo-k8v3", {}, 12),
    "bf16-first": ("llama", "kv4-start16", {}, 12),
    "tova": ("llama", "tova-b16-s2", {}, 12),
    "tova-evicted": ("llama", "tova-b8-s2", {}, 12),
    "qfilters": ("llama", "qfilters-b16-s2-r2", {"calib_tokens": 4}, 12),
    "qfilters-evicted": ("llama", "qfilters-b8-s2-r2", {"calib_tokens": 4}, 12),
}


UNTRIMMABLE = ("ssm", "rotating-wrapped", "tova-evicted", "qfilters-evicted")  # lent whole only


def _stored(case, models):
    """(model, live caches, tokens, header, arrays) of a case: the caches after its prompt,
    encoded as a store keeps them, the header as a reader checks it (dtype and shape in every
    tensor reference)."""
    from mlxkv.formats.mlxkv import encode
    from mlxkv.io.safetensors import dtype_name

    arch, scheme, options, n = FAMILY_CASES[case]
    model = models(arch)
    caches = make_cache(model, scheme, **options)
    run(model, caches, prompt(n))
    header, tensors = encode(caches, prompt(n))
    arrays = dict(tensors)
    for entry in header["caches"]:
        for t in entry["tensors"]:
            t.update(dtype=dtype_name(arrays[t["name"]]), shape=list(arrays[t["name"]].shape))
    return model, caches, prompt(n), header, arrays


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_a_header_answers_the_reuse_rule_as_live_caches_do(case, models):
    from mlxkv.state.reuse import probe, reuse_of

    _, caches, tokens, header, arrays = _stored(case, models)
    assert probe(header) == reuse_of(caches)  # no tensor read, no cache built
    assert probe(header).trimmable == (case not in UNTRIMMABLE)
    assert probe(header) == reuse_of(mlxkv.state.reuse.lend(header, arrays, len(tokens)))


@pytest.mark.parametrize("case", [c for c in FAMILY_CASES if c not in UNTRIMMABLE])
def test_a_lent_prefix_holds_its_positions_only_and_equals_the_trimmed_donor(case, models):
    from mlxkv.kinds.entries import decode_entries
    from mlxkv.state.reuse import lend, probe

    model, _, tokens, header, arrays = _stored(case, models)
    assert probe(header).trimmable
    n, p = len(tokens), 7
    lent = lend(header, arrays, p)
    trimmed = decode_entries(header, {k: a[...] for k, a in arrays.items()})
    for c in trimmed:
        c.trim(n - p)
    for a, b in zip(lent, trimmed):
        assert (a.kind, a.offset, a.minimum_reusable_offset) == (b.kind, b.offset, b.minimum_reusable_offset)
        held = [x for _, x in tree_flatten(vars(getattr(a, "inner", a))) if isinstance(x, mx.array) and x.ndim == 4]
        assert held and all(x.shape[2] <= p for x in held), f"{case}: a lent cache holds rows past its {p} positions"
        same = [
            (x, y) for (_, x), (_, y) in zip(tree_flatten(a.state), tree_flatten(b.state)) if isinstance(x, mx.array)
        ]
        assert same and all(mx.array_equal(x, y[:, :, : x.shape[2]]).item() for x, y in same)  # T is axis 2
    fresh_tail = prompt(3, seed=5)
    assert mx.array_equal(run(model, lent, fresh_tail), run(model, trimmed, fresh_tail))


@pytest.mark.parametrize(
    "name, raised", [("legacy-due-kv4-start8-llama", True), ("legacy-due-turbo-k8v3-llama", False)]
)
def test_a_conversion_due_at_restore_raises_the_floor_a_header_reports(name, raised):
    """An entry written one append after its conversion was due converts as it is restored,
    raising its reuse floor when the conversion starts after position 0: the header-only
    answer says the same."""
    from pathlib import Path

    from mlxkv.state.reuse import probe, reuse_of

    path = str(Path(__file__).parent / "data" / f"{name}.safetensors")
    header = mlxkv.read_header(path)
    assert any("pendingConversion" in e for e in header["caches"])
    assert probe(header) == reuse_of(mlxkv.load(path).caches)
    assert (probe(header).floor > max(e["minimumReusableOffset"] for e in header["caches"])) == raised


@pytest.mark.parametrize("case", ["tova-evicted", "qfilters-evicted", "tova"])
def test_a_reopened_disk_tier_indexes_and_serves_eviction_entries(case, models, tmp_path):
    """The disk tier indexes its files by the header-only answer: eviction entries are
    indexed (not quarantined) and served whole after a restart."""
    arch, scheme, options, n = FAMILY_CASES[case]
    model = models(arch)
    caches = make_cache(model, scheme, **options)
    run(model, caches, prompt(n))
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path)) as store:
        store.put(prompt(n), caches)
        store.flush()
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path)) as store:
        assert (store.opened.indexed, store.opened.quarantined) == (1, [])
        hit = store.take(prompt(n) + [1])
    assert (hit.tier, hit.prefix_len) == ("disk", n)
