"""QFiltersKVCache: every behaviour of the Q-Filters seed's Evidence list (cache, selection,
fallback), with the seed's Metal-kernel claims pinned on our vectorized MLX selection."""

import mlx.core as mx
import numpy as np
import pytest

import mlxkv
from mlxkv import CacheConfigError, QFiltersKVCache, make_cache
from mlxkv.caches.schemes import parse_scheme
from mlxkv.math.qfilters import key_svd_filter, projection_scores, qfilters_survivors
from mlxkv.models.seeded import build_model


def rand(shape, seed, dtype=mx.bfloat16):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def unit(shape, seed):
    f = mx.random.normal(shape, key=mx.random.key(seed))
    return f / mx.linalg.norm(f, axis=-1, keepdims=True)


def feed(cache, keys, values, blocks):
    t = 0
    for n in blocks:
        cache.update_and_fetch(keys[:, :, t : t + n], values[:, :, t : t + n])
        t += n


def reference_kept(scores: np.ndarray, budget: int, n_sink: int, recent: int):
    """numpy ranking: sinks and trailing window forced, then highest score, lower index first."""
    R = scores.shape[-1]
    forced = [i for i in range(R) if i < n_sink or i >= R - recent]
    rest = sorted((i for i in range(R) if i not in forced), key=lambda i: (-scores[i], i))
    return sorted(forced + rest[: budget - len(forced)])


def positions(c):
    return c.positions.tolist()


# -- construction ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(budget=8, n_sink=4, recent=4),  # n_sink + recent >= budget
        dict(budget=8, n_sink=6, recent=3),
        dict(budget=8, sign=0),
        dict(budget=8, sign=2),
        dict(budget=8, sign=True),
        dict(budget=0, n_sink=0),
        dict(budget=8, recent=-1),
        dict(budget=8, calib_tokens=1),
        dict(budget=8, filters=mx.zeros((2, 16))),  # a zero direction
        dict(budget=8, filters=mx.ones((16,))),  # not [H, D]
        dict(budget=8, filters=mx.ones((2, 16)), n_kv_heads=4),  # head layout known to disagree
        dict(budget=8, filters=mx.ones((2, 16)), head_dim=64),
    ],
)
def test_bad_configuration_raises_at_construction(kwargs):
    with pytest.raises(CacheConfigError):
        QFiltersKVCache(**kwargs)


def test_bad_scheme_options_raise_before_any_layer_is_built():
    with pytest.raises(CacheConfigError):
        parse_scheme("qfilters-b8-s4-r4")
    with pytest.raises(CacheConfigError):
        parse_scheme("qfilters-b64-s4-r16", {"sign": -2})


def test_filters_whose_head_layout_disagrees_raise_at_the_first_append_before_storing():
    c = QFiltersKVCache(8, 1, filters=unit((3, 16), 0))  # 3 heads; the layer has 2
    with pytest.raises(CacheConfigError, match="wrong model or layer"):
        c.update_and_fetch(rand((1, 2, 4, 16), 1), rand((1, 2, 4, 16), 2))
    assert c.offset == 0 and c.keys is None
    c = QFiltersKVCache(8, 1, filters=unit((2, 32), 0))  # head_dim 32; the layer has 16
    with pytest.raises(CacheConfigError):
        c.update_and_fetch(rand((1, 2, 4, 16), 1), rand((1, 2, 4, 16), 2))


def test_fresh_cache_identity():
    c = QFiltersKVCache(64, 4, 16)
    assert (c.kind, c.offset, c.rows, c.state) == ("kv:qfilters:64:4:16", 0, 0, ())
    assert not hasattr(c, "bits") and not c.frozen and not c.calibrated and c.is_trimmable()


# -- calibrated path ----------------------------------------------------------------------


def test_calibrated_filter_evicts_from_token_zero_while_the_fallback_holds_everything():
    k = rand((1, 2, 80, 16), 3)
    cal = QFiltersKVCache(32, 2, filters=unit((2, 16), 4))
    fb = QFiltersKVCache(32, 2, calib_tokens=128)
    feed(cal, k, k, [1] * 80)
    feed(fb, k, k, [1] * 80)
    assert cal.rows == 32 and fb.rows == 80 and cal.offset == fb.offset == 80
    assert not fb.frozen and fb.positions[0, 0].tolist() == list(range(80))


