"""mlxkv.quality's comparison tools on the seeded models: compare_schemes, summarize,
cache_bytes, the pass-key prompt and retrieval, and Q-Filters' premises (query_anisotropy,
attention_rank_correlation, full_attention_layers). Seconds each; the real models' numbers
are benchmarks/quality/real.py's."""

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.errors import MLXKVError
from mlxkv.models.seeded import VOCAB, build_model, prompt
from mlxkv.quality import (
    Candidate,
    PositionLogprobs,
    attention_rank_correlation,
    cache_bytes,
    compare_schemes,
    full_attention_layers,
    greedy_tokens,
    held_bytes,
    marginal_bytes,
    passkey_prompt,
    passkey_retrieval,
    query_anisotropy,
    schedule,
    summarize,
)


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", dtype=mx.float32)


class ByteTokenizer:
    """Text as UTF-8 bytes, one token each (the seeded vocabulary has 256): no chat template."""

    chat_template = None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i % VOCAB for i in ids).decode(errors="replace")


def test_schedule_blocks_end_at_chunk_multiples_and_each_context_is_a_decode_step():
    blocks = list(schedule([8, 20], chunk=5))
    assert blocks == [(0, 5), (5, 7), (7, 8), (8, 10), (10, 15), (15, 19), (19, 20)]


def test_compare_schemes_reference_against_itself_and_a_quantizer(llama):
    text = np.array(prompt(96, seed=3))
    seen = []
    cands = [Candidate("bf16"), Candidate("same", "bf16"), Candidate("kv4", "kv4", tags={"family": "kv"})]
    rows = compare_schemes(
        llama, [text], cands, contexts=(48, 96), chunk=16, window=24, continuation=6, block=8,
        on_candidate=lambda r, c: seen.append((c.label, len(r))),
    )  # fmt: skip
    assert seen == [("bf16", 2), ("same", 2), ("kv4", 2)]
    by = {(r["label"], r["context"]): r for r in rows}
    for L in (48, 96):
        ref, same, q = by["bf16", L], by["same", L], by["kv4", L]
        assert ref["rel_ppl"] == 1.0 and ref["kl"] == 0.0 and ref["agreement"] == 1.0
        assert same["rel_ppl"] == 1.0 and same["kl"] == 0.0 and same["decode_kl"] == 0.0  # deterministic
        assert same["first_divergence"] == 6 and same["scored_positions"] == 24
        assert q["kl"] > 0.0 and q["decode_kl"] > 0.0 and q["family"] == "kv"
        assert math.isclose(q["rel_ppl"], math.exp(q["nll"] - ref["nll"]), rel_tol=1e-5)
        assert q["held_bytes_per_token"] < ref["held_bytes_per_token"]
        assert 0.0 <= q["agreement"] <= 1.0 and q["first_divergence"] <= 6


def test_compare_schemes_nll_is_the_models_own_loss(llama):
    """The scored NLL equals a plain forward pass's over the same positions (the chunked,
    head-on-chosen-rows path computes the same numbers)."""
    text = np.array(prompt(64, seed=4))
    (row,) = compare_schemes(llama, [text], [Candidate("bf16")], contexts=(64,), chunk=16, window=20, continuation=2)
    lp = llama(mx.array(text[None]))[0].astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(lp[43:63], mx.array(text[44:64])[:, None], axis=-1)
    assert row["nll"] == pytest.approx(float(mx.mean(nll).item()), rel=1e-4)


def test_position_logprobs_splits_the_head_where_it_is_exact(llama):
    heads = PositionLogprobs(llama)
    assert heads.split
    tokens = mx.array([prompt(12, seed=5)])
    from mlxkv import make_cache

    out = heads(tokens, make_cache(llama, "bf16"), np.array([3, 11]))
    whole = llama(tokens).astype(mx.float32)
    whole = whole - mx.logsumexp(whole, axis=-1, keepdims=True)
    assert mx.allclose(out, whole[0, mx.array([3, 11])], atol=1e-5)


@pytest.mark.parametrize(
    "contexts, window, msg",
    [((96, 48), 8, "ascending"), ((48, 96), 60, "window=60"), ((48, 200), 8, "shorter than")],
)
def test_compare_schemes_rejects_bad_sweeps(llama, contexts, window, msg):
    with pytest.raises(MLXKVError, match=msg):
        compare_schemes(llama, [prompt(96)], [Candidate("bf16")], contexts=contexts, window=window)
    with pytest.raises(MLXKVError, match="at least one candidate"):
        compare_schemes(llama, [prompt(96)], [], contexts=(48,))


def test_summarize_folds_texts():
    rows = [
        {"label": "a", "context": 8, "text": 0, "rel_ppl": 1.0, "kl": 0.1},
        {"label": "a", "context": 8, "text": 1, "rel_ppl": 1.2, "kl": 0.3},
    ]
    (s,) = summarize(rows, fields=("rel_ppl", "kl"))
    assert s["texts"] == 2 and s["rel_ppl"] == pytest.approx(1.1) and s["kl_min"] == 0.1 and s["kl_max"] == 0.3
    assert "text" not in s


