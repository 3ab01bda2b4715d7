"""TurboQuantKVCache: storage, reads (codes, exact, deferred; through mlx-lm's own attention and
the named reads), conversion, compiled decode step."""

import subprocess
import sys
import warnings

import mlx.core as mx
import mlx_lm
import pytest
from generation import greedy, run
from mlx_lm.generate import generate_step
from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv import CacheConfigError, TurboQuantKVCache
from mlxkv.caches.base import row_bytes
from mlxkv.caches.codes_window import CodesWindow
from mlxkv.caches.masks import ForwardMasks
from mlxkv.caches.schemes import make_cache
from mlxkv.math import turboquant as tq
from mlxkv.math import turboquant_attention as tqa
from mlxkv.models.seeded import ARCHITECTURES, prompt, save_model_dir, tokenizer
from mlxkv.quality import NamedReadSite, greedy_flips, named_read_attention, teacher_forced_logprobs


def kv(L, d=64, H=2, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, H, L, d), key=mx.random.key(seed)) * 2 + 0.5
    v = mx.random.normal((1, H, L, d), key=mx.random.key(seed + 1000))
    return k.astype(dtype), v.astype(dtype)


def stored_equal(a, b):
    return all(mx.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


# -- identity and construction ----------------------------------------------------------


def test_kind_and_bits_follow_the_read():
    """``bits`` (mlx-lm's route to its quantized SDPA, which mlxkv hands back to the codes) is
    shown in codes mode only; the exact read's decoded window takes mlx-lm's dense kernel."""
    c = TurboQuantKVCache(8, 3)
    assert c.kind == "kv:turboquant:8:3" and mlxkv.is_turboquant_cache(c)
    assert c.codes and c.bits == 8 and c.group_size == 32 and not isinstance(c, mlx_cache.KVCache)
    exact = TurboQuantKVCache(4, 2, codes=False)
    assert not hasattr(exact, "bits") and not hasattr(exact, "group_size")
    exact.update_and_fetch(*kv(3))
    assert not hasattr(exact, "bits")
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


def test_update_and_fetch_returns_the_codes_or_the_decoded_window():
    k, v = kv(6, dtype=mx.bfloat16)
    keys, values = TurboQuantKVCache(4, 4).update_and_fetch(k, v)
    assert isinstance(keys, CodesWindow) and keys is values and (keys.k_bits, keys.v_bits) == (4, 4)
    assert keys.rows == 6 and stored_equal([a[..., :6, :] for a in keys.stored], tq.encode(k, v, 4, 4))  # as stored
    c = TurboQuantKVCache(4, 4, codes=False)
    dk, dv = c.update_and_fetch(k, v)
    assert dk.dtype == dv.dtype == mx.bfloat16 and dk.shape == k.shape
    ek, ev = tq.decode(tq.encode(k, v, 4, 4), 4, 4)
    assert mx.array_equal(dk, ek.astype(mx.bfloat16)) and mx.array_equal(dv, ev.astype(mx.bfloat16))
    sk, sv = c.dense_window()
    assert mx.array_equal(sk, dk) and mx.array_equal(sv, dv)


# -- reads ------------------------------------------------------------------------------


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (2, 5)])
def test_a_decode_step_reads_the_whole_buffer_as_it_would_read_the_exact_rows(kb, vb):
    """The codes window of a decode step is the cache's buffer (no slice to copy), its rows
    past ``offset`` masked (zeros, or positions trimmed away): the same floats as attending
    exactly the stored positions, at every fill of a 256-row step."""
    c = TurboQuantKVCache(kb, vb)
    k, v = kv(700, d=128, H=2, dtype=mx.bfloat16)
    c.update_and_fetch(k[:, :, :600], v[:, :, :600])
    c.trim(100)  # rows 500..599 keep trimmed positions' codes
    for n in (1, 255, 256, 257, 511, 512, 513):
        c.trim(c.offset)
        if n > 1:
            c.update_and_fetch(k[:, :, : n - 1], v[:, :, : n - 1])
        keys, values = c.update_and_fetch(k[:, :, n - 1 : n], v[:, :, n - 1 : n])
        assert keys is values and keys.rows == n and keys.stored[0].shape[2] > n
        q = mx.random.normal((1, 6, 1, 128), key=mx.random.key(n)).astype(mx.bfloat16)
        exact = CodesWindow(tuple(c.state), kb, vb)
        assert mx.array_equal(keys.attend(q, 0.1, None), exact.attend(q, 0.1, None)), n
    q = mx.random.normal((1, 6, 3, 128), key=mx.random.key(1)).astype(mx.bfloat16)  # a block: sliced
    keys, _ = c.update_and_fetch(k[:, :, 600:603], v[:, :, 600:603])
    exact = CodesWindow(tuple(c.state), kb, vb)
    assert mx.array_equal(keys.attend(q, 0.1, "causal"), exact.attend(q, 0.1, "causal"))


