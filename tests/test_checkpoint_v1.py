"""Snapshots of format 1 keep loading and resuming bit for bit.

``tests/data/format-v1/`` holds files written once by mlxkv's format 1 (``make_v1.py`` says
how; they are never regenerated) with the continuation that mlxkv produced after saving them.
Their checkpoints (token lists, ``sampler``, PRNG ``key``) are read into format 2's shape;
their sampler keeps format 1's rules (``samplerRules: "mlxkv-1"``) wherever the session goes:
re-saved, converted, through a prompt store.

The restores pass ``config_fingerprint=None``: those files carry the fingerprint format-1-era
mlxkv derived, and how a fingerprint is derived is not what these tests are about.
"""

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxkv
from mlxkv.cli import main as cli
from mlxkv.session import Session
from mlxkv.state.checkpoint import read_checkpoint
from mlxkv.state.sampler import SamplerV1

DATA = Path(__file__).resolve().parent / "data" / "format-v1"
EXPECTED = json.loads((DATA / "expected.json").read_text())
NAMES = sorted(EXPECTED)


def _digest(logits) -> str:
    return hashlib.sha256(np.stack(logits).astype("<f4").tobytes()).hexdigest()


def _f32(row):
    return np.array(row.astype(mx.float32))


def _restore(path, models, **kw):
    return Session.restore(str(path), models(EXPECTED[Path(path).name]["arch"]), config_fingerprint=None, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_a_format_1_file_resumes_as_it_did_when_written(models, name):
    path = DATA / name
    want = EXPECTED[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == want["sha256"], "a format-1 file was rewritten"
    header = mlxkv.read_header(str(path))
    assert header["formatVersion"] == 1 and "promptTokens" in header["generationCheckpoint"]
    s = _restore(path, models)
    assert isinstance(s.sampler, SamplerV1) and s.seed_was_explicit
    logits = []
    assert s.generate(len(want["tokens"]), lambda _, row: logits.append(_f32(row))) == want["tokens"]
    if want["logitsSha256"]:
        assert _digest(logits) == want["logitsSha256"]


def test_the_format_1_checkpoint_reads_as_format_2(models):
    header = mlxkv.read_header(str(DATA / "session-temp-llama.safetensors"))
    v1 = header["generationCheckpoint"]
    cp = read_checkpoint(header)
    assert cp.original_prompt_tokens == len(v1["promptTokens"])
    assert cp.generated_tokens == len(v1["generatedTokens"])
    assert (cp.pending_token, cp.seed, cp.seed_was_explicit, cp.cache_ns) == (v1["pendingToken"], v1["seed"], True, "")
    assert cp.state["prngKey"] == v1["key"] and cp.state["recentTokens"] == [] and cp.state["finishReason"] is None
    policy = cp.state["policy"]
    assert policy["samplerRules"] == "mlxkv-1"
    assert (policy["temperature"], policy["topP"]) == (v1["sampler"]["temperature"], v1["sampler"]["topP"])


@pytest.mark.parametrize("name", ["session-temp-llama.safetensors", "session-greedy-gemma3-kv4.safetensors"])
def test_a_resumed_format_1_session_saved_again_keeps_its_rules(models, tmp_path, name):
    s = _restore(DATA / name, models)
    s.generate(3)
    path = tmp_path / name
    s.save(str(path))
    header = mlxkv.read_header(str(path))
    assert header["formatVersion"] == 2
    assert header["generationCheckpoint"]["mlxkv"]["policy"]["samplerRules"] == "mlxkv-1"
    logits = []
    want = s.generate(5, lambda _, row: logits.append(_f32(row)))
    r = _restore(path, models)
    got = []
    assert r.generate(5, lambda _, row: got.append(_f32(row))) == want
    assert np.array_equal(np.stack(got), np.stack(logits))


def test_converting_a_format_1_file_writes_format_2(models, tmp_path):
    name = "session-temp-hybrid.safetensors"
    out = tmp_path / name
    assert cli(["convert", str(DATA / name), str(out)]) == 0
    header = mlxkv.read_header(str(out))
    assert header["formatVersion"] == 2 and header["generationCheckpoint"]["originalPromptTokens"] == 8
    logits = []
    assert _restore(out, models).generate(8, lambda _, row: logits.append(_f32(row))) == EXPECTED[name]["tokens"]
    assert _digest(logits) == EXPECTED[name]["logitsSha256"]


def test_inspect_shows_a_format_1_checkpoint(capsys):
    assert cli(["inspect", str(DATA / "session-temp-llama.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "formatVersion         1" in out
    assert "prompt 8 + generated 10 tokens" in out and '"samplerRules":"mlxkv-1"' in out
    assert "(= the recorded policy's)" in out


def test_a_prompt_store_finds_a_format_1_checkpoint(models, tmp_path):
    """A store directory written before format 2: its checkpoint files are indexed and found
    by the request key format 2 computes for them."""
    name = "session-temp-llama.safetensors"
    header = mlxkv.read_header(str(DATA / name))
    identity = {"model_id": header["modelId"], "config_fingerprint": header["configFingerprint"], "tokenizer_hash": ""}
    model = models("llama")
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path), identity=identity) as store:
        root = store._disk.root
    shutil.copy(DATA / name, Path(root) / "from-format-1.safetensors")
    cp = read_checkpoint(header)
    prompt = header["tokens"][: cp.original_prompt_tokens]
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path), identity=identity) as store:
        assert store.opened.indexed == 1
        s = store.find_checkpoint(prompt, cp.key)
        assert s is not None and isinstance(s.sampler, SamplerV1)
        assert s.generate(8) == EXPECTED[name]["tokens"]
