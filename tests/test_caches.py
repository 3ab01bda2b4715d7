"""The serial cache family as mlx-lm drop-ins: kinds, masks, trim, bytes, named reads."""

import warnings

import mlx.core as mx
import mlx_lm
import pytest
from generation import greedy, run
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.caches.schemes import make_cache
from mlxkv.models.seeded import prompt, tokenizer


def test_kinds_are_the_mlx_bun_signatures():
    assert mlxkv.KVCache().kind == "kv:plain"
    assert mlxkv.QuantizedKVCache(group_size=64, bits=4).kind == "kv:quant:4:64"
    assert mlxkv.RotatingKVCache(16).kind == "kv:rotating-plain"
    assert mlxkv.RotatingQuantizedKVCache(16, bits=8, group_size=32).kind == "kv:rotating-quant:8:32"
    assert mlxkv.ArraysCache(2).kind == "ssm"


def test_meta_state_names_kind_and_offset():
    c = mlxkv.KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    assert c.meta_state == ("kv:plain", "3")
    assert mlxkv.RotatingQuantizedKVCache(8, bits=4).meta_state == ("kv:rotating-quant:4:64", "0")


def test_bits_only_on_real_affine_layouts():
    assert not hasattr(mlxkv.KVCache(), "bits")
    assert not hasattr(mlxkv.RotatingKVCache(8), "bits")
    assert not hasattr(mlxkv.ArraysCache(1), "bits")
    assert mlxkv.QuantizedKVCache(bits=4).bits == 4
    assert mlxkv.RotatingQuantizedKVCache(8, bits=4).bits == 4


def test_bad_affine_parameters_raise_at_construction():
    with pytest.raises(mlxkv.CacheConfigError, match="bits"):
        mlxkv.QuantizedKVCache(bits=7)
    with pytest.raises(mlxkv.CacheConfigError, match="keep"):
        mlxkv.RotatingKVCache(8, keep=8)
    with pytest.raises(mlxkv.SchemeError, match="unknown cache scheme"):
        make_cache(None, "kv4-wat")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_plain_and_ring_match_mlx_lm_bit_for_bit(models, arch):
    """Our plain and ring caches give mlx-lm's own caches' logits exactly (rings wrap here)."""
    model = models(arch)
    ours, theirs = make_cache(model, "bf16"), mlx_cache.make_prompt_cache(model)
    p = prompt(40)
    a, b = run(model, ours, p, chunk=16), run(model, theirs, p, chunk=16)
    assert mx.array_equal(a, b)
    ta, la = greedy(model, ours, p[-1], 30)
    tb, lb = greedy(model, theirs, p[-1], 30)
    assert ta == tb and all(mx.array_equal(x, y) for x, y in zip(la, lb))
    assert ours[0].offset == 70


def test_make_cache_follows_the_models_layout(models):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        caches = make_cache(models("gemma3"), "kv4")
    assert [c.kind for c in caches] == ["kv:rotating-plain", "kv:quant:4:64"] * 2
    assert sum("sliding-window layers stay" in str(x.message) for x in w) == 1
    assert [c.kind for c in make_cache(models("hybrid"), "kv8-g32")] == ["ssm", "kv:quant:8:32"] * 2
    rings = make_cache(models("llama"), "kv4", max_kv_size=48)
    assert {c.kind for c in rings} == {"kv:rotating-quant:4:64"} and rings[0].keep == 4
    assert len({id(c.masks) for c in make_cache(models("hybrid"), "bf16")}) == 1


def test_mlxkv_caches_are_instances_of_mlx_lms_classes():
    """As mlx-lm's own code and user code test them (``isinstance``)."""
    assert isinstance(mlxkv.KVCache(), mlx_cache.KVCache)
    assert isinstance(mlxkv.QuantizedKVCache(bits=4), mlx_cache.QuantizedKVCache)
    assert isinstance(mlxkv.ArraysCache(2), mlx_cache.ArraysCache)
    assert isinstance(mlxkv.RotatingKVCache(16, keep=4), mlx_cache.RotatingKVCache)
    assert isinstance(mlxkv.RotatingQuantizedKVCache(16, bits=8, group_size=32), mlx_cache.RotatingKVCache)


