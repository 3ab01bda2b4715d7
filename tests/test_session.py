"""Sessions: a checkpoint resumed (in this process and in a fresh one) continues with logits
and tokens bit-identical to a run that never stopped, for every available cache kind."""

import json
import os
import subprocess
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest
from helpers import rewrite_header

import mlxkv
from mlxkv.caches.schemes import parse_scheme
from mlxkv.errors import CacheConfigError, CorruptSnapshotError, SchemeError, SnapshotError
from mlxkv.seeded import prompt
from mlxkv.state.session import Sampler, Session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE_SCHEMES = ["bf16", "kv4", "kv8-g32", "kv4-start16"]
OPTIONAL_SCHEMES = ["turbo-k8v3", "turbo-k4v2-start16", "tova-b32-s4", "qfilters-b32-s4-r8"]


def _accepted(scheme):
    try:
        parse_scheme(scheme)
        return True
    except SchemeError:
        return False


SCHEMES = BASE_SCHEMES + [s for s in OPTIONAL_SCHEMES if _accepted(s)]
SAMPLERS = {"greedy": Sampler(), "temp": Sampler(temperature=0.9, top_p=0.9)}
PROMPT, BEFORE, AFTER = 8, 30, 8  # 38 positions at the checkpoint: gemma3's 32-ring wrapped


def _cases():
    """(id, arch, scheme, make_cache options, tokens before the checkpoint)."""
    out = []
    for scheme in SCHEMES:
        for arch in ("llama", "gemma3", "hybrid"):
            out.append((f"{arch}-{scheme}", arch, scheme, {}, BEFORE))
        if "-start" in scheme:  # checkpoint while still bf16: converts after the restore
            out.append((f"llama-{scheme}-before-conversion", "llama", scheme, {}, 4))
    if any(s.startswith("qfilters-") for s in SCHEMES):  # key-SVD fallback: frozen and evicting,
        q = next(s for s in SCHEMES if s.startswith("qfilters-"))  # and still warming up
        out.append(("llama-qfilters-calib16-evicting", "llama", q, {"calib_tokens": 16}, BEFORE))
        out.append(("llama-qfilters-calib16-warming", "llama", q, {"calib_tokens": 16}, 4))
    out.append(("llama-ring24-keep4-wrapped", "llama", "bf16", {"max_kv_size": 24}, BEFORE))
    out.append(("llama-ring48-kv4-wrapped", "llama", "kv4", {"max_kv_size": 48}, 44))
    return out


CASES = _cases()


def _f32(logits):
    return np.array(logits.astype(mx.float32))