@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (5, 8)])
def test_deferred_read_agrees_with_the_eager_read(kb, vb):
    k, v = kv(24, d=128)
    q = mx.random.normal((1, 4, 24, 128), key=mx.random.key(7))
    eager, deferred = TurboQuantKVCache(kb, vb, False, codes=False), TurboQuantKVCache(kb, vb, codes=False)
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


def turbo_caches(model, kb, vb, deferred=False, codes=True, site=False):
    """The model's layout with TurboQuant (from token zero) on the full-attention layers:
    mlx-lm's own attention reads them (the codes, or the decoded window with ``codes=False``),
    or, with ``site``, named-read sites do."""
    caches = make_cache(model, "bf16")
    out = []
    for c in caches:
        if c.kind == "kv:plain":
            t = TurboQuantKVCache(kb, vb, deferred=deferred, codes=codes)
            t.masks = c.masks
            c = NamedReadSite(t) if site else t
        out.append(c)
    return out


def logprob_trace(model, caches, tokens, n):
    steps = generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=caches)
    return [(int(t), lp) for t, lp in steps]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eager_and_deferred_run_inside_mlx_lm_generate(models, named_read_sites, arch):
    model, tok = models(arch), tokenizer()
    eager, deferred = turbo_caches(model, 4, 3, codes=False), turbo_caches(model, 4, 3, True, False, site=True)
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
        exact, fast = TurboQuantKVCache(kb, vb, False, codes=False), TurboQuantKVCache(kb, vb)
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


