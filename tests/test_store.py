"""The prompt store's RAM tier: the reuse rule per kind, lending (never consuming), duplicates
and supersession, a byte cap that holds, pins, identity. Tests named ``test_regression_*``
pin behaviour mlx-bun's prompt cache had to fix (docs/store.md, "What was fixed")."""

import random

import mlx.core as mx
import numpy as np
import pytest
from store_helpers import KIND_CASES, accepted, build, continuation, forward, same_arrays, snapshot_arrays

import mlxkv
from mlxkv import MLXKVError, PromptStore, StoreCapacityError
from mlxkv.models.seeded import build_model, prompt, tokenizer

CASES = [c for c in KIND_CASES if accepted(c[2])]
CAP = 64 << 20


def _store(model, **kw):
    return PromptStore(model, tokenizer(), cap=kw.pop("cap", CAP), **kw)


def _entry_arrays(store):
    return {e.key: e.arrays for e in store._ram.entries()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_take_lends_and_the_donor_stays_whole(models, case):
    """For every kind: a lent copy continues exactly as the caller's own caches do; appending
    to it (and to a trimmed copy) leaves the stored arrays unchanged; a later take of a
    longer prompt still finds the entry at its full length."""
    _, arch, scheme, opts, n, chunk = case
    model = models(arch)
    tokens = prompt(n, seed=3)
    caches = build(model, scheme, opts, tokens, chunk)
    store = _store(model)
    store.put(tokens, caches)
    (donor,) = _entry_arrays(store).values()
    before = snapshot_arrays(donor)

    more = prompt(6, seed=8)
    hit = store.take(tokens + more)
    assert hit.prefix_len == n and hit.tier == "ram"
    lent_logits = continuation(model, hit.caches, more)
    own_logits = continuation(model, caches, more)  # the caller's caches are still theirs
    np.testing.assert_array_equal(lent_logits, own_logits)

    short = tokens[: n - 5] + prompt(4, seed=9)
    trimmed = store.take(short)
    if trimmed is not None:  # only kinds that can trim lend a shorter prefix
        assert trimmed.prefix_len == n - 5
        continuation(model, trimmed.caches, short[n - 5 :])

    assert same_arrays(snapshot_arrays(donor), before)
    again = store.take(tokens + more)
    assert again.prefix_len == n
    np.testing.assert_array_equal(continuation(model, again.caches, more), lent_logits)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_reuse_rule_per_kind(models, case):
    """A shorter prefix is lent only when every cache can trim, never below the reuse floor;
    the lent copy gives the logits of the stored caches trimmed in place."""
    _, arch, scheme, opts, n, chunk = case
    model = models(arch)
    tokens = prompt(n, seed=3)
    caches = build(model, scheme, opts, tokens, chunk)
    trimmable = all(c.is_trimmable() for c in caches)
    floor = max(c.minimum_reusable_offset for c in caches)
    store = _store(model)
    store.put(tokens, caches)
    for p in (n - 1, n - 10, floor - 1, floor, 1):
        if p < 1:
            continue
        hit = store.take(tokens[:p] + [255 - tokens[p]] if p < n else tokens + [1])
        if p < floor or (not trimmable and p < n):
            assert hit is None, f"p={p}: the entry cannot serve this prefix"
            continue
        assert hit is not None and hit.prefix_len == p
        ref = build(model, scheme, opts, tokens, chunk)
        for c in ref:
            assert c.trim(n - p) == n - p
        nxt = [7, 11]
        np.testing.assert_array_equal(continuation(model, hit.caches, nxt), continuation(model, ref, nxt))


def test_at_least_one_token_is_forwarded_and_exact_duplicates_replace(models):
    model = models("llama")
    tokens = prompt(30)
    store = _store(model)
    store.put(tokens, build(model, "bf16", {}, tokens, 30))
    hit = store.take(tokens)
    assert hit.prefix_len == 29  # mlx-lm's LRUPromptCache would return the whole entry, nothing to forward
    assert store.take(tokens[:1]) is None
    store.put(tokens, build(model, "kv4", {}, tokens, 30))  # same tokens: replaces, whatever it holds
    assert len(store) == 1 and store.take(tokens + [1]).caches[0].kind == "kv:quant:4:64"


def test_regression_trimmable_descendant_supersedes_untrimmable_keeps(models):
    """mlx-bun: a strict prefix-ancestor is superseded only by a fully trimmable descendant;
    a prompt-boundary snapshot survives a longer untrimmable (recurrent, wrapped) entry."""
    llama, hybrid = models("llama"), models("hybrid")
    base = prompt(40)
    store = _store(llama)
    store.put(base[:20], build(llama, "bf16", {}, base[:20], 20))
    store.put(base, build(llama, "bf16", {}, base, 40))
    assert [len(t) for _, t, _, _ in store.entries()] == [40]  # the ancestor is covered: dropped
    assert store.take(base[:20] + [3]).prefix_len == 20  # served by trimming the descendant

    store = _store(hybrid)
    store.put(base[:20], build(hybrid, "bf16", {}, base[:20], 20))
    store.put(base, build(hybrid, "bf16", {}, base, 40))
    assert sorted(len(t) for _, t, _, _ in store.entries()) == [20, 40]
    assert store.take(base[:20] + [3]).prefix_len == 20

    store = _store(llama)
    store.put(base[:20], build(llama, "bf16", {"max_kv_size": 24}, base[:20], 20))
    store.put(base, build(llama, "bf16", {"max_kv_size": 24}, base, 8))  # wrapped
    assert sorted(len(t) for _, t, _, _ in store.entries()) == [20, 40]


def test_regression_an_ancestor_below_the_descendants_floor_is_kept(models):
    """An entry converted at 16 (floor 16) cannot serve a prefix shorter than 16: an ancestor
    stored before the conversion stays (mlx-bun checks the ancestor's length against the
    floor; mlxkv keeps any ancestor holding a prefix the descendant cannot serve)."""
    model = models("llama")
    base = prompt(40)
    store = _store(model)
    store.put(base[:12], build(model, "kv4-start16", {}, base[:12], 12))  # bf16 still: floor 0
    store.put(base, build(model, "kv4-start16", {}, base, 8))  # converted at 16
    assert sorted(len(t) for _, t, _, _ in store.entries()) == [12, 40]
    assert store.take(base[:10] + [1]).prefix_len == 10
    assert store.take(base[:30] + [1]).prefix_len == 30


def test_regression_cap_holds_after_every_call(models):
    """nbytes of all entries <= cap after every put and take (random workload), LRU order."""
    model = models("llama")
    rng = random.Random(0)
    per_token = 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 heads, 64 dims, bf16
    cap = 300 * per_token
    store = _store(model, cap=cap)
    systems = [prompt(24, seed=s) for s in range(3)]
    for i in range(40):
        sysp = rng.choice(systems)
        tokens = sysp + prompt(rng.randint(5, 120), seed=100 + i)
        if rng.random() < 0.5:
            store.take(tokens)
        else:
            store.put(tokens, build(model, "bf16", {}, tokens, 64))
        assert store.nbytes <= cap
        assert store.nbytes == sum(n for _, _, n, _ in store.entries())
    assert len(store) > 0


def test_lru_eviction_and_pins(models):
    model = models("llama")
    per_entry = 20 * 4 * 2 * 2 * 64 * 2
    store = _store(model, cap=3 * per_entry)
    a, b, c, d = (prompt(20, seed=s) for s in range(4))
    for t in (a, b, c):
        store.put(t, build(model, "bf16", {}, t, 20))
    store.pin(a)
    assert store.take(b + [1]) is not None  # b used: c is now the least recently used unpinned
    store.put(d, build(model, "bf16", {}, d, 20))
    held = {tuple(t) for _, t, _, _ in store.entries()}
    assert held == {tuple(a), tuple(b), tuple(d)}
    for t in (b, c, d):  # everything unpinned can go; the pinned entry never
        store.put(t + [1], build(model, "bf16", {}, t + [1], 21))
    assert tuple(a) in {tuple(t) for _, t, _, _ in store.entries()}
    store.cap = per_entry  # a lower cap applies at once
    assert store.nbytes <= per_entry and [tuple(t) for _, t, _, _ in store.entries()] == [tuple(a)]


def test_regression_entry_larger_than_cap_is_refused(models):
    model = models("llama")
    tokens = prompt(20)
    small = _store(model, cap=1000)
    with pytest.raises(StoreCapacityError, match="larger than the store's cap"):
        small.put(tokens, build(model, "bf16", {}, tokens, 20))
    assert len(small) == 0 and small.nbytes == 0
    per_entry = 20 * 4 * 2 * 2 * 64 * 2
    store = _store(model, cap=per_entry + 10)
    store.put(tokens, build(model, "bf16", {}, tokens, 20), pin=True)
    other = prompt(20, seed=5)
    with pytest.raises(StoreCapacityError, match="pinned entries"):
        store.put(other, build(model, "bf16", {}, other, 20))
    assert len(store) == 1 and store.take(tokens + [1]).prefix_len == 20  # nothing held was lost


def test_a_pinned_ancestor_is_never_superseded(models):
    model = models("llama")
    sysp, turn = prompt(24), prompt(30, seed=2)
    store = _store(model)
    store.put(sysp, build(model, "bf16", {}, sysp, 24), pin=True)
    store.put(sysp + turn, build(model, "bf16", {}, sysp + turn, 54))
    assert sorted(len(t) for _, t, _, _ in store.entries()) == [24, 54]


def test_bytes_are_what_the_entry_holds(models):
    """An entry keeps exactly its rows: a plain cache's 256-row growth slack is not kept,
    and nbytes counts each array once."""
    model = models("llama")
    tokens = prompt(30)
    caches = build(model, "bf16", {}, tokens, 30)
    assert caches[0].keys.shape[2] == 256
    store = _store(model)
    store.put(tokens, caches)
    assert store.nbytes == 30 * 4 * 2 * 2 * 64 * 2
    (arrays,) = _entry_arrays(store).values()
    assert all(a.shape[2] == 30 for a in arrays.values())


def test_namespaces_tokenizers_schemes_and_models_never_match(models):
    llama, gemma = models("llama"), models("gemma3")
    tokens = prompt(30)
    caches = build(llama, "bf16", {}, tokens, 30)
    store = _store(llama)
    store.put(tokens, caches, ns="adapter-a")
    assert store.take(tokens + [1]) is None
    assert store.take(tokens + [1], ns="adapter-b") is None
    assert store.take(tokens + [1], ns="adapter-a").prefix_len == 30
    # entries are keyed by the identity: other stores (tokenizer, scheme, model) name
    # different entries, even for the same tokens and namespace
    a = _store(llama)
    b = PromptStore(llama, None, cap=CAP)  # no tokenizer
    c = _store(llama, scheme="kv4")
    d = _store(gemma)
    keys = {s._seed("") for s in (a, b, c, d)}
    assert len(keys) == 4


def test_another_checkpoint_of_the_same_architecture_never_matches(models):
    a, b = models("llama"), build_model("llama", seed=1)
    assert PromptStore(a, cap=1)._seed("") != PromptStore(b, cap=1)._seed("")


def test_put_keeps_nothing_of_the_callers_caches_alive_beyond_its_rows(models):
    """The caller keeps appending to its caches after a put; the entry does not change."""
    model = models("llama")
    tokens = prompt(30)
    caches = build(model, "bf16", {}, tokens, 30)
    store = _store(model)
    store.put(tokens, caches)
    (arrays,) = _entry_arrays(store).values()
    before = snapshot_arrays(arrays)
    forward(model, caches, prompt(40, seed=4), 1)
    assert same_arrays(snapshot_arrays(arrays), before)


def test_an_entry_with_attachments_is_lent_only_whole(models):
    """Attachments (method companion state) are never trimmed: the entry serves prompts that
    extend it, never a shorter prefix, and does not cover its ancestors."""
    model = models("llama")
    tokens = prompt(30)
    store = _store(model)
    store.put(tokens[:20], build(model, "bf16", {}, tokens[:20], 20))
    store.put(tokens, build(model, "bf16", {}, tokens, 30), attachments={"drafter": {"layers": 1}})
    assert sorted(len(t) for _, t, _, _ in store.entries()) == [20, 30]
    hit = store.take(tokens + [1])
    assert hit.prefix_len == 30 and hit.attachments == {"drafter": {"layers": 1}}
    hit = store.take(tokens[:25] + [1])
    assert hit.prefix_len == 20 and hit.attachments is None  # the attached entry cannot trim to 25


def test_tokens_are_checked(models):
    model = models("llama")
    tokens = prompt(10)
    caches = build(model, "bf16", {}, tokens, 10)
    store = _store(model)
    with pytest.raises(mlxkv.SnapshotError, match="tokens must be the exact prefix"):
        store.put(tokens[:9], caches)
    with pytest.raises(mlxkv.MLXKVError, match="ns must be a string"):
        store.put(tokens, caches, ns=None)
    assert store.take([]) is None and store.take(mx.array(tokens)) is None


def test_stats_count_hits_and_reused_tokens(models):
    model = models("llama")
    tokens = prompt(30)
    store = _store(model)
    store.put(tokens, build(model, "bf16", {}, tokens, 30))
    store.take(tokens + [1])
    store.take(prompt(30, seed=9))
    assert store.stats["hits"]["ram"] == 1 and store.stats["misses"] == 1 and store.stats["reused_tokens"] == 30


def test_cost_size_retention_keeps_an_often_reused_prefix(models):
    """GreedyDual-Size-Frequency (mlx-bun's cost-size policy): a small prefix lent often
    outlives larger entries used once, where LRU lets it go; both keep the cap."""
    model = models("llama")
    per_token = 4 * 2 * 2 * 64 * 2
    system = prompt(16, seed=1)
    kept = {}
    for policy in ("lru", "cost-size"):
        store = _store(model, cap=140 * per_token, retention=policy)
        store.put(system, build(model, "bf16", {}, system, 16))
        for i in range(4):
            assert store.take(system + prompt(3, seed=50 + i)).prefix_len == 16
        for i in range(3):  # large, used once: they push the cap
            big = prompt(60, seed=10 + i)
            store.put(big, build(model, "bf16", {}, big, 60))
            assert store.nbytes <= store.cap
        kept[policy] = any(t == system for _, t, _, _ in store.entries())
    assert kept == {"lru": False, "cost-size": True}
    with pytest.raises(mlxkv.MLXKVError, match="retention must be one of"):
        _store(model, retention="fifo")


# -- the prefix index: the longest usable prefix, at the cost of the prompt ---------------


def _brute_best(entries, prompt_tokens, better=0):
    from mlxkv.state.reuse import prefix_for

    best = better
    for tokens, reuse in entries.values():
        p = prefix_for(tokens, reuse, prompt_tokens)
        if p is not None and p > best:
            best = p
    return best


def test_the_index_finds_what_comparing_every_entry_finds():
    """Random entries over a tiny vocabulary (long shared prefixes, many ties), some that
    cannot trim, some with a floor: the index's answer equals the exhaustive one, and so do
    the entries it names as prefixes of a prompt (what a put covers)."""
    from mlxkv.state.reuse import Reuse
    from mlxkv.store.index import PrefixIndex
    from mlxkv.store.keys import block_chain

    rng = random.Random(7)
    block, seed = 4, b"\0" * 32
    for _ in range(30):
        index, entries = PrefixIndex(block), {}
        base = [rng.randrange(3) for _ in range(40)]
        for k in range(rng.randrange(1, 40)):
            n = rng.randrange(1, 40)
            tokens = base[: rng.randrange(n + 1)] + [rng.randrange(3) for _ in range(n)]
            reuse = Reuse(rng.choice([0, 0, 3, 9]), rng.random() < 0.7)
            key = f"{k:04d}"
            entries[key] = (tokens, reuse)
            index.add(key, "", tokens, block_chain(seed, tokens, block))
        for key in rng.sample(sorted(entries), len(entries) // 4):
            index.remove(key)
            del entries[key]
        for _ in range(20):
            q = base[: rng.randrange(41)] + [rng.randrange(3) for _ in range(rng.randrange(8))]

            def usable(key, p, entries=entries):
                tokens, reuse = entries[key]
                return p >= max(reuse.floor, 1) and (p == len(tokens) or reuse.trimmable)

            key, p = index.best("", q, block_chain(seed, q, block), usable)
            assert p == _brute_best(entries, q), (q, p)
            if key is not None:
                assert usable(key, p)
            # what a put of q may cover: the entries that are prefixes of it
            want = sorted(k for k, (t, _) in entries.items() if t == q[: len(t)])
            assert sorted(index.prefixes("", q, block_chain(seed, q, block))) == want


def test_a_lookup_visits_a_few_entries_however_many_share_its_first_token():
    """40,000 entries starting with the same token, a prompt sharing less than one block with
    them: the index asks about a handful of them, not all."""
    from mlxkv.store.index import PrefixIndex
    from mlxkv.store.keys import block_chain

    index, seed = PrefixIndex(64), b"\0" * 32
    for k in range(40_000):
        tokens = [7, 10 + k % 60_000, 10 + k // 60_000]
        index.add(f"{k:05d}", "", tokens, block_chain(seed, tokens, 64))
    asked = []

    def usable(key, p):
        asked.append(key)
        return True

    key, p = index.best("", [7, 5, 5, 5], [], usable)
    assert p == 1 and len(asked) == 1
    asked.clear()
    key, p = index.best("", [7, 10 + 1234, 10, 3], [], usable)
    assert p == 3 and key == "01234" and len(asked) == 1


def test_cache_options_are_part_of_the_identity(models, tmp_path):
    """Two stores on one directory, differing only in max_kv_size (mlx serve's
    --max-kv-size), never serve each other's entries; equal options do."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    ring = _store(model, directory=str(tmp_path), scheme="bf16", cache_options={"max_kv_size": 64})
    ring.put(tokens, build(model, "bf16", {"max_kv_size": 64}, tokens, 40))
    ring.close()
    plain = _store(model, directory=str(tmp_path), scheme="bf16")
    assert plain.opened.indexed == 0 and plain.take(tokens + [1]) is None
    plain.close()
    again = _store(model, directory=str(tmp_path), scheme="bf16", cache_options={"max_kv_size": 64})
    assert again.take(tokens + [1]).prefix_len == 40
    assert again.identity.kv_scheme == "bf16+max_kv_size=64"
    again.close()


def test_the_identity_names_the_canonical_scheme(models):
    """One rule for the store's identity, a server's and a library user's: the canonical form
    of what make_cache builds (canonical_scheme). Aliases are one scheme; options that only
    change how a cache is read are not in it; Q-Filters' filters are named by a digest."""
    model = models("llama")

    def kv_scheme(scheme, **options):
        return PromptStore(model, tokenizer(), cap=CAP, scheme=scheme, cache_options=options).identity.kv_scheme

    assert kv_scheme("kv4") == kv_scheme("kv4-g64") == "kv4-g64"
    assert kv_scheme("kv4", max_kv_size=64) == "kv4-g64+max_kv_size=64"
    assert kv_scheme("turbo-k8v3", deferred=False, codes=True) == kv_scheme("turbo-k8v3-start0") == "turbo-k8v3-start0"
    filters = [mx.ones((2, 64)) for _ in range(4)]
    other = [mx.full((2, 64), 2.0) for _ in range(4)]
    with_filters = kv_scheme("qfilters-b32-s4-r8", filters=filters)
    assert with_filters.startswith("qfilters-b32-s4-r8+filters=") and "+sign=1" in with_filters
    assert with_filters != kv_scheme("qfilters-b32-s4-r8", filters=other)
    assert kv_scheme("qfilters-b32-s4-r8") == "qfilters-b32-s4-r8+calib_tokens=128+sign=1"
    assert kv_scheme("") == ""
    with pytest.raises(MLXKVError, match="need the scheme"):
        kv_scheme("", max_kv_size=64)
    with pytest.raises(MLXKVError, match="no ring form"):
        kv_scheme("turbo-k8v3", max_kv_size=64)


def test_the_open_report_and_counters_say_what_the_store_holds(models, tmp_path):
    model = models("llama")
    tokens = prompt(40, seed=1)
    with _store(model, directory=str(tmp_path)) as s:
        s.put(tokens, build(model, "bf16", {}, tokens, 40))
        s.flush()
    with _store(model, directory=str(tmp_path)) as s:
        ram, disk = s.open_report
        assert (ram.tier, disk.tier, disk.entries) == ("ram", "disk", 1) and disk.where.startswith(str(tmp_path))
        assert "1 entries" in disk.line()
        assert s.take(tokens + [1]).tier == "disk"
        assert s.take(tokens + [1]).tier == "ram"
        assert s.take(prompt(40, seed=9)) is None
        c = s.counters()
        assert c["misses"] == 1 and c["tiers"]["disk"]["hits"] == 1 and c["tiers"]["ram"]["hits"] == 1
        assert c["tiers"]["ram"]["entries"] == 1 and c["tiers"]["disk"]["entries"] == 1
        assert c["tiers"]["disk"]["bytes_read"] >= 40 * 2048 and c["tiers"]["disk"]["healthy"]