@pytest.mark.parametrize("recent", [0, 5])
def test_calibrated_kept_set_is_bit_identical_for_every_prefill_chunking(recent):
    k, v = rand((2, 2, 300, 32), 5), rand((2, 2, 300, 32), 6)
    f = unit((2, 32), 7)
    runs = {}
    for name, blocks in {
        "one-shot": [300],
        "256": [256, 44],
        "64": [64] * 4 + [44],
        "7": [7] * 42 + [6],
        "decode": [1] * 300,
    }.items():
        c = QFiltersKVCache(24, 2, recent, filters=f)
        feed(c, k, v, blocks)
        runs[name] = c
    ref = runs["one-shot"]
    for name, c in runs.items():
        assert c.offset == 300 and c.rows == 24, name
        for a, b in ((c.keys, ref.keys), (c.values, ref.values), (c.positions, ref.positions), (c.scores, ref.scores)):
            assert mx.array_equal(a, b), name


def test_calibrated_kept_set_is_the_budget_highest_projections():
    k = rand((2, 3, 100, 32), 8)
    f = unit((3, 32), 9)
    c = QFiltersKVCache(20, 3, 4, filters=f)
    c.update_and_fetch(k, k)
    s = np.array(mx.sum(k.astype(mx.float32) * f[None, :, None, :], axis=-1))
    for b in range(2):
        for h in range(3):
            assert c.positions[b, h].tolist() == reference_kept(s[b, h], 20, 3, 4)
    idx = c.positions[..., None]
    assert mx.array_equal(c.keys, mx.take_along_axis(k, idx, axis=2))


def test_sign_minus_one_keeps_the_lowest_projections():
    k = rand((1, 1, 50, 16), 10)
    f = unit((1, 16), 11)
    hi, lo = QFiltersKVCache(10, 0, filters=f), QFiltersKVCache(10, 0, sign=-1, filters=f)
    hi.update_and_fetch(k, k)
    lo.update_and_fetch(k, k)
    s = np.array(mx.sum(k.astype(mx.float32) * f[None, :, None, :], axis=-1))[0, 0]
    assert lo.positions[0, 0].tolist() == sorted(np.argsort(s, kind="stable")[:10].tolist())
    assert not set(hi.positions[0, 0].tolist()) & set(lo.positions[0, 0].tolist())


# -- the selection (the seed's Metal kernels; here vectorized MLX over [B, H, R]) -----------


def test_scores_are_sign_times_the_float32_projection():
    k = rand((2, 2, 33, 32), 12)
    f = unit((2, 32), 13)
    want = np.einsum("bhnd,hd->bhn", np.array(k.astype(mx.float32)), np.array(f))
    for sign in (1, -1):
        got = np.array(projection_scores(k, f[None], sign))
        assert got.dtype == np.float32 and np.allclose(got, sign * want, atol=1e-5)
    c = QFiltersKVCache(64, 2, filters=f)
    c.update_and_fetch(k, k)
    assert np.allclose(np.array(c.scores), want, atol=1e-5)


@pytest.mark.parametrize(
    "B,H,R,budget,n_sink,recent",
    [(1, 1, 40, 10, 0, 0), (2, 4, 129, 64, 4, 16), (1, 8, 300, 32, 1, 30), (3, 2, 65, 64, 0, 1)],
)
def test_selection_matches_an_argsort_reference_for_keys_and_values(B, H, R, budget, n_sink, recent):
    k, v = rand((B, H, R, 16), R), rand((B, H, R, 8), R + 1)
    f = unit((H, 16), R + 2)
    c = QFiltersKVCache(budget, n_sink, recent, filters=f)
    c.update_and_fetch(k, v)
    s = np.array(c.scores)  # survivors' scores, to check they are the argsort winners
    full = np.array(projection_scores(k, f[None], 1))
    for b in range(B):
        for h in range(H):
            keep = reference_kept(full[b, h], budget, n_sink, recent)
            assert c.positions[b, h].tolist() == keep
            assert np.array_equal(s[b, h], full[b, h, keep])
    idx = c.positions[..., None]
    assert mx.array_equal(c.keys, mx.take_along_axis(k, idx, axis=2))
    assert mx.array_equal(c.values, mx.take_along_axis(v, idx, axis=2))


