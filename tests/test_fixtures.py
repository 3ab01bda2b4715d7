"""The committed cross-language fixtures (fixtures/, docs/fixtures.md).

- the generator rewrites them byte for byte, so any format change is a visible diff;
- every fixture loads with ``mlxkv.load`` and its header, slots and decoded values (read
  through the live caches' own read path) match the manifest;
- generation continued from every model-made fixture gives the manifest's tokens;
- every broken fixture is refused with the listed error and message.
"""

import base64
import hashlib
import importlib.util
import json
import re
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxkv
from mlxkv import errors
from mlxkv.caches.transition import Bf16FirstCache
from mlxkv.families import family_of_kind, known_persisted_kinds
from mlxkv.models.seeded import build_model
from mlxkv.session import Session
from mlxkv.state.generation_key import generation_key

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((ROOT / "manifest.json").read_text())
FIXTURES = MANIFEST["fixtures"]
BF16_STEP = 2.0**-7  # relative spacing of bfloat16 (the precision a live read decodes to)


def _generator():
    spec = importlib.util.spec_from_file_location("mlxkv_fixture_generator", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _model(arch, seed):
    return build_model(arch, seed=seed)


def _want(a: dict) -> np.ndarray:
    if a["dtype"] == "i32":
        return np.array(a["values"], np.int64).reshape(a["shape"])
    return np.frombuffer(base64.b64decode(a["base64"]), "<f4").reshape(a["shape"])


def _f32(a) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.float32))


def _close(got: np.ndarray, want: np.ndarray, exact: bool, what: str):
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN positions differ"
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:  # a live read decodes to bf16: one bf16 step of the tensor's magnitude
        finite = ~np.isnan(want)
        scale = np.abs(want[finite]).max() if finite.any() else 1.0
        np.testing.assert_allclose(got[finite], want[finite], rtol=BF16_STEP, atol=BF16_STEP * scale, err_msg=what)


def _check_layer(cache, layer: dict, where: str):
    """The live cache's own view of its rows equals the manifest's decoded values."""
    kind, want = layer["kind"], layer["decoded"]
    inner = cache.inner if isinstance(cache, Bf16FirstCache) else cache
    assert family_of_kind(cache.kind).persisted == kind, where
    if kind == "ssm":
        assert set(want) == {str(i) for i, a in enumerate(inner.cache) if a is not None}, where
        for slot, a in want.items():
            _close(_f32(inner.cache[int(slot)]), _want(a), True, f"{where} slot {slot}")
        return
    keys, values = inner.dense_window()
    if kind in ("rotating", "rotating-qkv"):
        # the package's own temporal order must be the one format.md documents
        keys, values = inner._temporal_order(keys), inner._temporal_order(values)
    exact = kind in ("kv", "rotating", "tova", "qfilters")
    _close(_f32(keys), _want(want["keys"]), exact, f"{where} keys")
    _close(_f32(values), _want(want["values"]), exact, f"{where} values")
    if kind in ("tova", "qfilters"):
        np.testing.assert_array_equal(np.array(inner.positions), _want(want["positions"]), err_msg=where)
    if kind == "qfilters":
        _close(_f32(inner.scores), _want(want["scores"]), True, f"{where} scores")
        assert ("filter" in want) == (inner.filter is not None), where
        if "filter" in want:
            _close(_f32(inner.batch_filter()), _want(want["filter"]), True, f"{where} filter")


def test_generator_rewrites_the_committed_fixtures_byte_for_byte(tmp_path):
    gen = _generator()
    gen.generate(str(tmp_path), log=lambda *a: None)
    assert gen._compare(str(ROOT), str(tmp_path)) == [], "run `python fixtures/generate.py` and commit"


def test_every_registered_persisted_kind_has_a_fixture():
    covered = {k for f in FIXTURES for k in f["kinds"]}
    assert MANIFEST["persistedKinds"] == known_persisted_kinds()
    assert set(known_persisted_kinds()) <= covered
    assert MANIFEST["skipped"] == [] and MANIFEST["uncoveredKinds"] == []
    turbo_pairs = {
        (e["kBits"], e["vBits"]) for f in FIXTURES for e in f["header"]["caches"] if e["kind"] == "turboquant"
    }
    assert turbo_pairs == {(k, v) for k in (2, 4, 5, 8) for v in (2, 3, 4, 5, 8)}