@pytest.mark.parametrize("arch,scheme", [("gemma3", "bf16"), ("gemma3", "kv4"), ("hybrid", "turbo-k4v2-start16")])
def test_make_cache_takes_a_model_whose_make_cache_is_mlxkvs(models, arch, scheme):
    """A model whose own ``make_cache`` returns mlxkv caches (rings for gemma3's
    sliding-window layers among them) gets the layout its mlx-lm caches would give."""

    class Patched:  # mlx-lm's model with its make_cache replaced, as user code does
        def __init__(self, model):
            self.model, self.layers, self.args = model, model.layers, model.args
            self.mlxkv_config = model.mlxkv_config

        def make_cache(self):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return make_cache(self.model, scheme)

    model = models(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = [(c.kind, getattr(c, "max_size", None)) for c in make_cache(model, "kv8-g32")]
        got = [(c.kind, getattr(c, "max_size", None)) for c in make_cache(Patched(model), "kv8-g32")]
    assert got == want


def test_make_cache_names_the_class_it_has_no_cache_for():
    class Chunked:
        def __init__(self):
            self.layers = [None]

        def make_cache(self):
            return [mlx_cache.ChunkedKVCache(64)]

    with pytest.raises(
        mlxkv.SchemeError, match=r"layer 0: the model's make_cache gives a mlx_lm\.models\.cache\.ChunkedKVCache"
    ):
        make_cache(Chunked(), "bf16")


def test_mlx_lm_generate_and_stream_generate_run_unchanged(models):
    model, tok = models("gemma3"), tokenizer()
    for scheme in ("bf16", "kv4", "kv8-g32-start8"):
        caches = make_cache(model, scheme)
        text = mlx_lm.generate(model, tok, prompt(40), max_tokens=6, prompt_cache=caches)
        assert text.count("<") >= 1 and all(c.offset >= 40 for c in caches)
        n = sum(1 for _ in mlx_lm.stream_generate(model, tok, prompt(5, seed=3), max_tokens=4, prompt_cache=caches))
        assert n >= 1


def test_mask_object_is_shared_per_forward(models):
    caches = make_cache(models("llama"), "bf16")
    m1 = caches[0].make_mask(8, return_array=True)
    m2 = caches[3].make_mask(8, return_array=True)
    assert m1 is m2 and caches[0].masks.builds == 1
    assert caches[1].make_mask(1) is None
    run(models("llama"), caches, prompt(8))
    assert caches[2].make_mask(4, return_array=True) is not m1  # new offset, new mask
    assert mx.array_equal(caches[2].make_mask(4, return_array=True), mx.tril(mx.ones((4, 12), mx.bool_), k=8))


def test_ring_mask_matches_mlx_lm_after_wrap(models):
    model = models("gemma3")
    ours, theirs = make_cache(model, "bf16"), mlx_cache.make_prompt_cache(model)
    p = prompt(45)
    run(model, ours, p, chunk=7)
    run(model, theirs, p, chunk=7)
    for N, w in ((1, 16), (1, None), (5, None), (5, 16)):
        a, b = ours[0].make_mask(N, window_size=w), theirs[0].make_mask(N, window_size=w)
        assert (a is None and b is None) or (isinstance(a, str) and a == b) or mx.array_equal(a, b)


def test_trim_rules(models):
    model = models("gemma3")
    caches = make_cache(model, "bf16")
    run(model, caches, prompt(20))
    ring, full = caches[0], caches[1]
    assert ring.is_trimmable() and full.is_trimmable()
    assert [c.trim(5) for c in caches] == [5] * 4 and full.offset == 15 and ring.offset == 15
    run(model, caches, prompt(30))  # offset 45 > window 32: the ring has wrapped
    assert not ring.is_trimmable() and ring.trim(3) == 0 and ring.offset == 45
    hybrid = make_cache(models("hybrid"), "bf16")
    run(models("hybrid"), hybrid, prompt(6))
    assert not hybrid[0].is_trimmable() and hybrid[0].trim(2) == 0 and hybrid[0].offset == 6


def test_bytes_per_token_and_nbytes(models):
    model = models("llama")  # 2 kv heads, head_dim 64, bf16
    plain, quant = make_cache(model, "bf16"), make_cache(model, "kv4")
    run(model, plain, prompt(10))
    run(model, quant, prompt(10))
    assert plain[0].bytes_per_token() == 2 * 2 * 64 * 2  # K and V, 2 heads, 64 dims, 2 bytes
    # 4-bit group 64: 32 packed bytes + bf16 scale + bf16 bias per head vector
    assert quant[0].bytes_per_token() == 2 * 2 * (32 + 2 + 2)
    assert plain[0].nbytes == plain[0].keys.nbytes * 2
    assert mlxkv.ArraysCache(1).bytes_per_token() == 0


def test_bf16_first_affine_converts_once(models):
    model = models("llama")
    caches = make_cache(model, "kv4-start16")
    run(model, caches, prompt(10))
    assert caches[0].kind == "kv:plain" and caches[0].minimum_reusable_offset == 0
    run(model, caches, prompt(8, seed=2))  # the append that reaches 16 is attended in bf16
    # ... and converts before it returns; mlx-lm still attended that append in bf16, so the
    # cache shows `bits` only once a window it returns is affine triples
    assert caches[0].kind == "kv:quant:4:64" and not hasattr(caches[0], "bits")
    assert caches[0].minimum_reusable_offset == 18 and caches[0].pending_conversion is None
    inner = caches[0].inner
    greedy(model, caches, 3, 1)
    assert caches[0].bits == 4 and caches[0].offset == 19 and caches[0].inner is inner


def test_named_reads(models):
    mx.random.seed(0)
    cache = mlxkv.KVCache()
    k = mx.random.normal((1, 2, 6, 64)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 6, 64)).astype(mx.bfloat16)
    q = mx.random.normal((1, 4, 6, 64)).astype(mx.bfloat16)
    out = cache.append_window(k, v).attend(q, 0.125)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.array_equal(out, ref)
    with pytest.raises(mlxkv.MLXKVError, match="append_window"):
        cache.append_decode(k, v)
    blk_k, blk_v = k[:, :, :2], v[:, :, :2]
    read = cache.read_block(blk_k, blk_v)
    assert cache.offset == 6 and read.keys.shape[2] == 8
    dec = cache.append_decode(k[:, :, :1], v[:, :, :1]).attend(q[:, :, :1], 0.125)
    assert cache.offset == 7 and dec.shape == (1, 4, 1, 64)
    quant = mlxkv.QuantizedKVCache(bits=8)
    quant.append_window(k, v)
    dk, dv = quant.dense_window()
    assert dk.shape == k.shape and mx.allclose(dk, k, atol=0.05).item()