def test_tied_scores_do_not_overflow_the_budget_and_go_to_the_lower_index():
    scores = mx.zeros((2, 3, 50))
    idx = qfilters_survivors(scores, 12, 2, 3)
    assert idx.shape == (2, 3, 12)
    assert idx[0, 0].tolist() == list(range(9)) + [47, 48, 49]
    # a cache fed identical keys: every score ties
    k = mx.ones((1, 2, 40, 16), mx.bfloat16)
    c = QFiltersKVCache(10, 1, 2, filters=unit((2, 16), 1))
    c.update_and_fetch(k, k)
    assert c.rows == 10 and c.positions[0, 0].tolist() == list(range(8)) + [38, 39]
    d = QFiltersKVCache(10, 1, 2, filters=unit((2, 16), 1))
    feed(d, k, k, [1] * 40)  # one victim per decode step: the tie still keeps the lower index
    assert mx.array_equal(d.positions, c.positions)


def test_all_protected_rows_tie_at_infinity_and_still_respect_the_budget():
    scores = mx.random.normal((1, 2, 30), key=mx.random.key(0))
    exact = qfilters_survivors(scores, 10, 4, 6)  # every kept row is a forced (+inf) row
    assert exact[0, 0].tolist() == [0, 1, 2, 3] + list(range(24, 30))
    over = qfilters_survivors(scores, 10, 6, 8)  # more forced rows than the budget
    assert over.shape == (1, 2, 10) and over[0, 1].tolist() == list(range(6)) + [22, 23, 24, 25]


def test_minus_zero_and_zero_tie():
    s = mx.array([[[1.0, -0.0, 0.0, -0.0, 0.0]]])
    assert qfilters_survivors(s, 3, 0, 0)[0, 0].tolist() == [0, 1, 2]


# -- fallback path --------------------------------------------------------------------


def planted_keys(direction, n, seed, spread=6.0, noise=0.3):
    """Keys with a dominant (high-variance) axis along ``direction`` [H, D]."""
    H, D = direction.shape
    a = mx.random.normal((1, H, n, 1), key=mx.random.key(seed)) * spread
    return a * direction[None, :, None, :] + noise * mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1))


def test_key_svd_recovers_a_planted_dominant_direction():
    u = unit((3, 32), 14)
    f = key_svd_filter(planted_keys(u, 128, 15))
    cos = mx.abs(mx.sum(f[0] * u, axis=-1))
    assert (cos > 0.99).all().item()
    assert mx.allclose(mx.linalg.norm(f, axis=-1), mx.ones((1, 3)), atol=1e-5).item()


def test_fallback_never_evicts_before_calib_tokens_even_over_budget():
    k = rand((1, 2, 200, 16), 16)
    c = QFiltersKVCache(16, 2, calib_tokens=64)
    for t in range(63):
        c.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        assert c.rows == t + 1 and not c.frozen
        assert mx.array_equal(c.scores, mx.zeros_like(c.scores))
    c.update_and_fetch(k[:, :, 63:64], k[:, :, 63:64])  # the 64th key freezes the filter
    assert c.frozen and not c.calibrated and c.rows == 16 and c.offset == 64


def test_fallback_kept_set_is_the_top_projection_against_the_frozen_filter():
    k = rand((1, 2, 120, 16), 17)
    c = QFiltersKVCache(20, 2, 3, calib_tokens=40)
    feed(c, k, k, [30, 1, 1, 50, 38])
    f = np.array(key_svd_filter(k[:, :, :40]))  # estimated from exactly the first 40 keys
    assert np.array_equal(np.array(c.filter), f)
    s = np.einsum("bhnd,bhd->bhn", np.array(k.astype(mx.float32)), f)
    for h in range(2):
        assert c.positions[0, h].tolist() == reference_kept(s[0, h], 20, 2, 3)