@pytest.mark.parametrize("vb", [2, 3, 5])
def test_a_long_window_is_weighted_in_blocks_that_sum_to_the_whole_product(vb, monkeypatch):
    """Past one block of rows (910 at 8 heads of 128 and 4 query rows: ``tqa._BLOCK_BYTES``), the value product
    is summed block by block, a partial last block included; it is the product over the whole
    window up to float32 summation order."""
    H, T, d = 8, 2500, 128
    rows = tqa._BLOCK_BYTES // (H * d // 32 * (32 + 4) * 4)
    assert rows < T and T % rows
    k, v = kv(T, d=d, H=H)
    stored = tq.encode(k, v, 8, vb)
    p = mx.softmax(mx.random.normal((1, H, 4, T), key=mx.random.key(3)), axis=-1)
    blocks = spy(monkeypatch, tqa, "_group_product")
    blocked = tqa.weighted_values(p, stored[3], stored[4], vb)
    assert len(blocks) == -(-T // rows)  # no block holds the whole window's centroids
    whole = p @ tqa.rotated_values(stored[3], stored[4], vb)
    assert blocked.shape == whole.shape == (1, H, 4, d)
    assert mx.abs(blocked - whole).max().item() < 1e-5


@pytest.mark.parametrize("vb", [2, 3, 4, 5])
@pytest.mark.parametrize("B,T", [(1, 0), (0, 5), (0, 0)])
def test_an_empty_window_or_batch_weighs_to_zeros_of_the_right_shape(vb, B, T):
    """No rows (a window before its first token) or no batch rows (every row retired) give
    zeros [B, H, M, D], not a division by zero or a reshape that cannot infer its -1."""
    H, M, d = 2, 3, 128
    p = mx.zeros((B, H, M, T))
    packed = mx.zeros((B, H, T, d * vb // 8), mx.uint8)
    scales = mx.zeros((B, H, T, d // 32), mx.float16)
    out = tqa.weighted_values(p, packed, scales, vb)
    assert out.shape == (B, H, M, d) and not mx.any(out).item()
    assert tqa.rotated_values(packed, scales, vb).shape == (B, H, T, d)


def spy(monkeypatch, owner, name) -> list:
    """Count the calls of ``owner.name`` (still calling it) until ``monkeypatch.undo()``."""
    calls, real = [], getattr(owner, name)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
def test_mlx_lms_own_attention_reads_the_codes_within_the_stated_tolerance(models, monkeypatch, arch):
    """Through mlx-lm's own attention (``generate_step``, no named-read site): every decode
    step attends from the codes and decodes no window. float32 seeded models: the same greedy
    tokens as the exact read, log-probabilities within 1e-3; bfloat16: teacher-forced
    log-probabilities within 0.25 (the exact read's bfloat16 window is the larger error;
    docs/turboquant.md), and the same greedy token at every step but near-ties (the exact
    read's top two within 0.05). The named read of the codes gives mlx-lm's bits exactly."""
    model = models(arch, dtype=mx.float32)
    p = prompt(24, seed=4)
    for kb, vb in ((8, 3), (4, 2)):
        a = logprob_trace(model, turbo_caches(model, kb, vb, codes=False), p, 24)
        attended, decoded = spy(monkeypatch, CodesWindow, "attend"), spy(monkeypatch, tq, "decode")
        b = logprob_trace(model, turbo_caches(model, kb, vb), p, 24)
        monkeypatch.undo()
        full = sum(c.kind == "kv:plain" for c in make_cache(model, "bf16"))
        assert not decoded and len(attended) >= 24 * full and len(attended) % full == 0  # every forward
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(mx.abs(x - y).max().item() for (_, x), (_, y) in zip(a, b)) < 1e-3
    model, tokens = models(arch), prompt(64, seed=12)
    for kb, vb in ((8, 3), (4, 2)):
        exact, fast = (
            teacher_forced_logprobs(model, turbo_caches(model, kb, vb, codes=codes), tokens, 32)
            for codes in (False, True)
        )
        assert mx.abs(exact - fast).max().item() < 0.25
        assert all(gap < 0.05 for gap in greedy_flips(exact, fast))  # docs/turboquant.md: a tie or 0.023
        with named_read_attention():
            named = teacher_forced_logprobs(model, turbo_caches(model, kb, vb, site=True), tokens, 32)
        assert mx.array_equal(named, fast)


#: mlx-lm's own caches through its own generate_step, in a process that may not have mlxkv
MLX_LM_ONLY = """
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import load_model

PROMPT = list(range(3, 43, 2))
QUANTIZED = lambda c: QuantizedKVCache(group_size=64, bits=4) if type(c) is KVCache else c
VARIANTS = {
    "kv": lambda model: make_prompt_cache(model),
    "kv4": lambda model: [QUANTIZED(c) for c in make_prompt_cache(model)],
    "ring": lambda model: make_prompt_cache(model, max_kv_size=12),
}


def trace(model, variant):
    caches = VARIANTS[variant](model)
    steps = generate_step(mx.array(PROMPT), model, max_tokens=6, prompt_cache=caches)
    return np.stack([np.array(lp.astype(mx.float32)) for _, lp in steps])


if __name__ == "__main__":
    root, out = Path(sys.argv[1]), sys.argv[2]
    got = {f"{d.name}-{v}": trace(load_model(d)[0], v) for d in sorted(root.iterdir()) for v in VARIANTS}
    assert not any(m == "mlxkv" or m.startswith("mlxkv.") for m in sys.modules)
    np.savez(out, **got)
"""


def test_mlx_lms_own_caches_compute_the_same_bits_with_mlxkv_routing_codes(tmp_path):
    """mlxkv routes mlx-lm's quantized SDPA to read TurboQuant codes; mlx-lm's own caches
    (KVCache, QuantizedKVCache, RotatingKVCache; gemma3's rings, lfm2's arrays) give the same
    log-probabilities, bit for bit, in a process running TurboQuant between them as in a
    process that never imported mlxkv."""
    import numpy as np
    from mlx_lm.utils import load_model

    for arch in ARCHITECTURES:
        save_model_dir(arch, str(tmp_path / "models" / arch))
    script = tmp_path / "mlx_lm_only.py"
    script.write_text(MLX_LM_ONLY)
    subprocess.run([sys.executable, str(script), str(tmp_path / "models"), str(tmp_path / "ref.npz")], check=True)
    ref = np.load(tmp_path / "ref.npz")
    here: dict = {}
    exec(compile(MLX_LM_ONLY, str(script), "exec"), here)
    for arch in ARCHITECTURES:
        model = load_model(tmp_path / "models" / arch)[0]
        for variant in here["VARIANTS"]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                turbo = make_cache(model, "turbo-k8v3")
            logprob_trace(model, turbo, prompt(20), 3)  # the codes read in use, then mlx-lm's caches
            assert hasattr(turbo[1], "bits")
            assert np.array_equal(here["trace"](model, variant), ref[f"{arch}-{variant}"]), (arch, variant)


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
    assert caches[0].offset == 13 and caches[0].bits == 8 and caches[0].bytes_per_token() == 200  # codes read
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


@pytest.mark.parametrize("codes", [True, False])
@pytest.mark.parametrize("kb,vb", [(8, 3), (4, 2), (2, 5), (5, 8)])
def test_compiled_step_attends_as_the_eager_read_bit_for_bit(kb, vb, codes):
    """The step writes the new position's codes at a traced row of the padded arrays; mlx-lm's
    attention reads them as the eager cache does (the codes, or, with ``codes=False``, the
    window decoded in the graph, the new position decoded from its own codes), padded rows
    masked: the output equals the eager step's bit for bit."""
    from mlxkv.caches.step_builders import decode_step

    a, b = TurboQuantKVCache(kb, vb, codes=codes), TurboQuantKVCache(kb, vb, codes=codes)  # b: eager
    for c in (a, b):
        c.update_and_fetch(*kv(20, d=128, dtype=mx.bfloat16))
    attend = lambda q, k, v, cache, mask: mlx_base.scaled_dot_product_attention(
        q, k, v, cache=cache, scale=128**-0.5, mask=mask
    )

    for i in range(3):
        k1, v1 = kv(1, d=128, seed=50 + i, dtype=mx.bfloat16)
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(i)).astype(mx.bfloat16)
        step = decode_step(a)
        assert step.phase.rows == 256 and step.phase.kind == a.kind

        def fn(q, k1, v1, arrays, layout=step.layout):
            sc = layout.open(arrays)
            k, v = sc.update_and_fetch(k1, v1)
            assert isinstance(k, CodesWindow) == codes == hasattr(sc, "bits")
            return attend(q, k, v, sc, sc.make_mask(1)), sc.outputs()

        out, new = mx.compile(fn)(q, k1, v1, step.arrays)
        step.commit(new, None)
        k, v = b.update_and_fetch(k1, v1)
        assert mx.array_equal(out, attend(q, k, v, b, b.make_mask(1)))
        assert a.offset == b.offset and stored_equal(a.state, b.state)


def test_a_head_dim_without_sign_tables_is_refused_by_mlxkv_before_and_in_a_batch(models):
    """A model whose head dim TurboQuant has no sign tables for (16 here): make_cache refuses
    it at once, and rows built without the model's geometry, joined into a batch before their
    start, are refused with the same CacheConfigError at the batch's first step (MLX's reshape
    error before), saying what to use instead."""
    model = models("llama", head_dim=16)
    for scheme in ("turbo-k4v2-start256", "turbo-k8v3"):
        with pytest.raises(mlxkv.CacheConfigError, match=r"head_dim in .*got 16: use an affine scheme"):
            mlxkv.make_cache(model, scheme)
    from mlxkv.caches.schemes import parse_scheme

    parsed = parse_scheme("turbo-k4v2-start256")
    rows = [[parsed.build(i, {}) for i in range(len(model.layers))] for _ in range(2)]
    batch = mlxkv.merge_model_rows(rows)
    with pytest.raises(mlxkv.CacheConfigError, match=r"got 16: use an affine scheme"):
        mx.eval(model(mx.array([[1, 2, 3], [4, 5, 6]]), cache=batch))
