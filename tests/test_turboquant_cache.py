"""TurboQuantKVCache: storage, reads (eager and deferred), conversion, compiled decode step."""

import warnings

import mlx.core as mx
import mlx_lm
import pytest
from generation import greedy, run
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv import CacheConfigError, TurboQuantKVCache
from mlxkv.caches.base import row_bytes
from mlxkv.caches.masks import ForwardMasks
from mlxkv.caches.schemes import make_cache
from mlxkv.math import turboquant as tq
from mlxkv.models.seeded import prompt, tokenizer
from mlxkv.quality import NamedReadSite, greedy_flips, named_read_attention, teacher_forced_logprobs


def kv(L, d=64, H=2, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, H, L, d), key=mx.random.key(seed)) * 2 + 0.5
    v = mx.random.normal((1, H, L, d), key=mx.random.key(seed + 1000))
    return k.astype(dtype), v.astype(dtype)


def stored_equal(a, b):
    return all(mx.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


# -- identity and construction ----------------------------------------------------------


def test_kind_no_bits_and_not_a_plain_cache():
    c = TurboQuantKVCache(8, 3)
    assert c.kind == "kv:turboquant:8:3" and mlxkv.is_turboquant_cache(c)
    assert not hasattr(c, "bits") and not isinstance(c, mlx_cache.KVCache)
    c.update_and_fetch(*kv(3))
    assert not hasattr(c, "bits")
    assert TurboQuantKVCache(2, 5).kind == "kv:turboquant:2:5"


def test_bad_configurations_raise_before_anything_is_stored():
    with pytest.raises(CacheConfigError, match=r"kBits must be one of \(2, 4, 5, 8\)"):
        TurboQuantKVCache(3, 3)
    with pytest.raises(CacheConfigError, match=r"vBits must be one of \(2, 3, 4, 5, 8\)"):
        TurboQuantKVCache(8, 7)
    with pytest.raises(CacheConfigError, match="head_dim in"):
        TurboQuantKVCache(8, 3, head_dim=80)
    c = TurboQuantKVCache(8, 3)
    with pytest.raises(CacheConfigError, match=r"head_dim in \(64, 128, 256, 512\)"):
        c.update_and_fetch(*kv(2, d=96))
    assert c.storage is None and c.offset == 0
    with pytest.raises(mlxkv.SchemeError, match="unknown cache scheme"):
        make_cache(None, "turbo-k8")
    with pytest.raises(CacheConfigError, match="kBits"):
        make_cache(None, "turbo-k3v3")


# -- storage ----------------------------------------------------------------------------


def test_appends_encode_only_the_new_tokens(monkeypatch):
    seen = []
    real = tq.encode_codes
    monkeypatch.setattr(tq, "encode_codes", lambda k, v, a, b: seen.append(k.shape[2]) or real(k, v, a, b))
    k, v = kv(13)
    c = TurboQuantKVCache(4, 2)
    c.update_and_fetch(k[:, :, :8], v[:, :, :8])
    before = [mx.array(a) for a in c.state]
    c.update_and_fetch(k[:, :, 8:12], v[:, :, 8:12])
    c.update_and_fetch(k[:, :, 12:], v[:, :, 12:])
    assert seen == [8, 4, 1]
    assert stored_equal([a[..., :8, :] for a in c.state], before)  # earlier rows untouched
    assert stored_equal(c.state, tq.encode(k, v, 4, 2))  # per-position codes: chunking is invisible


def test_storage_grows_in_256_row_steps_and_state_is_sliced_to_offset():
    c = TurboQuantKVCache(5, 3)
    c.update_and_fetch(*kv(1, d=128))
    assert c.storage[0].shape[2] == 256
    c.update_and_fetch(*kv(255, d=128, seed=1))
    assert c.offset == 256 and c.storage[0].shape[2] == 256
    c.update_and_fetch(*kv(300, d=128, seed=2))
    assert c.offset == 556 and c.storage[0].shape[2] == 768
    st = c.state
    assert [a.shape for a in st] == [(1, 2, 556, 80), (1, 2, 556, 4), (1, 2, 556, 4), (1, 2, 556, 48), (1, 2, 556, 4)]
    assert [a.dtype for a in st] == [mx.uint8, mx.float16, mx.float16, mx.uint8, mx.float16]
    assert c.nbytes == sum(a.nbytes for a in c.storage)
    assert TurboQuantKVCache(8, 3).state == []
    k8 = TurboQuantKVCache(8, 8)
    k8.update_and_fetch(*kv(2))
    assert k8.state[0].dtype == mx.int8 and k8.state[0].shape[-1] == 64 and k8.state[3].shape[-1] == 64


def test_trim_is_always_allowed_and_byte_safe():
    k, v = kv(20)
    c = TurboQuantKVCache(8, 3)
    c.update_and_fetch(k, v)
    assert c.is_trimmable() and c.trim(7) == 7 and c.offset == 13
    k2, v2 = kv(4, seed=9)
    c.update_and_fetch(k2, v2)
    ref = TurboQuantKVCache(8, 3)
    ref.update_and_fetch(mx.concatenate([k[:, :, :13], k2], 2), mx.concatenate([v[:, :, :13], v2], 2))
    assert stored_equal(c.state, ref.state)
    assert c.trim(100) == 17 and c.offset == 0 and c.is_trimmable()


@pytest.mark.parametrize("kb", tq.K_BITS)
@pytest.mark.parametrize("vb", tq.V_BITS)
def test_bytes_per_token_is_what_the_storage_holds(kb, vb):
    c = TurboQuantKVCache(kb, vb)
    assert c.bytes_per_token() == 0
    c.update_and_fetch(*kv(3, d=128, H=4))
    per_head = 128 * kb // 8 + 128 * vb // 8 + 3 * (128 // 32) * 2
    assert c.bytes_per_token() == 4 * per_head == row_bytes(*c.state)
    if (kb, vb) == (8, 3):
        assert per_head == 200


def test_make_mask_is_the_shared_causal_mask():
    c = TurboQuantKVCache(8, 3)
    c.masks = shared = ForwardMasks()
    c.update_and_fetch(*kv(5))
    assert c.make_mask(1) is None and c.make_mask(4) == "causal"
    m = c.make_mask(4, return_array=True)
    assert m is shared.causal(4, 5, None, True)
    assert mx.array_equal(m, mx.tril(mx.ones((4, 9), mx.bool_), k=5))


def test_update_and_fetch_returns_the_decoded_window_in_the_input_dtype():
    k, v = kv(6, dtype=mx.bfloat16)
    c = TurboQuantKVCache(4, 4)
    dk, dv = c.update_and_fetch(k, v)
    assert dk.dtype == dv.dtype == mx.bfloat16 and dk.shape == k.shape
    ek, ev = tq.decode(tq.encode(k, v, 4, 4), 4, 4)
    assert mx.array_equal(dk, ek.astype(mx.bfloat16)) and mx.array_equal(dv, ev.astype(mx.bfloat16))
    sk, sv = c.dense_window()
    assert mx.array_equal(sk, dk) and mx.array_equal(sv, dv)


# -- reads ------------------------------------------------------------------------------


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (5, 8)])
def test_deferred_read_agrees_with_the_eager_read(kb, vb):
    k, v = kv(24, d=128)
    q = mx.random.normal((1, 4, 24, 128), key=mx.random.key(7))
    eager, deferred = TurboQuantKVCache(kb, vb, deferred=False), TurboQuantKVCache(kb, vb)
    ra, rb = eager.append_window(k, v), deferred.append_window(k, v)
    assert ra.finish is None and rb.finish is not None
    assert not mx.allclose(rb.values, ra.values, atol=1e-2).item()  # the values really stay rotated
    a, b = ra.attend(q, 128**-0.5), rb.attend(q, 128**-0.5)
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
    k1, v1 = kv(1, d=128, seed=3)
    q1 = q[:, :, :1]
    a1 = eager.append_decode(k1, v1).attend(q1, 0.1)
    b1 = deferred.append_decode(k1, v1).attend(q1, 0.1)
    c1 = eager.append_decode(k1, v1, deferred=True)  # per-call choice on an eager cache
    assert c1.finish is not None and eager.offset == 26
    assert mx.allclose(a1, b1, atol=1e-5).item()
    with pytest.raises(mlxkv.MLXKVError, match="one position"):
        eager.append_decode(k, v)