def test_sinks_and_recent_window_survive():
    k = rand((1, 2, 90, 16), 18)
    c = QFiltersKVCache(16, 3, 5, calib_tokens=8)
    for t in range(90):
        c.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        if t >= 16:
            for h in range(2):
                row = c.positions[0, h].tolist()
                assert row[:3] == [0, 1, 2] and row[-5:] == list(range(t - 4, t + 1))


def test_a_stored_score_never_changes_once_the_filter_is_set():
    k = rand((1, 2, 100, 16), 19)
    c = QFiltersKVCache(24, 2, 2, calib_tokens=16)
    seen = {}
    for t in range(100):
        c.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        if not c.frozen:
            continue
        for h in range(2):
            for p, s in zip(c.positions[0, h].tolist(), c.scores[0, h].tolist()):
                assert seen.setdefault((h, p), s) == s


def test_fallback_is_chunk_invariant_here_and_stays_within_budget():
    """The seed's fallback freezes on whatever block crossed the threshold and is path
    dependent; ours estimates from exactly the first calib_tokens keys, so prefill and
    decode agree bit for bit (and both respect the budget with a unit-norm filter)."""
    k = rand((1, 2, 200, 32), 20)
    runs = []
    for blocks in ([200], [1] * 200, [100, 100], [37] * 5 + [15], [64] * 3 + [8]):
        c = QFiltersKVCache(32, 2, 4, calib_tokens=50)
        feed(c, k, k, blocks)
        assert c.rows == 32 and c.offset == 200
        assert mx.allclose(mx.linalg.norm(c.filter, axis=-1), mx.ones((1, 2)), atol=1e-5).item()
        runs.append(c)
    for c in runs[1:]:
        assert mx.array_equal(c.filter, runs[0].filter) and mx.array_equal(c.positions, runs[0].positions)
        assert mx.array_equal(c.keys, runs[0].keys) and mx.array_equal(c.scores, runs[0].scores)


def test_mechanism_under_paper_like_geometry_beats_random_eviction():
    """Important keys carry a large projection on the dominant axis and align with the probe
    queries; keeping them (the correct sign) preserves attention far better than random."""
    D, n, budget = 32, 256, 32
    u = unit((1, D), 21)
    rng = np.random.default_rng(0)
    base = rng.normal(size=(n, D)).astype(np.float32) * 0.5
    weight = np.where(rng.random(n) < 0.1, 4.0, -1.0).astype(np.float32)  # 10% important
    keys = mx.array(base + weight[:, None] * np.array(u))[None, None]
    values = mx.array(rng.normal(size=(1, 1, n, D)).astype(np.float32))
    q = mx.array(np.array(u) * 3.0 + rng.normal(size=(16, D)).astype(np.float32) * 0.2)[None, None]  # probes along u

    def attend(k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=None)

    full = attend(keys, values)
    good = QFiltersKVCache(budget, 0, filters=u)
    good.update_and_fetch(keys, values)
    bad = QFiltersKVCache(budget, 0, sign=-1, filters=u)
    bad.update_and_fetch(keys, values)
    err = lambda c: float(mx.mean(mx.abs(attend(c.keys, c.values) - full)).item())
    rand_errs = []
    for s in range(10):
        idx = mx.sort(mx.random.permutation(n, key=mx.random.key(s))[:budget])
        rand_errs.append(float(mx.mean(mx.abs(attend(keys[:, :, idx], values[:, :, idx]) - full)).item()))
    assert err(good) < 0.25 * np.mean(rand_errs)
    assert err(bad) > err(good) * 2  # the inverted sign keeps the unimportant keys


# -- offset, layout, accounting, trim --------------------------------------------------


@pytest.mark.parametrize("blocks", [[1] * 150, [150], [100, 1, 1, 48], [40] * 3 + [1] * 30])
def test_offset_is_the_true_position_through_prefill_and_decode(blocks):
    k = rand((1, 2, 150, 16), 22)
    for c in (QFiltersKVCache(16, 2, 2, calib_tokens=20), QFiltersKVCache(16, 2, 2, filters=unit((2, 16), 1))):
        seen = 0
        for n in blocks:
            before = c.rows
            rk, _ = c.update_and_fetch(k[:, :, seen : seen + n], k[:, :, seen : seen + n])
            seen += n
            assert rk.shape[2] == before + n and c.offset == seen
            assert c.rows == (min(seen, 16) if c.frozen else seen)
            assert (c.positions[..., -1] == seen - 1).all().item()  # the newest token is kept (recent=2)
        assert c.offset == 150 and c.rows == 16