def test_rotating_quantized_ring_lays_out_like_the_plain_ring():
    mx.random.seed(1)
    plain, quant = mlxkv.RotatingKVCache(12, keep=2), mlxkv.RotatingQuantizedKVCache(12, keep=2, bits=8)
    for L in (5, 1, 1, 9, 1, 1, 1, 3, 1):
        k = mx.random.normal((1, 2, L, 64)).astype(mx.bfloat16)
        plain.update_and_fetch(k, k)
        quant.update_and_fetch(k, k)
        assert (plain.offset, plain._idx) == (quant.offset, quant._idx)
        n = min(plain.offset, plain.keys.shape[2])  # rows past offset are unwritten slack
        q = mx.quantize(plain.keys[..., :n, :], group_size=64, bits=8)
        assert all(mx.array_equal(a, b[..., :n, :]) for a, b in zip(q, quant.keys))


def test_predicates_are_string_compares():
    class Impostor(mlxkv.KVCache):  # a subclass that claims another identity
        kind = "kv:tova:64:4"

    assert mlxkv.is_eviction_cache(Impostor()) and not mlxkv.is_plain_kv_cache(Impostor())
    assert mlxkv.is_plain_kv_cache(mlxkv.KVCache())
    assert mlxkv.is_quantized_kv_cache(mlxkv.QuantizedKVCache(bits=4))
    assert mlxkv.is_rotating_plain_cache(mlxkv.RotatingKVCache(4))
    assert mlxkv.is_rotating_quantized_cache(mlxkv.RotatingQuantizedKVCache(4, bits=4))
    assert mlxkv.is_recurrent_cache(mlxkv.ArraysCache(1))
    assert not mlxkv.is_turboquant_cache(mlxkv.KVCache())

    class NoKind:
        offset = 0

    with pytest.raises(mlxkv.UnknownKindError, match="declares no kind; build mlxkv caches with mlxkv.make_cache"):
        mlxkv.is_plain_kv_cache(NoKind())


def test_unknown_kind_is_a_loud_error():
    from mlxkv.families import family_of_kind, family_of_persisted

    with pytest.raises(mlxkv.UnknownKindError, match="kv:mystery"):
        family_of_kind("kv:mystery")
    with pytest.raises(mlxkv.UnknownKindError, match="batched"):
        family_of_kind("kv:batched-mask:kv:plain")
    with pytest.raises(mlxkv.UnknownKindError, match="'nope'"):
        family_of_persisted("nope")


def test_mlx_lm_save_prompt_cache_accepts_our_caches(models, tmp_path):
    """``state`` is mlx-lm's, so mlx-lm's own save/load round-trips our plain and ring caches."""
    model = models("gemma3")
    caches = make_cache(model, "bf16")
    run(model, caches, prompt(40), chunk=16)
    path = str(tmp_path / "mlx.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    theirs = mlx_cache.load_prompt_cache(path)
    assert [type(c).__name__ for c in theirs] == ["RotatingKVCache", "KVCache"] * 2
    a, _ = greedy(model, caches, 5, 6)
    b, _ = greedy(model, theirs, 5, 6)
    assert a == b