@pytest.fixture
def named_read_sites():
    """The seeded architectures' attention calls on a ``NamedReadSite`` attend through its read."""
    with named_read_attention():
        yield


def turbo_caches(model, kb, vb, deferred, codes=False, site=None):
    """The model's layout with TurboQuant (from token zero) on the full-attention layers,
    behind named-read sites when the read is not the eager one (or ``site`` says so)."""
    caches = make_cache(model, "bf16")
    out = []
    for c in caches:
        if c.kind == "kv:plain":
            t = TurboQuantKVCache(kb, vb, deferred=deferred, codes=codes)
            t.masks = c.masks
            c = NamedReadSite(t) if (deferred or codes if site is None else site) else t
        out.append(c)
    return out


def logprob_trace(model, caches, tokens, n):
    steps = generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=caches)
    return [(int(t), lp) for t, lp in steps]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eager_and_deferred_run_inside_mlx_lm_generate(models, named_read_sites, arch):
    model, tok = models(arch), tokenizer()
    eager, deferred = turbo_caches(model, 4, 3, False), turbo_caches(model, 4, 3, True)
    p = prompt(24, seed=4)
    a, b = logprob_trace(model, eager, p, 5), logprob_trace(model, deferred, p, 5)
    assert len(a) == len(b) == 5
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb and mx.allclose(la, lb, atol=0.25).item()  # bf16: V rounded in another basis
    assert mx.abs(a[0][1] - b[0][1]).max().item() > 0  # the deferred path really ran
    full = [c for c in deferred if isinstance(c, NamedReadSite)]
    assert full and all(c.read.finish is not None and c.offset == 29 for c in full)
    for caches in (eager, deferred):
        text = mlx_lm.generate(model, tok, prompt(10, seed=5), max_tokens=4, prompt_cache=caches)
        assert isinstance(text, str) and all(c.offset >= 39 for c in caches)


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (2, 5), (5, 8)])
@pytest.mark.parametrize("d", [64, 128])
def test_codes_read_agrees_with_the_exact_read(kb, vb, d):
    """float32: equal up to summation order; bfloat16: closer to float32 attention over the
    decoded window than the exact read (which rounds the window to bfloat16)."""
    k, v = kv(40, d=d, H=2)
    q = mx.random.normal((1, 6, 3, d), key=mx.random.key(9))
    for dtype, tol in ((mx.float32, 1e-5), (mx.bfloat16, None)):
        exact, fast = TurboQuantKVCache(kb, vb, deferred=False), TurboQuantKVCache(kb, vb, codes=True)
        ra, rb = (
            exact.append_window(k.astype(dtype), v.astype(dtype)),
            fast.append_window(k.astype(dtype), v.astype(dtype)),
        )
        assert stored_equal(exact.state, fast.state)  # the read never changes what is stored
        a, b = ra.attend(q.astype(dtype), d**-0.5), rb.attend(q.astype(dtype), d**-0.5)
        assert b.dtype == dtype and b.shape == (1, 6, 3, d)
        if tol is not None:
            assert mx.abs(a - b).max().item() < tol
        else:
            dk, dv = tq.decode(fast.state, kb, vb)
            truth = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=d**-0.5, mask="causal")
            assert (
                mx.abs(b.astype(mx.float32) - truth).max().item() <= mx.abs(a.astype(mx.float32) - truth).max().item()
            )
    k1, v1 = kv(1, d=d, seed=5)
    read = fast.append_decode(k1.astype(mx.bfloat16), v1.astype(mx.bfloat16))
    assert read.mask is None and mx.array_equal(read.keys, tq.decode(fast.state, kb, vb)[0].astype(mx.bfloat16))
    plain = fast.append_decode(k1.astype(mx.bfloat16), v1.astype(mx.bfloat16), codes=False, deferred=False)
    assert plain.finish is None and not hasattr(plain, "stored")  # the exact read, per call


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
def test_codes_read_inside_mlx_lm_generate(models, named_read_sites, arch):
    """float32 seeded models: the same greedy tokens as the exact read, log-probabilities
    within 1e-3; bfloat16: teacher-forced log-probabilities within 0.25 (the exact read's
    bfloat16 window is the larger error; docs/turboquant.md), and the same greedy token at
    every step but near-ties (the exact read's top two within 0.05)."""
    model = models(arch, dtype=mx.float32)
    p = prompt(24, seed=4)
    for kb, vb in ((8, 3), (4, 2)):
        a = logprob_trace(model, turbo_caches(model, kb, vb, False), p, 24)
        b = logprob_trace(model, turbo_caches(model, kb, vb, False, codes=True), p, 24)
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(mx.abs(x - y).max().item() for (_, x), (_, y) in zip(a, b)) < 1e-3
    model, tokens = models(arch), prompt(64, seed=12)
    for kb, vb in ((8, 3), (4, 2)):
        exact, fast = (
            teacher_forced_logprobs(model, turbo_caches(model, kb, vb, False, codes, site=True), tokens, 32)
            for codes in (False, True)
        )
        assert mx.abs(exact - fast).max().item() < 0.25
        assert all(gap < 0.05 for gap in greedy_flips(exact, fast))  # docs/turboquant.md: a tie or 0.023