def _checkpoint_and_continue(model, scheme, opts, before, sampler, path):
    """Start, generate ``before``, save to ``path``, continue AFTER tokens: the run that
    never stopped. Returns (session after save, continued tokens, continued logits)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = Session.start(model, prompt(PROMPT, seed=5), scheme, sampler=sampler, seed=11, **opts)
    s.generate(before)
    s.save(path)
    saved = {
        "kinds": [c.kind for c in s.caches],
        "offsets": [c.offset for c in s.caches],
        "tokens": s.tokens,
        "pending": s.pending_token,
    }
    logits = []
    tokens = s.generate(AFTER, lambda _, row: logits.append(_f32(row)))
    return saved, tokens, np.stack(logits)


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """Every case and sampler checkpointed once; the uninterrupted continuation kept."""
    d = tmp_path_factory.mktemp("sessions")
    out = {}
    for cid, arch, scheme, opts, before in CASES:
        for sname, sampler in SAMPLERS.items():
            path = str(d / f"{cid}-{sname}.safetensors")
            out[(cid, sname)] = (path,) + _checkpoint_and_continue(models(arch), scheme, opts, before, sampler, path)
    return out


@pytest.mark.parametrize("sname", list(SAMPLERS))
@pytest.mark.parametrize("cid,arch,scheme,opts,before", CASES, ids=[c[0] for c in CASES])
def test_resume_in_process_is_bit_identical(reference, models, cid, arch, scheme, opts, before, sname):
    path, saved, ref_tokens, ref_logits = reference[(cid, sname)]
    restored = Session.restore(path, models(arch))
    assert [c.kind for c in restored.caches] == saved["kinds"]
    assert restored.tokens == saved["tokens"]
    assert restored.pending_token == saved["pending"]
    assert restored.logits is None  # nothing was recomputed
    logits = []
    tokens = restored.generate(AFTER, lambda _, row: logits.append(_f32(row)))
    assert tokens == ref_tokens
    assert np.array_equal(np.stack(logits), ref_logits)


def test_the_matrix_covers_every_kind(reference):
    kinds = {k for (_, saved, _, _) in reference.values() for k in saved["kinds"]}
    for expected in (
        "kv:plain",
        "kv:quant:4:64",
        "kv:quant:8:32",
        "kv:rotating-plain",
        "kv:rotating-quant:4:64",
        "ssm",
    ):
        assert expected in kinds
    optional = {"turbo-": "kv:turboquant:", "tova-": "kv:tova:", "qfilters-": "kv:qfilters:"}
    for scheme_prefix, kind_prefix in optional.items():
        if any(s.startswith(scheme_prefix) for s in SCHEMES):
            assert any(k.startswith(kind_prefix) for k in kinds), kind_prefix
    # eviction caches evicted before the checkpoint (fewer stored rows than positions)
    for cid in ("llama-tova-b32-s4", "llama-qfilters-calib16-evicting"):
        if (cid, "greedy") in reference:
            entry = mlxkv.read_header(reference[(cid, "greedy")][0])["caches"][0]
            assert entry["tensors"][0]["shape"][2] < entry["offset"], cid
    # the bf16-first cases really were saved before their conversion
    for cid, *_ in CASES:
        if cid.endswith("-before-conversion"):
            _, saved, _, _ = reference[(cid, "greedy")]
            assert saved["kinds"] == ["kv:plain"] * 4, cid
            entry = mlxkv.read_header(reference[(cid, "greedy")][0])["caches"][0]
            assert entry["pendingConversion"]["start"] == 16, cid
    # rings wrapped: more positions than slots, and the keep=4 ring kept its head
    head = mlxkv.read_header(reference[("llama-ring24-keep4-wrapped", "temp")][0])
    assert head["caches"][0]["keep"] == 4 and head["caches"][0]["offset"] > 24
    head = mlxkv.read_header(reference[("gemma3-bf16", "temp")][0])
    assert head["caches"][0]["kind"] == "rotating" and head["caches"][0]["offset"] > 32


RESUME_CHILD = r"""
import json, sys, warnings
import numpy as np, mlx.core as mx
warnings.simplefilter("ignore")
from mlxkv.seeded import build_model
from mlxkv.state.session import Session
jobs = json.load(open(sys.argv[1]))
models, out = {}, {}
for job in jobs:
    model = models.setdefault(job["arch"], build_model(job["arch"]))
    s = Session.restore(job["path"], model)
    logits = []
    toks = s.generate(job["steps"], lambda t, l: logits.append(np.array(l.astype(mx.float32))))
    np.save(job["path"] + ".logits.npy", np.stack(logits))
    out[job["path"]] = toks
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_process_results(reference, tmp_path_factory):
    jobs = [
        {"arch": arch, "path": reference[(cid, sname)][0], "steps": AFTER}
        for cid, arch, *_ in CASES
        for sname in SAMPLERS
    ]
    manifest = tmp_path_factory.mktemp("jobs") / "jobs.json"
    manifest.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", RESUME_CHILD, str(manifest)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sname", list(SAMPLERS))
@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_resume_in_fresh_process_is_bit_identical(reference, fresh_process_results, cid, sname):
    path, _, ref_tokens, ref_logits = reference[(cid, sname)]
    assert fresh_process_results[path] == ref_tokens
    assert np.array_equal(np.load(path + ".logits.npy"), ref_logits)


# -- the checkpoint itself -----------------------------------------------------------------


