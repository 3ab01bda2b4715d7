"""Eviction caches inside mlx-lm's generation loop on the seeded models, and zero position
drift: offset == tokens seen, every kept key carries the RoPE of its true position."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlxkv
from mlxkv.caches.qfilters_calibration import calibrate
from mlxkv.models.seeded import build_model, prompt


def generate(model, caches, toks, n, prefill_step_size=2048):
    """Greedy tokens from mlx-lm's ``generate_step`` using ``caches``."""
    gen = generate_step(mx.array(toks), model, max_tokens=n, prompt_cache=caches, prefill_step_size=prefill_step_size)
    return [t for t, _ in gen]


def layer0_keys(model, tokens):
    """Layer 0's post-RoPE keys of ``tokens`` at positions 0..L-1, computed from scratch
    (layer 0 sees only the embeddings, so eviction elsewhere cannot change them)."""
    layer = model.layers[0]
    attn = layer.self_attn
    x = layer.input_layernorm(model.model.embed_tokens(mx.array(tokens)[None]))
    k = attn.k_proj(x).reshape(1, len(tokens), attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(k)  # offset 0: token i at position i


def calibration(scheme: str, tokens: int) -> dict:
    """Q-Filters' calibration length (an option TOVA does not take, which make_cache refuses)."""
    return {"calib_tokens": tokens} if scheme.startswith("qfilters-") else {}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
@pytest.mark.parametrize("scheme", ["tova-b24-s2", "qfilters-b24-s2-r6", "qfilters-calibrated"])
def test_generate_step_runs_with_eviction_caches(arch, scheme):
    model = build_model(arch)
    options = calibration(scheme, 16)  # the fallback freezes inside the prompt
    if scheme == "qfilters-calibrated":
        scheme, options = (
            "qfilters-b24-s2-r6",
            {"qfilters_calibration": calibrate(model, [prompt(32, 5)], model_id=arch)},
        )
    caches = mlxkv.make_cache(model, scheme, **options)
    toks = prompt(60, 2)
    out = generate(model, caches, toks, 12, prefill_step_size=16)
    assert len(out) == 12 and all(0 <= t < 256 for t in out)
    evicting = [c for c in caches if mlxkv.is_eviction_cache(c)]
    assert evicting and all(c.offset == 72 and c.rows == 24 for c in evicting)
    assert all(sorted(set(c.positions[0, 0].tolist())) == c.positions[0, 0].tolist() for c in evicting)


@pytest.mark.parametrize("scheme", ["tova-b128-s4", "qfilters-b128-s4-r8"])
def test_below_the_budget_generation_equals_a_plain_cache(scheme):
    model = build_model("llama")
    toks = prompt(40, 4)
    plain = generate(model, mlxkv.make_cache(model, "bf16"), toks, 30)
    evict = generate(model, mlxkv.make_cache(model, scheme), toks, 30)
    assert plain == evict


@pytest.mark.parametrize("scheme", ["tova-b64-s4", "qfilters-b64-s4-r16"])
def test_512_prefill_plus_200_decode_at_budget_64_has_zero_position_drift(scheme):
    model = build_model("llama")
    toks = prompt(512, 6)
    caches = mlxkv.make_cache(model, scheme, **calibration(scheme, 128))
    out = generate(model, caches, toks, 200, prefill_step_size=96)
    seen = toks + out  # generate_step has fed the prompt and every yielded token
    assert all(c.offset == len(seen) == 712 and c.rows == 64 for c in caches)
    assert all(int(c.positions[..., -1].min().item()) == 711 for c in caches)  # newest kept everywhere
    assert all(c.compression_ratio == 712 / 64 for c in caches)
    ref = layer0_keys(model, seen)
    c = caches[0]
    # the newest key carries RoPE at its true position 711 (drift would rotate it elsewhere)
    newest = c.keys[:, :, -1]
    assert mx.allclose(newest, ref[:, :, 711], atol=2e-2).item()
    assert not mx.allclose(newest, layer0_keys(model, seen[:64])[:, :, 63], atol=2e-2).item()
    # every survivor was stored with its own original rotation and never renumbered
    kept = mx.take_along_axis(ref, c.positions[..., None].astype(mx.int32), axis=2)
    assert mx.allclose(c.keys, kept, atol=2e-2).item()
    # and the positions are gapped: rows were evicted from the middle, not only the oldest
    row = c.positions[0, 0].tolist()
    assert row[:4] == [0, 1, 2, 3] and row != [0, 1, 2, 3] + list(range(712 - 60, 712))


@pytest.mark.parametrize("scheme", ["tova-b24-s2", "qfilters-b24-s2-r6"])
def test_mlx_lm_generate_and_stream_generate_run_with_eviction_caches(scheme):
    import mlx_lm

    from mlxkv.models.seeded import tokenizer

    model, tok = build_model("gemma3"), tokenizer()
    caches = mlxkv.make_cache(model, scheme, **calibration(scheme, 16))
    text = mlx_lm.generate(model, tok, prompt(40, 4), max_tokens=8, prompt_cache=caches)
    assert text.startswith("<")
    evicting = [c for c in caches if mlxkv.is_eviction_cache(c)]
    assert evicting and all(c.rows <= 24 < c.offset for c in evicting)
    before = evicting[0].offset
    steps = list(mlx_lm.stream_generate(model, tok, prompt(3, 6), max_tokens=4, prompt_cache=caches))
    # mlx-lm forwards every sampled token (the last one while the caller reads the stream)
    assert steps and evicting[0].offset in (before + 3 + len(steps) - 1, before + 3 + len(steps))
    assert all(c.rows <= 24 for c in evicting)