def test_gemma3_sliding_layers_stay_rotating_bf16_with_one_warning(models):
    model, tok = models("gemma3"), tokenizer()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        caches = make_cache(model, "turbo-k8v3")
    assert sum("sliding-window layers stay" in str(x.message) for x in w) == 1
    text = mlx_lm.generate(model, tok, prompt(40), max_tokens=4, prompt_cache=caches)
    assert isinstance(text, str)
    assert [c.kind for c in caches] == ["kv:rotating-plain", "kv:turboquant:8:3"] * 2
    assert caches[1].offset >= 41


# -- conversion -------------------------------------------------------------------------


def test_from_cache_encodes_the_live_window_once_and_consumes_the_source():
    plain = mlxkv.KVCache()
    k, v = kv(10, dtype=mx.bfloat16)
    plain.update_and_fetch(k, v)
    plain.minimum_reusable_offset = 4
    plain.masks = shared = ForwardMasks()
    c = TurboQuantKVCache.from_cache(plain, 4, 5)
    assert c.offset == 10 and c.minimum_reusable_offset == 4 and c.masks is shared
    assert plain.keys is None and plain.values is None and plain.offset == 0
    assert stored_equal(c.state, tq.encode(k, v, 4, 5)) and c.kind == "kv:turboquant:4:5"
    empty = TurboQuantKVCache.from_cache(mlxkv.KVCache(), 8, 3)
    assert empty.offset == 0 and empty.state == []
    with pytest.raises(CacheConfigError, match="kv:plain"):
        TurboQuantKVCache.from_cache(mlxkv.RotatingKVCache(8), 8, 3)