def test_checkpoint_header_records_sampler_state(models, tmp_path):
    s = Session.start(models("llama"), prompt(6), "kv4", sampler=Sampler(0.7, 0.8), seed=42)
    s.generate(3)
    header = s.save(str(tmp_path / "s.safetensors"))
    cp = header["generationCheckpoint"]
    assert cp["promptTokens"] == prompt(6)
    assert cp["generatedTokens"] == s.generated_tokens and len(cp["generatedTokens"]) == 3
    assert header["tokens"] == cp["promptTokens"] + cp["generatedTokens"]
    assert cp["pendingToken"] == s.pending_token
    assert cp["seed"] == 42
    assert cp["sampler"] == {"temperature": 0.7, "topP": 0.8}
    assert cp["key"] == s.key.tolist() and len(cp["key"]) == 2
    # the caches cover the tokens and nothing more: the pending token is not forwarded
    assert all(c.offset == 9 for c in s.caches)
    assert mlxkv.read_header(str(tmp_path / "s.safetensors"))["generationCheckpoint"] == cp


def test_restore_forwards_one_position_per_step(models, tmp_path):
    s = Session.start(models("gemma3"), prompt(10), "bf16", seed=1)
    s.generate(2)
    s.save(str(tmp_path / "s.safetensors"))
    r = Session.restore(str(tmp_path / "s.safetensors"), models("gemma3"))
    assert [c.offset for c in r.caches] == [12] * 4
    first = r.step()
    assert first == s.pending_token
    assert [c.offset for c in r.caches] == [13] * 4


def test_same_seed_same_tokens_other_seed_other_tokens(models):
    m, sampler = models("llama"), Sampler(temperature=1.5)
    a = Session.start(m, prompt(5), sampler=sampler, seed=7).generate(12)
    b = Session.start(m, prompt(5), sampler=sampler, seed=7).generate(12)
    c = Session.start(m, prompt(5), sampler=sampler, seed=8).generate(12)
    assert a == b
    assert a != c


def test_sampling_never_touches_the_global_rng(models):
    m, sampler = models("llama"), Sampler(temperature=1.5)
    mx.random.seed(0)
    a = Session.start(m, prompt(5), sampler=sampler, seed=3).generate(6)
    mx.random.seed(12345)
    mx.random.uniform(shape=(7,))
    b = Session.start(m, prompt(5), sampler=sampler, seed=3).generate(6)
    assert a == b


def test_greedy_emits_the_argmax(models):
    s = Session.start(models("hybrid"), prompt(7), "kv8-g32")
    for _ in range(4):
        expected = int(mx.argmax(s.logits).item())
        assert s.step() == expected


def test_top_p_keeps_only_the_nucleus():
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(temperature=1.0, top_p=0.7)
    key, seen = mx.random.key(0), set()
    for _ in range(200):
        tok, key = sampler.sample(logits, key)
        seen.add(int(tok.item()))
    assert seen == {0, 1}


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_sampler_is_refused(kwargs):
    with pytest.raises(CacheConfigError):
        Sampler(**kwargs)


def test_empty_prompt_is_refused(models):
    with pytest.raises(CacheConfigError, match="at least one prompt token"):
        Session.start(models("llama"), [])


def test_restore_without_checkpoint_says_to_use_load(models, tmp_path):
    m = models("llama")
    caches = mlxkv.make_cache(m, "bf16")
    m(mx.array([prompt(4)]), cache=caches)
    mlxkv.save(str(tmp_path / "plain.safetensors"), caches, prompt(4))
    with pytest.raises(SnapshotError, match="no generationCheckpoint"):
        Session.restore(str(tmp_path / "plain.safetensors"), m)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda cp: cp.update(key=[1]), "key"),
        (lambda cp: cp.update(key=[1, 2**32]), "key"),
        (lambda cp: cp.update(pendingToken="7"), "pendingToken"),
        (lambda cp: cp.update(generatedTokens=cp["generatedTokens"][:-1]), "differ"),
        (lambda cp: cp.update(sampler={"temperature": -2}), "temperature"),
    ],
)
def test_damaged_checkpoint_is_refused(models, tmp_path, edit, match):
    path = str(tmp_path / "s.safetensors")
    s = Session.start(models("llama"), prompt(4), seed=2)
    s.generate(2)
    s.save(path)
    rewrite_header(path, lambda h: edit(h["generationCheckpoint"]))
    with pytest.raises(CorruptSnapshotError, match=match):
        Session.restore(path, models("llama"))


def test_restore_checks_the_model(models, tmp_path):
    path = str(tmp_path / "s.safetensors")
    Session.start(models("llama"), prompt(4)).save(path)
    with pytest.raises(mlxkv.MLXKVError):
        Session.restore(path, models("gemma3"))
