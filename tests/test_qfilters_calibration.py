"""Q-Filters calibration (query SVD) and its artifact file."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import CacheConfigError, QFiltersKVCache, make_cache
from mlxkv.caches.qfilters_calibration import (
    QFiltersCalibration,
    average_gqa_filters,
    calibrate,
    collect_query_activations,
    compute_qfilters,
)
from mlxkv.errors import CorruptSnapshotError, FormatVersionError, GeometryMismatchError, IdentityMismatchError
from mlxkv.formats.qfilters_artifact import load_qfilters, save_qfilters
from mlxkv.io.safetensors import write_atomic
from mlxkv.math.qfilters import key_svd_filter
from mlxkv.models.seeded import build_model, prompt


def unit(v):
    v = mx.array(v, dtype=mx.float32)
    return v / mx.linalg.norm(v, axis=-1, keepdims=True)


def signed_cos(a, b):
    return float((mx.sum(a * b) / (mx.linalg.norm(a) * mx.linalg.norm(b))).item())


def axis(D, i, scale=1.0):
    v = np.zeros(D, np.float32)
    v[i] = scale
    return v


# -- the estimator ---------------------------------------------------------------------


def test_recovers_a_planted_drift_direction_with_its_sign():
    rng = np.random.default_rng(0)
    D = 32
    u = np.array(unit(rng.normal(size=D)))
    noise = rng.normal(size=(2, 500, D)).astype(np.float32)
    q = mx.array(3.0 * u + noise)  # queries drift along +u
    f = compute_qfilters(q)
    assert f.shape == (2, D)
    assert all(signed_cos(f[h], mx.array(u)) > 0.99 for h in range(2))
    g = compute_qfilters(mx.array(-3.0 * u + noise))  # drift negated: the filter follows
    assert all(signed_cos(g[h], mx.array(u)) < -0.99 for h in range(2))


def test_does_not_mean_center():
    """Drift along axis 0, the largest centered variance along axis 1: the paper's
    (uncentered) estimator returns the drift axis, a centering estimator the variance axis."""
    rng = np.random.default_rng(1)
    D, n = 16, 800
    x = rng.normal(size=(1, n, D)).astype(np.float32) * 0.1
    x[..., 0] += 5.0  # drift, little variance
    x[..., 1] += rng.normal(size=(1, n)).astype(np.float32) * 2.0  # variance, no drift
    q = mx.array(x)
    paper = compute_qfilters(q)[0]
    centered = key_svd_filter(q[None])[0, 0]
    assert signed_cos(paper, mx.array(axis(D, 0))) > 0.99
    assert abs(signed_cos(centered, mx.array(axis(D, 1)))) > 0.99


def test_pure_drift_is_lost_by_the_key_svd_fallback_but_not_by_query_svd():
    rng = np.random.default_rng(2)
    D, n = 128, 600  # a random direction has |cos| ~ 1/sqrt(D) = 0.09 to u
    u = np.array(unit(rng.normal(size=D)))
    x = mx.array(4.0 * u + rng.normal(size=(1, n, D)).astype(np.float32) * 0.5)  # drift only
    assert signed_cos(compute_qfilters(x)[0], mx.array(u)) > 0.99
    assert abs(signed_cos(key_svd_filter(x[None])[0, 0], mx.array(u))) < 0.3


def test_subsampling_is_deterministic_and_bounded():
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(size=(3, 5000, 16)).astype(np.float32) + 1.0)
    a = compute_qfilters(x, max_samples=700, seed=5)
    b = compute_qfilters(x, max_samples=700, seed=5)
    assert mx.array_equal(a, b)
    pick = mx.sort(mx.random.permutation(5000, key=mx.random.key(5))[:700])
    assert mx.allclose(compute_qfilters(mx.take(x, pick, axis=1), max_samples=None), a, atol=1e-5).item()
    assert not mx.array_equal(compute_qfilters(x, max_samples=700, seed=6), a)


def test_gqa_group_averaging_keeps_filters_unit_norm_and_groups_consecutive_heads():
    rng = np.random.default_rng(4)
    f = unit(rng.normal(size=(8, 16)))
    g = average_gqa_filters(f, 2)
    assert g.shape == (2, 16)
    assert mx.allclose(mx.linalg.norm(g, axis=-1), mx.ones(2), atol=1e-6).item()
    want = unit(mx.mean(f[:4], axis=0))  # kv head 0 serves query heads 0..3
    assert mx.allclose(g[0], want, atol=1e-6).item()
    with pytest.raises(CacheConfigError):
        average_gqa_filters(f, 3)
    with pytest.raises(CacheConfigError):
        average_gqa_filters(mx.concatenate([f[:1], -f[:1]]), 1)


# -- collecting queries from an mlx-lm model ---------------------------------------------


def test_collects_post_rope_queries_per_layer():
    model = build_model("llama")
    toks = [prompt(20, 1), prompt(12, 2)]
    acts = collect_query_activations(model, toks)
    assert len(acts) == 4 and all(a.shape == (4, 32, 64) and a.dtype == mx.float32 for a in acts)
    # layer 0 by hand: embed, norm, q_proj, RoPE at positions 0..L-1
    attn = model.layers[0].self_attn
    x = model.layers[0].input_layernorm(model.model.embed_tokens(mx.array(toks[1])[None]))
    q = attn.q_proj(x).reshape(1, 12, 4, 64).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, 64, traditional=attn.rope.traditional, base=attn.rope.base, scale=attn.rope.scale, offset=0)
    assert mx.allclose(acts[0][:, 20:], q[0].astype(mx.float32), atol=1e-6).item()
    assert type(attn.rope).__name__ == "RoPE"  # the tap is gone afterwards


def test_tap_is_removed_even_when_a_forward_fails():
    model = build_model("llama")
    with pytest.raises(ValueError):
        collect_query_activations(model, [prompt(8, 1), "not tokens"])
    assert all(type(layer.self_attn.rope).__name__ == "RoPE" for layer in model.layers)


def test_hybrid_model_has_no_filters_for_its_convolution_layers():
    model = build_model("hybrid")
    cal = calibrate(model, [prompt(40, 1)], model_id="seeded/hybrid@0")
    assert [f is None for f in cal.filters] == [True, False, True, False]
    assert cal.filters[1].shape == (1, 64)


# -- the artifact -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cal():
    model = build_model("llama")
    return model, calibrate(
        model, [prompt(64, s) for s in range(3)], model_id="seeded/llama@0", dataset="seeded-prompts"
    )


def test_artifact_round_trips(tmp_path, llama_cal):
    model, cal = llama_cal
    path = str(tmp_path / "qf.safetensors")
    save_qfilters(cal, path)
    back = load_qfilters(path, expect_model_id="seeded/llama@0", model=model)
    assert (back.model_id, back.n_samples, back.dataset, back.version) == ("seeded/llama@0", 192, "seeded-prompts", 1)
    assert all(mx.array_equal(a, b) for a, b in zip(cal.filters, back.filters))
    from safetensors.numpy import load_file  # a plain safetensors file for any reader

    assert sorted(load_file(path)) == ["filters.0", "filters.1", "filters.2", "filters.3"]


def test_calibrated_caches_from_a_loaded_artifact(tmp_path, llama_cal):
    model, cal = llama_cal
    path = str(tmp_path / "qf.safetensors")
    save_qfilters(cal, path)
    caches = make_cache(model, "qfilters-b16-s2-r4", qfilters_calibration=load_qfilters(path, model=model))
    model(mx.array(prompt(40, 9))[None], cache=caches)
    assert all(c.calibrated and c.rows == 16 and c.offset == 40 for c in caches)


def test_version_model_id_layer_count_and_missing_layers_refuse_to_load(tmp_path, llama_cal):
    model, cal = llama_cal
    path = str(tmp_path / "qf.safetensors")
    save_qfilters(QFiltersCalibration(cal.filters, "seeded/llama@0", 192, version=2), path)
    with pytest.raises(FormatVersionError):
        load_qfilters(path)
    save_qfilters(cal, path)
    with pytest.raises(IdentityMismatchError):
        load_qfilters(path, expect_model_id="seeded/llama@1")
    save_qfilters(QFiltersCalibration(cal.filters[:3], "seeded/llama@0", 192), path)
    load_qfilters(path)  # consistent with itself ...
    with pytest.raises(GeometryMismatchError, match="3 layers"):
        load_qfilters(path, model=model)  # ... but not with the model it is applied to
    save_qfilters(
        QFiltersCalibration([cal.filters[0], None, cal.filters[2], cal.filters[3]], "seeded/llama@0", 192), path
    )
    with pytest.raises(GeometryMismatchError, match="layer 1"):
        load_qfilters(path, model=model)
    save_qfilters(QFiltersCalibration([mx.ones((4, 64))] * 4, "seeded/llama@0", 192), path)  # query heads, not kv heads
    with pytest.raises(GeometryMismatchError, match="kv heads"):
        load_qfilters(path, model=model)


def test_gemma_needs_filters_only_for_its_full_attention_layers(tmp_path):
    model = build_model("gemma3")
    cal = calibrate(model, [prompt(40, 1)], model_id="seeded/gemma3@0")
    path = str(tmp_path / "g.safetensors")
    save_qfilters(QFiltersCalibration([None, cal.filters[1], None, cal.filters[3]], "seeded/gemma3@0", 40), path)
    back = load_qfilters(path, model=model)
    caches = make_cache(model, "qfilters-b16-s2-r2", qfilters_calibration=back)
    assert [c.kind for c in caches] == ["kv:rotating-plain", "kv:qfilters:16:2:2"] * 2


def test_damaged_artifacts_are_refused(tmp_path, llama_cal):
    _, cal = llama_cal
    path = str(tmp_path / "qf.safetensors")
    save_qfilters(cal, path)
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0x40  # a flipped bit in the last filter
    open(path, "wb").write(raw)
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        load_qfilters(path)
    # metadata that lists a layer the file does not hold
    meta = {"version": 1, "modelId": "m", "nLayers": 2, "layers": [0, 1], "nSamples": 1, "dataset": "", "crc32": {}}

    def build(crcs):
        return {"mlxkv.qfilters": json.dumps({**meta, "crc32": dict(crcs)})}

    bad = str(tmp_path / "bad.safetensors")
    write_atomic(bad, [("filters.0", mx.ones((2, 64)))], build)
    with pytest.raises(CorruptSnapshotError, match="declares layers"):
        load_qfilters(bad)
    write_atomic(bad, [("filters.0", mx.ones((2, 64)))], lambda crcs: {"other": "x"})
    with pytest.raises(CorruptSnapshotError, match="not a Q-Filters calibration"):
        load_qfilters(bad)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_calibration_for_another_head_layout_fails_at_construction(llama_cal):
    model, cal = llama_cal
    hybrid = build_model("hybrid")  # 1 kv head per layer; the llama filters have 2
    with pytest.raises(CacheConfigError, match="the filters have 2 kv heads, the layer has 1"):
        make_cache(hybrid, "qfilters-b16-s2-r2", qfilters_calibration=cal)


def test_a_cache_built_by_hand_with_foreign_filters_fails_at_the_first_append(llama_cal):
    model, cal = llama_cal
    hybrid = build_model("hybrid")
    caches = make_cache(hybrid, "bf16")
    caches[1] = QFiltersKVCache(16, 2, 2, filters=cal.filters[1])  # no geometry given
    with pytest.raises(CacheConfigError, match="wrong model or layer"):
        hybrid(mx.array(prompt(8, 1))[None], cache=caches)
