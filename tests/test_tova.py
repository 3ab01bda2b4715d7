"""TOVAKVCache: every behaviour of the TOVA seed's Evidence list, plus our contract.

The reference below is the straightforward algorithm (per batch row, per head, per token,
numpy float32); the vectorized cache must keep exactly the same rows.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import mlxkv
from mlxkv import CacheConfigError, TOVAKVCache, make_cache
from mlxkv.caches.schemes import parse_scheme
from mlxkv.math.tova import tova_evict
from mlxkv.models.seeded import build_model


def reference_tova(keys: np.ndarray, budget: int, n_sink: int, blocks=None):
    """Kept original positions per (b, h) after feeding keys [B, H, T, D] token by token."""
    B, H, T, D = keys.shape
    kept = {}
    for b in range(B):
        for h in range(H):
            rows = []
            for t in range(T):
                rows.append(t)
                if len(rows) > budget:
                    K = keys[b, h, rows].astype(np.float32)
                    logits = K @ keys[b, h, t].astype(np.float32) / np.float32(math.sqrt(D))
                    w = np.exp(logits - logits.max())
                    w = w / w.sum()
                    w[:n_sink] = np.inf
                    rows.pop(int(np.argmin(w)))  # first minimum: ties to the lowest index
            kept[b, h] = rows
    return kept


def rand(shape, seed, dtype=mx.bfloat16):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def feed(cache, keys, values, blocks):
    """Append keys/values in blocks of the given sizes; returns what each call returned."""
    out, t = [], 0
    for n in blocks:
        out.append(cache.update_and_fetch(keys[:, :, t : t + n], values[:, :, t : t + n]))
        t += n
    return out


def kept_positions(cache):
    return {
        (b, h): cache.positions[b, h].tolist()
        for b in range(cache.positions.shape[0])
        for h in range(cache.positions.shape[1])
    }


# -- state and construction ----------------------------------------------------------


def test_fresh_state_has_fields_and_no_score():
    c = TOVAKVCache(64, 4)
    assert (c.kind, c.budget, c.n_sink, c.offset, c.rows) == ("kv:tova:64:4", 64, 4, 0, 0)
    assert not hasattr(c, "scores") and not hasattr(c, "bits")  # memoryless; not affine
    assert c.state == () and c.dense_window() is None and c.nbytes == 0
    assert c.tokens_kept == 0 and c.tokens_seen == 0 and c.compression_ratio == 1.0
    assert c.is_trimmable() and c.empty()


def test_empty_append_returns_zero_row_placeholders():
    c = TOVAKVCache(8, 2)
    rk, rv = c.update_and_fetch(mx.zeros((2, 3, 0, 16), mx.bfloat16), mx.zeros((2, 3, 0, 8), mx.bfloat16))
    assert rk.shape == (2, 3, 0, 16) and rv.shape == (2, 3, 0, 8)
    assert (c.offset, c.rows, c.tokens_kept, c.compression_ratio) == (0, 0, 0, 1.0)
    c.update_and_fetch(rand((2, 3, 3, 16), 0), rand((2, 3, 3, 8), 1))
    assert (c.offset, c.rows) == (3, 3) and c.positions[1, 2].tolist() == [0, 1, 2]


@pytest.mark.parametrize("budget,n_sink", [(0, 0), (4, 4), (4, 9), (4, -1), (True, 0), (4.0, 1)])
def test_bad_configuration_raises_at_construction(budget, n_sink):
    with pytest.raises(CacheConfigError):
        TOVAKVCache(budget, n_sink)


def test_bad_scheme_raises_before_any_layer_is_built():
    with pytest.raises(CacheConfigError):
        parse_scheme("tova-b4-s4")


def test_single_token_bootstraps_and_block_below_budget_keeps_everything():
    k, v = rand((1, 2, 10, 16), 0), rand((1, 2, 10, 16), 1)
    c = TOVAKVCache(16, 2)
    rk, rv = c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c.rows == 1 and c.offset == 1 and rk.shape[2] == 1
    c.update_and_fetch(k[:, :, 1:], v[:, :, 1:])
    assert c.rows == 10 and c.offset == 10
    assert mx.array_equal(c.keys, k) and mx.array_equal(c.values, v)
    assert c.positions.dtype == mx.int32 and c.positions[0, 1].tolist() == list(range(10))


# -- the budget ----------------------------------------------------------------------


def test_budget_plus_one_leaves_exactly_budget_rows_with_equal_counts():
    c = TOVAKVCache(8, 1)
    c.update_and_fetch(rand((2, 3, 9, 16), 2), rand((2, 3, 9, 8), 3))
    assert c.rows == 8 and c.keys.shape[2] == c.values.shape[2] == c.positions.shape[2] == 8
    assert c.values.shape[3] == 8  # values keep their own head dim


def test_budget_never_exceeded_in_a_30_step_decode_stress():
    c = TOVAKVCache(6, 2)
    k, v = rand((1, 2, 36, 16), 4), rand((1, 2, 36, 16), 5)
    c.update_and_fetch(k[:, :, :6], v[:, :, :6])
    for t in range(6, 36):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert c.rows == 6 and c.keys.shape[2] == c.values.shape[2] == 6
        assert not hasattr(c, "scores")  # nothing carried across steps, at any step
    assert c.offset == 36


@pytest.mark.parametrize("blocks", [[40], [1] * 40, [5, 1, 17, 3, 1, 14], [12, 28]])
@pytest.mark.parametrize("n_sink", [0, 3])
def test_vectorized_cache_keeps_the_reference_rows(blocks, n_sink):
    k, v = rand((2, 3, 40, 32), 6), rand((2, 3, 40, 32), 7)
    c = TOVAKVCache(10, n_sink)
    feed(c, k, v, blocks)
    ref = reference_tova(np.array(k.astype(mx.float32)), 10, n_sink)
    assert kept_positions(c) == ref
    idx = c.positions[..., None].astype(mx.int32)
    assert mx.array_equal(c.keys, mx.take_along_axis(k, idx, axis=2))
    assert mx.array_equal(c.values, mx.take_along_axis(v, idx, axis=2))


def test_chunked_selection_is_independent_of_the_internal_chunk():
    k = rand((1, 2, 300, 16), 8)
    p = mx.broadcast_to(mx.arange(300, dtype=mx.int32), (1, 2, 300))
    a = tova_evict(k, k, p, 20, 2, chunk=7)
    b = tova_evict(k, k, p, 20, 2, chunk=300)
    assert mx.array_equal(a[2], b[2]) and mx.array_equal(a[0], b[0])


# -- sinks, memorylessness, the current-step signal -----------------------------------


def axis_keys(n, D, axes):
    """n keys, key i a unit vector along axes[i] (scaled)."""
    k = np.zeros((1, 1, n, D), np.float32)
    for i, a in enumerate(axes):
        k[0, 0, i, abs(a)] = 4.0 if a >= 0 else -4.0
    return mx.array(k)


def test_sink_tokens_survive_every_eviction():
    D = 8
    # sinks point away from everything that follows: unprotected they would go first
    sinks = -np.ones((1, 1, 3, D), np.float32) * 3
    rest = np.abs(np.random.default_rng(0).normal(size=(1, 1, 60, D))).astype(np.float32)
    k = mx.array(np.concatenate([sinks, rest], axis=2))
    c = TOVAKVCache(8, 3)
    for t in range(63):
        c.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        assert c.positions[0, 0, : min(3, t + 1)].tolist() == list(range(min(3, t + 1)))
    assert mx.array_equal(c.keys[:, :, :3], k[:, :, :3])
    # the same stream without protection evicts them
    c0 = TOVAKVCache(8, 0)
    c0.update_and_fetch(k, k)
    assert not set(c0.positions[0, 0].tolist()) & {0, 1, 2}


def test_n_sink_zero_lets_position_zero_go_and_respects_the_budget():
    k = axis_keys(5, 4, [1, 0, 0, 0, 0])  # position 0 is orthogonal to the incoming key
    c = TOVAKVCache(4, 0)
    c.update_and_fetch(k, k)
    assert c.rows == 4 and c.positions[0, 0].tolist() == [1, 2, 3, 4]


def test_the_row_orthogonal_to_the_incoming_key_is_evicted_not_the_aligned_one():
    # rows: sink(axis 3), aligned(axis 0), orthogonal(axis 1), aligned(axis 0); incoming axis 0
    k = axis_keys(5, 4, [3, 0, 1, 0, 0])
    c = TOVAKVCache(4, 1)
    c.update_and_fetch(k, k)
    assert c.positions[0, 0].tolist() == [0, 1, 3, 4]
    # the incoming key along axis 1 instead: now the axis-1 row is kept, an axis-0 row goes
    k2 = axis_keys(5, 4, [3, 0, 1, 0, 1])
    c2 = TOVAKVCache(4, 1)
    c2.update_and_fetch(k2, k2)
    assert c2.positions[0, 0].tolist() == [0, 2, 3, 4]


def test_ties_go_to_the_lowest_index():
    k = axis_keys(5, 4, [3, 1, 1, 1, 0])  # rows 1..3 tie (orthogonal to the incoming key)
    c = TOVAKVCache(4, 1)
    c.update_and_fetch(k, k)  # one arrival over budget: the decode path
    assert c.positions[0, 0].tolist() == [0, 2, 3, 4]
    k = axis_keys(6, 4, [3, 1, 1, 1, 0, 0])  # two arrivals in one block: the chunked path
    c = TOVAKVCache(4, 1)
    c.update_and_fetch(k, k)
    assert c.positions[0, 0].tolist() == [0, 3, 4, 5]


def test_memoryless_the_decision_depends_only_on_what_is_stored():
    k, v = rand((1, 2, 40, 16), 9), rand((1, 2, 40, 16), 10)
    lived = TOVAKVCache(12, 2)
    feed(lived, k, v, [30])
    fresh = TOVAKVCache(12, 2).adopt(lived.keys, lived.values, lived.positions, lived.offset)
    for t in range(30, 40):
        lived.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        fresh.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert kept_positions(lived) == kept_positions(fresh)


def test_identical_inputs_give_identical_outputs():
    k, v = rand((1, 2, 50, 16), 11), rand((1, 2, 50, 16), 12)
    a, b = TOVAKVCache(16, 4), TOVAKVCache(16, 4)
    ra, rb = feed(a, k, v, [20, 1, 29]), feed(b, k, v, [20, 1, 29])
    assert all(mx.array_equal(x[0], y[0]) and mx.array_equal(x[1], y[1]) for x, y in zip(ra, rb))
    assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.positions, b.positions)


# -- what update_and_fetch returns, offset, accounting --------------------------------


def test_update_returns_stored_rows_plus_new_rows_and_evicts_afterwards():
    k, v = rand((1, 2, 30, 16), 13), rand((1, 2, 30, 16), 14)
    c = TOVAKVCache(8, 2)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    before_k = c.keys
    rk, rv = c.update_and_fetch(k[:, :, 20:30], v[:, :, 20:30])
    assert rk.shape[2] == 18 and mx.array_equal(rk[:, :, :8], before_k)
    assert mx.array_equal(rk[:, :, 8:], k[:, :, 20:30]) and mx.array_equal(rv[:, :, 8:], v[:, :, 20:30])
    assert c.rows == 8


@pytest.mark.parametrize("blocks", [[1] * 100, [100], [64, 36], [7] * 14 + [2], [50] + [1] * 50])
def test_offset_is_the_true_position_for_any_mix_of_blocks(blocks):
    k = rand((1, 2, 100, 16), 15)
    c = TOVAKVCache(16, 2)
    seen = 0
    for n in blocks:
        c.update_and_fetch(k[:, :, seen : seen + n], k[:, :, seen : seen + n])
        seen += n
        assert c.offset == seen and c.rows == min(seen, 16)
        assert int(c.positions.max().item()) == seen - 1  # the newest token is always kept
    assert c.compression_ratio == 100 / 16


def test_byte_accounting_and_compression_ratio():
    B, H, D = 2, 3, 16
    c = TOVAKVCache(32, 4)
    c.update_and_fetch(rand((B, H, 20, D), 16), rand((B, H, 20, D), 17))
    assert c.compression_ratio == 1.0
    assert c.tokens_seen == B * H * 20 and c.tokens_kept == B * H * 20
    c.update_and_fetch(rand((B, H, 5, D), 18), rand((B, H, 5, D), 19))
    assert c.tokens_seen == B * H * 25  # grows by B * H * S per call
    c.update_and_fetch(rand((B, H, 231, D), 20), rand((B, H, 231, D), 21))
    assert c.tokens_kept == B * H * 32 and c.compression_ratio == 256 / 32 == 8.0
    assert c.kept_bytes == c.tokens_kept * D * 4  # bf16 keys + values: 2 + 2 bytes per element
    assert c.nbytes == c.kept_bytes + B * H * 32 * 4  # plus the int32 positions
    assert c.bytes_per_token() == H * (2 * D * 2 + 4)


def test_stored_keys_keep_the_rotation_of_their_original_position():
    """mlx-lm rotates each incoming key at ``cache.offset``; survivors are never re-rotated."""
    raw = rand((1, 2, 90, 64), 22, mx.float32)
    c = TOVAKVCache(16, 2)
    t = 0
    for n in [30, 1, 1, 20, 1, 37]:
        c.update_and_fetch(
            *(mx.fast.rope(raw[:, :, t : t + n], 64, traditional=False, base=10000.0, scale=1.0, offset=c.offset),) * 2
        )
        t += n
    for h in range(2):
        for row, pos in enumerate(c.positions[0, h].tolist()):
            want = mx.fast.rope(
                raw[:, h : h + 1, pos : pos + 1], 64, traditional=False, base=10000.0, scale=1.0, offset=pos
            )
            assert mx.allclose(c.keys[0, h, row], want[0, 0, 0], atol=1e-6).item()


# -- trim and masks --------------------------------------------------------------------


def test_trimmable_only_until_the_first_eviction():
    k = rand((1, 2, 20, 16), 23)
    c = TOVAKVCache(12, 2)
    c.update_and_fetch(k[:, :, :10], k[:, :, :10])
    assert c.is_trimmable() and c.trim(3) == 3 and (c.offset, c.rows) == (7, 7)
    c.update_and_fetch(k[:, :, 7:10], k[:, :, 7:10])
    assert mx.array_equal(c.keys, k[:, :, :10])
    c.update_and_fetch(k[:, :, 10:20], k[:, :, 10:20])
    assert not c.is_trimmable() and c.trim(2) == 0 and c.offset == 20


def test_masks_for_the_returned_layout():
    k = rand((1, 2, 40, 16), 24)
    c = TOVAKVCache(8, 1)
    c.update_and_fetch(k[:, :, :30], k[:, :, :30])
    assert c.make_mask(1) is None and c.make_mask(5) == "causal"
    m = c.make_mask(3, return_array=True)
    assert m.shape == (3, 11) and m[:, :8].all().item() and m[:, 8:].tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    # a window that cuts the gapped positions: built from the stored positions, per head
    w = c.make_mask(3, window_size=10)
    pos = mx.concatenate([c.positions, mx.broadcast_to(mx.arange(30, 33, dtype=mx.int32), (1, 2, 3))], axis=2)
    for h in range(2):
        for i, q in enumerate(range(30, 33)):
            want = [(p <= q and q - p < 10) for p in pos[0, h].tolist()]
            assert w[0, h, i].tolist() == want
    assert c.make_mask(3, window_size=10) is w  # memoized until the cache changes


def test_window_mask_drives_sdpa_like_a_dense_per_head_reference():
    k, v = rand((1, 2, 40, 16), 25, mx.float32), rand((1, 2, 40, 16), 26, mx.float32)
    c = TOVAKVCache(8, 1)
    c.update_and_fetch(k[:, :, :36], v[:, :, :36])
    stored_pos = c.positions
    mask = c.make_mask(4, window_size=6)
    rk, rv = c.update_and_fetch(k[:, :, 36:], v[:, :, 36:])
    q = rand((1, 2, 4, 16), 27, mx.float32)
    out = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=0.25, mask=mask)
    for h in range(2):
        pos = stored_pos[0, h].tolist() + [36, 37, 38, 39]
        for i, qp in enumerate(range(36, 40)):
            ok = mx.array([(p <= qp and qp - p < 6) for p in pos])
            w = mx.softmax(mx.where(ok, (rk[0, h] @ q[0, h, i]) * 0.25, -mx.inf))
            assert mx.allclose(w @ rv[0, h], out[0, h, i], atol=1e-5).item()


def test_scheme_builds_tova_on_every_full_attention_layer():
    model = build_model("gemma3")
    caches = make_cache(model, "tova-b64-s4")
    assert isinstance(caches[1], TOVAKVCache) and isinstance(caches[3], TOVAKVCache)
    assert [c.kind for c in caches] == ["kv:rotating-plain", "kv:tova:64:4", "kv:rotating-plain", "kv:tova:64:4"]
    assert all(c.budget == 64 and c.n_sink == 4 for c in caches if isinstance(c, TOVAKVCache))
    assert mlxkv.is_eviction_cache(caches[1]) and len({id(c.masks) for c in caches}) == 1