@pytest.mark.parametrize(
    "scheme, options", [("bf16", {}), ("kv4", {}), ("tova-b32-s4", {}), ("bf16", {"max_kv_size": 32})]
)
def test_cache_bytes_equals_what_a_forward_pass_leaves(llama, scheme, options):
    """Random rows fed straight in hold what the model's own forward pass holds; float32 rows
    twice bfloat16's for a plain cache."""
    cand = Candidate("x", scheme, options)
    contexts = [40, 80]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = cache_bytes(llama, cand, contexts, mx.float32, chunk=16)
        caches = cand.caches(llama)
        text = prompt(80, seed=6)
        for a, b in schedule(contexts, 16):
            llama(mx.array([text[a:b]]), cache=caches)
            mx.eval([c.state for c in caches])
            if b == 80:
                assert measured[80] == (held_bytes(caches), marginal_bytes(caches))
    if scheme == "bf16" and not options:
        half = cache_bytes(llama, cand, contexts, mx.bfloat16, chunk=16)
        assert measured[40][0] == 2 * half[40][0] and measured[80][1] == 2 * half[80][1]


def test_passkey_prompt_hides_the_key_within_the_length():
    tok = ByteTokenizer()
    for depth in (0.1, 0.9):
        ids = passkey_prompt(tok, 600, 48213, depth)
        text = tok.decode(ids)
        assert 500 < len(ids) <= 600 and "48213" in text and text.endswith("The pass key is")
    early, late = (tok.decode(passkey_prompt(tok, 600, 48213, d)).index("48213") for d in (0.1, 0.9))
    assert early < late
    with pytest.raises(MLXKVError, match="shortest prompt"):
        passkey_prompt(tok, 100, 48213, 0.5)


def test_greedy_tokens_is_a_plain_decode_loop(llama):
    from mlxkv import make_cache

    ids = prompt(40, seed=8)
    got = greedy_tokens(llama, make_cache(llama, "bf16"), ids, 5, chunk=16)
    caches = make_cache(llama, "bf16")
    logits = llama(mx.array([ids]), cache=caches)[0, -1]
    want = []
    for _ in range(5):
        want.append(int(mx.argmax(logits).item()))
        logits = llama(mx.array([[want[-1]]]), cache=caches)[0, -1]
    assert got == want


def test_passkey_retrieval_counts_against_the_reference(llama):
    cands = [Candidate("bf16"), Candidate("tova", "tova-b32-s4")]
    rows = passkey_retrieval(llama, ByteTokenizer(), cands, [300], trials=2, chunk=32, answer_tokens=4)
    assert [r["label"] for r in rows] == ["bf16", "tova"]
    for r in rows:
        assert r["trials"] == 2 and len(r["answers"]) == 2 and r["tokens"] <= 300
        assert r["found"] == sum(a["found"] for a in r["answers"])
        assert r["found_where_reference"] <= min(r["found"], r["reference_found"])
    assert {a["key"] for a in rows[0]["answers"]} == {a["key"] for a in rows[1]["answers"]}  # the same keys


def test_query_anisotropy_finds_a_planted_drift():
    rng = np.random.default_rng(0)
    H, N, D = 3, 400, 16
    direction = np.zeros((H, D))
    direction[np.arange(H), [2, 5, 9]] = 1.0
    q = rng.normal(size=(H, N, D)) + 6.0 * direction[:, None, :]
    out = query_anisotropy(mx.array(q.astype(np.float32)))
    assert out["positive"].all() and (out["mean_ratio"] > 10).all()
    assert ((out["energy_share"] > 0.6) & (out["energy_share"] < 1.0)).all()
    assert np.allclose(out["mean_projection"], 6.0, atol=0.3)
    flipped = query_anisotropy(mx.array(q.astype(np.float32)), mx.array(-direction.astype(np.float32)))
    assert not flipped["positive"].any()
    iso = query_anisotropy(mx.array(rng.normal(size=(H, N, D)).astype(np.float32)))
    assert (iso["energy_share"] < 0.2).all() and (iso["mean_ratio"] < out["mean_ratio"]).all()


def test_attention_rank_correlation_ranks_the_attended_keys():
    """Keys along a direction the queries point to receive more attention: a scorer reading
    that direction correlates ~+1, its negation ~-1, and every kv head is scored."""
    rng = np.random.default_rng(1)
    Hq, Hk, N, D = 4, 2, 96, 8
    u = np.zeros(D, np.float32)
    u[0] = 1.0
    q = (rng.normal(size=(Hq, N, D)) * 0.1 + 3.0 * u).astype(np.float32)
    k = rng.normal(size=(Hk, N, D)).astype(np.float32)
    scorers = {
        "along": lambda keys, pos: keys[..., 0],
        "against": lambda keys, pos: -keys[..., 0],
        "recency": lambda keys, pos: mx.broadcast_to(pos.astype(mx.float32), keys.shape[:2]),
    }
    rho = attention_rank_correlation(mx.array(q), mx.array(k), 1.0, scorers, last=32)
    assert rho["along"].shape == (Hk,) and (rho["along"] > 0.95).all() and (rho["against"] < -0.95).all()
    assert (np.abs(rho["recency"]) < 0.5).all()
    with pytest.raises(MLXKVError, match="last=96"):
        attention_rank_correlation(mx.array(q), mx.array(k), 1.0, scorers, last=96)


@pytest.mark.parametrize("arch, want", [("llama", [0, 1, 2, 3]), ("gemma3", [1, 3]), ("hybrid", [1, 3])])
def test_full_attention_layers(arch, want):
    assert full_attention_layers(build_model(arch)) == want