def test_typescript_reader_embeds_the_package_turboquant_constants():
    package = Path(mlxkv.__file__).parent / "math" / "turboquant_constants.json"
    assert (ROOT / "ts" / "turboquant-constants.json").read_bytes() == package.read_bytes()


def test_fixtures_stay_small():
    total = sum(
        p.stat().st_size
        for p in ROOT.rglob("*")  # mlx-bun's files: test_mlxbun.py
        if p.is_file() and p.relative_to(ROOT).parts[0] not in ("ts", "mlx-bun")
    )
    assert total < 2_500_000, f"fixtures take {total} bytes"  # 2.02 MB with 41 valid, 21 broken


@pytest.mark.parametrize("fx", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_loads_and_matches_the_manifest(fx):
    path = ROOT / fx["file"]
    data = path.read_bytes()
    assert len(data) == fx["bytes"] and hashlib.sha256(data).hexdigest() == fx["sha256"]
    assert mlxkv.read_header(str(path)) == fx["header"]
    model = _model(fx["model"]["arch"], fx["model"]["seed"]) if fx["model"] else None
    snap = mlxkv.load(str(path), model=model)
    assert snap.tokens == fx["header"]["tokens"]
    assert len(snap.caches) == len(fx["layers"]) == len(fx["header"]["caches"])
    for i, (live, layer, entry) in enumerate(zip(snap.caches, fx["layers"], fx["header"]["caches"])):
        assert [t["slot"] for t in entry["tensors"]] == [s["slot"] for s in layer["slots"]]
        assert live.offset == entry["offset"]
        assert live.minimum_reusable_offset == entry["minimumReusableOffset"]
        assert (getattr(live, "pending_conversion", None)) == entry.get("pendingConversion")
        _check_layer(live, layer, f"{fx['name']} layer {i}")


MODEL_MADE = [f for f in FIXTURES if f["model"]]


@pytest.mark.parametrize("fx", MODEL_MADE, ids=[f["name"] for f in MODEL_MADE])
def test_generation_continues_from_the_fixture(fx):
    """Restored as a Session, each checkpoint emits the manifest's tokens; the greedy ones
    also by hand: forward ``pendingToken``, take mlx-lm's greedy token (the first argmax of
    ``logits - logsumexp(logits)``, in the logits' dtype), repeat."""
    model = _model(fx["model"]["arch"], fx["model"]["seed"])
    path = str(ROOT / fx["file"])
    exact_read = _generator().exact_read  # TurboQuant fixtures continue with the read they were made with
    session = Session.restore(path, model)
    exact_read(session.caches)
    assert session.generate(len(fx["nextTokens"])) == fx["nextTokens"]
    snap = mlxkv.load(path, model=model)
    exact_read(snap.caches)
    if snap.generation_checkpoint["mlxkv"]["policy"]["temperature"] != 0:
        return
    y = snap.generation_checkpoint["pendingToken"]
    tokens = [y]
    while len(tokens) < len(fx["nextTokens"]):
        logits = model(mx.array([[y]]), cache=snap.caches)[:, -1]
        y = int(mx.argmax(logits - mx.logsumexp(logits, keepdims=True), -1).item())
        tokens.append(y)
    assert tokens == fx["nextTokens"]


def test_every_checkpoint_key_is_its_policy_s():
    for fx in MODEL_MADE:
        h = fx["header"]
        cp = h["generationCheckpoint"]
        prompt = h["tokens"][: cp["originalPromptTokens"]]
        assert generation_key(cp["mlxkv"]["policy"], prompt, cp["cacheNs"]) == cp["key"], fx["name"]


@pytest.mark.parametrize("bad", MANIFEST["broken"], ids=[b["name"] for b in MANIFEST["broken"]])
def test_broken_fixture_is_refused(bad):
    error = getattr(errors, bad["error"])
    with pytest.raises(error, match=re.escape(bad["message"])):
        mlxkv.load(str(ROOT / bad["file"]))