def test_update_returns_stored_plus_new_rows_and_evicts_afterwards():
    k = rand((1, 2, 60, 16), 23)
    c = QFiltersKVCache(16, 2, filters=unit((2, 16), 2))
    c.update_and_fetch(k[:, :, :40], k[:, :, :40])
    stored = c.keys
    rk, _ = c.update_and_fetch(k[:, :, 40:], k[:, :, 40:])
    assert rk.shape[2] == 36 and mx.array_equal(rk[:, :, :16], stored) and mx.array_equal(rk[:, :, 16:], k[:, :, 40:])
    assert c.rows == 16


def test_byte_accounting_counts_the_filter():
    B, H, D = 1, 2, 16
    c = QFiltersKVCache(16, 2, filters=unit((H, D), 3))
    c.update_and_fetch(rand((B, H, 64, D), 24), rand((B, H, 64, D), 25))
    assert c.tokens_seen == B * H * 64 and c.tokens_kept == B * H * 16 and c.compression_ratio == 4.0
    assert c.kept_bytes == c.tokens_kept * D * 4
    assert c.nbytes == c.kept_bytes + B * H * 16 * (4 + 4) + H * D * 4  # positions, scores, filter
    assert c.bytes_per_token() == H * (2 * D * 2 + 4 + 4)


def test_trim_until_the_first_eviction_and_unfreeze_below_calib_tokens():
    k = rand((1, 2, 80, 16), 26)
    c = QFiltersKVCache(64, 2, calib_tokens=30)
    c.update_and_fetch(k[:, :, :40], k[:, :, :40])
    assert c.frozen and c.is_trimmable()
    assert c.trim(15) == 15 and c.offset == 25 and not c.frozen  # the estimate's keys are gone
    fresh = QFiltersKVCache(64, 2, calib_tokens=30)
    fresh.update_and_fetch(k[:, :, :25], k[:, :, :25])
    for x in (c, fresh):
        x.update_and_fetch(k[:, :, 25:80], k[:, :, 25:80])
    assert mx.array_equal(c.positions, fresh.positions) and mx.array_equal(c.filter, fresh.filter)
    assert not c.is_trimmable() and c.trim(3) == 0


def test_scheme_passes_calibration_sign_and_calib_tokens_per_layer():
    model = build_model("llama")
    filters = [unit((2, 64), i) for i in range(4)]
    caches = make_cache(model, "qfilters-b64-s4-r16", filters=filters, sign=-1)
    assert all(isinstance(c, QFiltersKVCache) and c.calibrated and c.sign == -1 for c in caches)
    assert all(mx.array_equal(c.filter[0], f) for c, f in zip(caches, filters))
    fb = make_cache(model, "qfilters-b64-s4-r16", calib_tokens=32)
    assert all(c.calib_tokens == 32 and not c.calibrated for c in fb) and fb[0].kind == "kv:qfilters:64:4:16"
    with pytest.raises(CacheConfigError, match="no filter for layer 3"):
        make_cache(model, "qfilters-b64-s4-r16", filters=filters[:3])
    assert mlxkv.is_eviction_cache(caches[0])


def test_make_cache_refuses_filters_of_another_head_layout_at_construction():
    from mlxkv.models.seeded import build_model

    model = build_model("llama")  # 2 kv heads of 64 dims
    wrong = [mx.ones((4, 64)) for _ in range(4)]
    with pytest.raises(mlxkv.CacheConfigError, match="kv heads"):
        mlxkv.make_cache(model, "qfilters-b16-s2-r2", filters=wrong)
    with pytest.raises(mlxkv.CacheConfigError, match="head_dim"):
        mlxkv.make_cache(model, "qfilters-b16-s2-r2", filters=[mx.ones((2, 32)) for _ in range(4)])
    assert mlxkv.make_cache(model, "qfilters-b16-s2-r2", filters=[mx.ones((2, 64)) for _ in range(4)])