def test_bf16_first_turbo_converts_at_the_end_of_the_first_append(models):
    model = models("llama")
    caches, plain = make_cache(model, "turbo-k8v3"), make_cache(model, "bf16")
    p = prompt(12)
    assert mx.array_equal(run(model, caches, p), run(model, plain, p))  # attended in bf16
    # mlx-bun's rule: the append that reaches start (0: the first) converts before it returns
    assert caches[0].kind == "kv:turboquant:8:3" and caches[0].pending_conversion is None
    assert caches[0].minimum_reusable_offset == 0 and caches[0].offset == 12
    inner = caches[0].inner
    greedy(model, caches, 3, 1)
    assert caches[0].offset == 13 and not hasattr(caches[0], "bits") and caches[0].bytes_per_token() == 200
    greedy(model, caches, 3, 2)
    assert caches[0].inner is inner  # converted once


def test_bf16_first_turbo_with_start_sets_the_minimum_reusable_offset(models):
    model = models("llama")
    caches = make_cache(model, "turbo-k4v2-start16")
    run(model, caches, prompt(10))
    assert caches[0].kind == "kv:plain" and caches[0].minimum_reusable_offset == 0
    run(model, caches, prompt(8, seed=2))  # reaches 16: attended in bf16, then converted
    assert caches[0].kind == "kv:turboquant:4:2"
    assert caches[0].minimum_reusable_offset == 18 and caches[0].offset == 18


# -- compiled decode: the TurboQuant step -------------------------------------------------


def test_stacked_boundary_counting_gives_the_same_codes():
    """The compiled step counts boundaries with one stacked comparison (a small kernel for
    the CPU backend's compiler); the codes equal the accumulated form, NaN and inf included."""
    odd = mx.array([[[float("nan")] * 32 + [float("inf")] * 32 + [-float("inf")] * 32 + [0.0] * 32]])
    y = mx.concatenate([mx.random.normal((1, 6, 128), key=mx.random.key(4)) * 3, odd.astype(mx.float32)], axis=1)
    for vb in tq.V_BITS:
        a, b = tq.encode_values(y, vb), tq.encode_values(y, vb, stacked=True)
        assert all(mx.array_equal(x, z, equal_nan=True).item() for x, z in zip(a, b))


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (2, 5), (5, 8)])
def test_compiled_step_window_is_the_eager_window_bit_for_bit(kb, vb):
    """The step decodes the codes in the graph and writes the new position decoded from its
    own codes at a traced row: the attended window equals the eager read's, so attention
    over it (padded rows masked) equals attention over the eager window."""
    from mlxkv.caches.step_builders import decode_step

    a, b = TurboQuantKVCache(kb, vb), TurboQuantKVCache(kb, vb, deferred=False)  # b: the eager read
    for c in (a, b):
        c.update_and_fetch(*kv(20, d=128, dtype=mx.bfloat16))

    for step in range(3):
        k1, v1 = kv(1, d=128, seed=50 + step, dtype=mx.bfloat16)
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(step)).astype(mx.bfloat16)
        step = decode_step(a)
        assert step.phase.rows == 256 and step.phase.kind == a.kind

        def fn(q, k1, v1, arrays, layout=step.layout):
            sc = layout.open(arrays)
            k, v = sc.update_and_fetch(k1, v1)
            mask = sc.make_mask(1)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask=mask), sc.outputs()

        out, new = mx.compile(fn)(q, k1, v1, step.arrays)
        step.commit(new, None)
        read = b.append_decode(k1, v1)
        assert mx.array_equal(out, read.attend(q, 128**-0.5))
        assert a.offset == b.offset and stored_equal(a.state, b.state)
