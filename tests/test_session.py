"""Sessions: a checkpoint resumed (in this process and in a fresh one) continues with logits
and tokens bit-identical to a run that never stopped, for every available cache kind and
mlx-lm's sampler settings; a session samples the tokens mlx-lm's ``generate_step`` samples;
stop tokens, token budgets and added turns follow mlx-lm's chat loop."""

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
from mlxkv.errors import (
    CacheConfigError,
    CorruptSnapshotError,
    GenerationFinishedError,
    SchemeError,
    SnapshotError,
)
from mlxkv.models.seeded import prompt
from mlxkv.session import Session, request_key, request_policy
from mlxkv.state.generation_key import generation_key
from mlxkv.state.sampler import Sampler

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
SAMPLERS = {
    "greedy": Sampler(),
    "temp": Sampler(temp=0.9, top_p=0.9, min_p=0.02, top_k=50, repetition_penalty=1.2, repetition_context_size=12),
}
#: more of mlx-lm's settings, on bf16 caches of every architecture
MORE_SAMPLERS = {
    "xtc": Sampler(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[3]),
    "penalties": Sampler(temp=0.7, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={3: 1.0, 7: -2.0}),
}
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
#: (case id, sampler name) pairs the resume tests run
#: greedy on every case; the sampler's own state (its random key, its repetition context) is
#: the same whatever the caches, so the sampling settings run on llama's cases of every scheme
#: and on bf16 of every architecture
RUNS = [(c[0], n) for c in CASES for n in SAMPLERS if n == "greedy" or c[1] == "llama" or c[2] == "bf16"] + [
    (f"{arch}-bf16", n) for arch in ("llama", "gemma3", "hybrid") for n in MORE_SAMPLERS
]
BY_ID = {c[0]: c for c in CASES}
ALL_SAMPLERS = {**SAMPLERS, **MORE_SAMPLERS}


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
    for cid, sname in RUNS:
        _, arch, scheme, opts, before = BY_ID[cid]
        path = str(d / f"{cid}-{sname}.safetensors")
        sampler = ALL_SAMPLERS[sname]
        out[(cid, sname)] = (path,) + _checkpoint_and_continue(models(arch), scheme, opts, before, sampler, path)
    return out


@pytest.mark.parametrize("cid,sname", RUNS, ids=[f"{c}-{n}" for c, n in RUNS])
def test_resume_in_process_is_bit_identical(reference, models, cid, sname):
    path, saved, ref_tokens, ref_logits = reference[(cid, sname)]
    restored = Session.restore(path, models(BY_ID[cid][1]))
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
from mlxkv.models.seeded import build_model
from mlxkv.session import Session
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
    jobs = [{"arch": BY_ID[cid][1], "path": reference[(cid, sname)][0], "steps": AFTER} for cid, sname in RUNS]
    manifest = tmp_path_factory.mktemp("jobs") / "jobs.json"
    manifest.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", RESUME_CHILD, str(manifest)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cid,sname", RUNS, ids=[f"{c}-{n}" for c, n in RUNS])
def test_resume_in_fresh_process_is_bit_identical(reference, fresh_process_results, cid, sname):
    path, _, ref_tokens, ref_logits = reference[(cid, sname)]
    assert fresh_process_results[path] == ref_tokens
    assert np.array_equal(np.load(path + ".logits.npy"), ref_logits)


# -- the checkpoint itself -----------------------------------------------------------------


def test_checkpoint_header_has_mlx_bun_fields_and_mlxkv_state(models, tmp_path):
    sampler = Sampler(temp=0.7, top_p=0.8, repetition_penalty=1.1, repetition_context_size=4)
    s = Session.start(models("llama"), prompt(6), "kv4-start16", sampler=sampler, seed=42, stop_tokens=[9, 2])
    s.generate(3)
    header = s.save(str(tmp_path / "s.safetensors"))
    cp = header["generationCheckpoint"]
    assert list(cp) == [
        "key",
        "cacheNs",
        "originalPromptTokens",
        "generatedTokens",
        "pendingToken",
        "seed",
        "seedWasExplicit",
        "mlxkv",
    ]
    assert header["formatVersion"] == 2
    assert cp["originalPromptTokens"] == 6 and cp["generatedTokens"] == 3
    assert header["tokens"] == prompt(6) + s.generated_tokens
    assert cp["pendingToken"] == s.pending_token
    assert (cp["seed"], cp["seedWasExplicit"], cp["cacheNs"]) == (42, True, "")
    own = cp["mlxkv"]
    assert own["policy"] == {
        "version": 4,
        "stopSequences": [],
        "eosTokenIds": [2, 9],
        "temperature": 0.7,
        "topP": 0.8,
        "repetitionPenalty": 1.1,
        "repetitionContextSize": 4,
        "seedMode": "explicit",
        "seed": 42,
        "kvBits": 4,
        "kvGroupSize": 64,
        "quantizedKvStart": 16,
    }
    assert own["prngKey"] == s.prng_key.tolist() and len(own["prngKey"]) == 2
    assert own["recentTokens"] == header["tokens"][-4:]  # the penalty's window
    assert own["finishReason"] is None
    assert cp["key"] == generation_key(own["policy"], prompt(6), "")
    assert cp["key"] == request_key(prompt(6), sampler, seed=42, stop_tokens=[2, 9], scheme="kv4-start16")
    # the caches cover the tokens and nothing more: the pending token is not forwarded
    assert all(c.offset == 9 for c in s.caches)
    assert mlxkv.read_header(str(tmp_path / "s.safetensors"))["generationCheckpoint"] == cp


def test_a_session_without_a_seed_records_the_default_as_not_explicit(models):
    s = Session.start(models("llama"), prompt(4), sampler=Sampler(temp=1.0))
    cp = s.checkpoint()
    assert (cp.seed, cp.seed_was_explicit) == (0, False)
    assert "seed" not in cp.state["policy"] and cp.state["policy"]["seedMode"] == "server-default"
    assert s.generate(5) == Session.start(models("llama"), prompt(4), sampler=Sampler(temp=1.0), seed=0).generate(5)


@pytest.mark.parametrize(
    "scheme,opts,fields",
    [
        ("bf16", {}, {}),
        ("kv4", {}, {"kvScheme": "kv4-g64"}),
        ("kv8-g32-start16", {}, {"kvBits": 8, "kvGroupSize": 32, "quantizedKvStart": 16}),
        ("turbo-k4v2", {}, {"turboQuant": {"kBits": 4, "vBits": 2}, "quantizedKvStart": 0}),
        ("tova-b32-s4", {}, {"kvScheme": "tova-b32-s4"}),
        ("bf16", {"max_kv_size": 24}, {"maxKvSize": 24}),
        ("kv4", {"max_kv_size": 24}, {"kvScheme": "kv4-g64", "maxKvSize": 24}),
        ("qfilters-b32-s4-r8", {}, {"kvScheme": "qfilters-b32-s4-r8+calib_tokens=128+sign=1"}),
        (
            "qfilters-b32-s4-r8",
            {"calib_tokens": 16, "sign": -1},
            {"kvScheme": "qfilters-b32-s4-r8+calib_tokens=16+sign=-1"},
        ),
        ("turbo-k4v2", {"deferred": False}, {"turboQuant": {"kBits": 4, "vBits": 2}, "quantizedKvStart": 0}),
    ],
)
def test_the_policy_names_the_cache_scheme(scheme, opts, fields):
    if not _accepted(scheme):
        pytest.skip(f"{scheme} is not available in this build")
    p = request_policy(scheme=scheme, **opts)
    assert {k: v for k, v in p.items() if k not in ("version", "stopSequences", "temperature", "seedMode")} == fields


def test_settings_that_change_nothing_are_not_in_the_policy():
    assert Sampler(temp=0, top_p=0.5, top_k=3, min_p=0.1).to_policy() == Sampler().to_policy() == {"temperature": 0}
    assert Sampler(temp=1, top_p=1.0, repetition_penalty=0).to_policy() == {"temperature": 1}
    assert request_key([1, 2], Sampler(temp=0, top_p=0.5)) == request_key([1, 2])
    assert request_key([1, 2], seed=0) != request_key([1, 2])  # an explicit seed is part of the request
    assert request_key([1, 2], ns="lora-a") != request_key([1, 2])


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
    m, sampler = models("llama"), Sampler(temp=1.5)
    a = Session.start(m, prompt(5), sampler=sampler, seed=7).generate(12)
    b = Session.start(m, prompt(5), sampler=sampler, seed=7).generate(12)
    c = Session.start(m, prompt(5), sampler=sampler, seed=8).generate(12)
    assert a == b
    assert a != c


def test_sampling_never_touches_the_global_rng(models):
    m, sampler = models("llama"), Sampler(temp=1.5, xtc_probability=0.5)
    mx.random.seed(0)
    a = Session.start(m, prompt(5), sampler=sampler, seed=3).generate(6)
    state = mx.random.state[0].tolist()
    mx.random.seed(12345)
    mx.random.uniform(shape=(7,))
    b = Session.start(m, prompt(5), sampler=sampler, seed=3).generate(6)
    assert a == b
    mx.random.seed(0)
    Session.start(m, prompt(5), sampler=sampler, seed=3).generate(6)
    assert mx.random.state[0].tolist() == state == mx.random.key(0).tolist()


def test_greedy_emits_the_argmax_of_the_logprobs(models):
    s = Session.start(models("hybrid"), prompt(7), "kv8-g32")
    for _ in range(4):
        logits = s.logits[None]
        expected = int(mx.argmax(logits - mx.logsumexp(logits, keepdims=True), -1).item())
        assert s.step() == expected


# -- sampling as mlx-lm ----------------------------------------------------------------------

MLX_LM_SAMPLERS = [
    {"temp": 0.0},
    {"temp": 0.9, "top_p": 0.9},
    {"temp": 1.0, "min_p": 0.05, "min_tokens_to_keep": 3, "top_k": 20},
    {"temp": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"temp": 1.2, "repetition_penalty": 1.3, "repetition_context_size": 6},
    {"temp": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {3: 2.0, 17: -1.5}},
]
SAMPLER_ARGS = ("temp", "top_p", "min_p", "min_tokens_to_keep", "top_k", "xtc_probability", "xtc_threshold")


def _mlx_lm(settings):
    """mlx-lm's (sampler, logits processors) for ``settings``."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    return (
        make_sampler(**{k: v for k, v in settings.items() if k in SAMPLER_ARGS}),
        make_logits_processors(**{k: v for k, v in settings.items() if k not in SAMPLER_ARGS}),
    )


def _mlx_lm_turn(model, tokens, caches, settings, max_tokens, stop=()):
    """One ``mlx_lm.generate_step`` request over ``caches`` (global RNG), consumed as
    ``stream_generate`` does: up to ``max_tokens``, breaking after a stop token."""
    from mlx_lm.generate import generate_step

    sampler, processors = _mlx_lm(settings)
    out = []
    steps = generate_step(
        mx.array(tokens),
        model,
        sampler=sampler,
        logits_processors=processors,
        prompt_cache=caches,
        prefill_step_size=8,
        max_tokens=max_tokens,
    )
    for y, _ in steps:
        out.append(y)
        if y in stop:
            break
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
@pytest.mark.parametrize("settings", MLX_LM_SAMPLERS, ids=lambda s: "-".join(s))
def test_a_session_samples_what_mlx_lm_generate_step_samples(models, arch, settings):
    model = models(arch)
    mx.random.seed(42)
    want = _mlx_lm_turn(model, prompt(20, seed=3), mlxkv.make_cache(model, "bf16"), settings, 24)
    s = Session.start(model, prompt(20, seed=3), sampler=Sampler(**settings), seed=42, prefill_step_size=8)
    assert s.generate(24) == want


def test_the_sampler_is_mlx_lm_s_with_an_explicit_key():
    from mlx_lm.sample_utils import make_sampler

    settings = {"temp": 0.7, "top_p": 0.9, "min_p": 0.02, "top_k": 50, "xtc_probability": 0.5, "xtc_threshold": 0.05}
    ours = Sampler(**settings)
    theirs = make_sampler(**settings)
    for trial in range(40):
        logits = mx.random.normal((1, 300), key=mx.random.key(1000 + trial)) * 3
        logits = logits.astype(mx.bfloat16 if trial % 2 else mx.float32)
        mx.random.seed(trial)
        want = theirs(logits - mx.logsumexp(logits, keepdims=True))
        token, key = ours.sample(logits, mx.random.key(trial))
        assert token.item() == want.item()
        assert key.tolist() == mx.random.state[0].tolist()  # the same state afterwards


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temp": -1},
        {"temp": float("nan")},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_tokens_to_keep": 0},
        {"top_k": -1},
        {"top_k": 2.5},
        {"xtc_threshold": 0.6},
        {"xtc_special_tokens": [-1]},
        {"repetition_penalty": -1.0},
        {"repetition_context_size": 0},
        {"presence_penalty": float("inf")},
        {"logit_bias": {1: "x"}},
        {"temp": True},
    ],
)
def test_bad_sampler_is_refused(kwargs):
    with pytest.raises(CacheConfigError):
        Sampler(**kwargs)


def test_top_k_at_the_vocabulary_size_is_refused_when_sampling(models):
    with pytest.raises(CacheConfigError, match="vocabulary"):
        Session.start(models("llama"), prompt(4), sampler=Sampler(temp=1.0, top_k=10_000))


def test_empty_prompt_is_refused(models):
    with pytest.raises(CacheConfigError, match="at least one prompt token"):
        Session.start(models("llama"), [])


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 2**53}, {"max_tokens": -1}, {"stop_tokens": ["a"]}])
def test_bad_request_is_refused(models, kwargs):
    with pytest.raises(CacheConfigError):
        Session.start(models("llama"), prompt(3), **kwargs)


# -- stopping and turns ----------------------------------------------------------------------


def test_a_stop_token_ends_the_request_and_the_checkpoint_records_it(models, tmp_path):
    model, sampler = models("llama"), Sampler(temp=1.0, repetition_penalty=1.2)
    free = Session.start(model, prompt(8), sampler=sampler, seed=5).generate(12)
    stop = free[6]
    s = Session.start(model, prompt(8), sampler=sampler, seed=5, stop_tokens=[stop, 99999])
    out = s.generate(100)
    assert out == free[: free.index(stop) + 1] and out[-1] == stop
    assert s.finished and s.finish_reason == "stop"
    assert all(c.offset == 8 + len(out) for c in s.caches)  # the stop token was forwarded, as mlx-lm does
    with pytest.raises(GenerationFinishedError, match="add_turn"):
        s.step()
    assert s.generate(5) == []
    s.save(str(tmp_path / "stopped.safetensors"))
    assert (
        mlxkv.read_header(str(tmp_path / "stopped.safetensors"))["generationCheckpoint"]["mlxkv"]["finishReason"]
        == "stop"
    )
    r = Session.restore(str(tmp_path / "stopped.safetensors"), model)
    assert r.finish_reason == "stop" and r.stop_tokens == tuple(sorted([stop, 99999]))
    with pytest.raises(GenerationFinishedError):
        r.step()


def test_max_tokens_ends_the_request(models):
    s = Session.start(models("gemma3"), prompt(8), sampler=Sampler(temp=0.8), seed=2, max_tokens=5)
    assert len(s.generate(100)) == 5 and s.finish_reason == "length"
    assert Session.start(models("gemma3"), prompt(8), max_tokens=0).finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_turns_are_mlx_lm_s_chat_loop(models, arch):
    """mlx-lm's chat: each turn a ``generate_step`` over the same caches, consumed up to a
    stop token or ``max_tokens``; the global RNG runs on. A session: ``max_tokens``,
    ``stop_tokens`` and ``add_turn`` give the same tokens."""
    model = models(arch)
    settings = {"temp": 0.9, "top_p": 0.95, "repetition_penalty": 1.3, "repetition_context_size": 8}
    turns = [prompt(12, seed=1), prompt(5, seed=2), prompt(9, seed=3)]
    mx.random.seed(9)
    free = _mlx_lm_turn(model, turns[0], mlxkv.make_cache(model, "bf16"), settings, 10)
    stop = free[3]  # a token that comes
    mx.random.seed(9)
    caches = mlxkv.make_cache(model, "bf16")
    want = [_mlx_lm_turn(model, t, caches, settings, 10, stop=(stop,)) for t in turns]
    assert want[0] == free[: free.index(stop) + 1]
    s = Session.start(
        model, turns[0], sampler=Sampler(**settings), seed=9, prefill_step_size=8, stop_tokens=[stop], max_tokens=10
    )
    got = [s.generate(50)]
    for t in turns[1:]:
        s.add_turn(t)
        got.append(s.generate(50))
    assert got == want
    assert s.tokens == turns[0] + got[0] + turns[1] + got[1] + turns[2] + got[2]


def test_an_added_turn_is_a_new_request_and_resumes_bit_for_bit(models, tmp_path):
    model = models("hybrid")
    sampler = Sampler(temp=1.0, min_p=0.05, repetition_penalty=1.2, repetition_context_size=6)
    s = Session.start(model, prompt(10), "kv4-start8", sampler=sampler, seed=4, stop_tokens=[1], max_tokens=6)
    first = s.generate(10)
    assert s.finished and len(first) <= 6
    turn = prompt(4, seed=9)
    s.add_turn(turn)  # the pending token is discarded, never forwarded
    assert s.tokens == s.prompt_tokens == prompt(10) + first + turn and s.generated_tokens == []
    attention = [c for c in s.caches if not mlxkv.is_recurrent_cache(c)]
    assert [c.offset for c in attention] == [len(s.tokens)] * len(attention)
    assert not s.finished
    assert s.request_key == request_key(
        s.prompt_tokens, sampler, seed=4, stop_tokens=[1], max_tokens=6, scheme="kv4-start8"
    )
    assert s.recent_tokens == turn  # mlx-lm's processors read the new request's tokens only
    s.generate(2)
    path = str(tmp_path / "turn2.safetensors")
    s.save(path)
    cp = mlxkv.read_header(path)["generationCheckpoint"]
    assert (cp["originalPromptTokens"], cp["generatedTokens"]) == (len(s.prompt_tokens), 2)
    logits = []
    want = s.generate(3, lambda _, row: logits.append(_f32(row)))
    r = Session.restore(path, model)
    got_logits = []
    assert r.generate(3, lambda _, row: got_logits.append(_f32(row))) == want
    assert np.array_equal(np.stack(got_logits), np.stack(logits))
    with pytest.raises(CacheConfigError, match="at least one token"):
        r.add_turn([])


# -- restoring -------------------------------------------------------------------------------


def test_restore_refuses_a_sampler_other_than_the_recorded_one(models, tmp_path):
    path = str(tmp_path / "s.safetensors")
    s = Session.start(models("llama"), prompt(4), sampler=Sampler(temp=0.5), seed=1, max_tokens=9)
    s.save(path)
    assert Session.restore(path, models("llama"), sampler=Sampler(temp=0.5, top_k=0), max_tokens=9).sampler == s.sampler
    for wrong in ({"sampler": Sampler(temp=0.6)}, {"max_tokens": 8}, {"stop_tokens": [3]}):
        with pytest.raises(CacheConfigError, match="records"):
            Session.restore(path, models("llama"), **wrong)


def test_restore_without_checkpoint_says_to_use_load(models, tmp_path):
    m = models("llama")
    caches = mlxkv.make_cache(m, "bf16")
    m(mx.array([prompt(4)]), cache=caches)
    mlxkv.save(str(tmp_path / "plain.safetensors"), caches, prompt(4))
    with pytest.raises(SnapshotError, match="no generationCheckpoint"):
        Session.restore(str(tmp_path / "plain.safetensors"), m)


def _own(cp):
    return cp["mlxkv"]


@pytest.mark.parametrize(
    "edit,error,match",
    [
        (lambda cp: cp.update(key=""), CorruptSnapshotError, "key"),
        (lambda cp: cp.update(generatedTokens=cp["generatedTokens"] - 1), CorruptSnapshotError, "differ"),
        (lambda cp: cp.update(originalPromptTokens=0), CorruptSnapshotError, "originalPromptTokens"),
        (lambda cp: cp.update(pendingToken="7"), CorruptSnapshotError, "pendingToken"),
        (lambda cp: cp.update(seedWasExplicit=1), CorruptSnapshotError, "seedWasExplicit"),
        (lambda cp: _own(cp).update(prngKey=[1]), CorruptSnapshotError, "prngKey"),
        (lambda cp: _own(cp).update(prngKey=[1, 2**32]), CorruptSnapshotError, "prngKey"),
        (lambda cp: _own(cp).update(recentTokens=[1.5]), CorruptSnapshotError, "recentTokens"),
        (lambda cp: _own(cp).update(finishReason="done"), CorruptSnapshotError, "finishReason"),
        (lambda cp: _own(cp)["policy"].update(temperature=-2), CorruptSnapshotError, "temp"),
        (lambda cp: _own(cp)["policy"].update(version=3), CorruptSnapshotError, "version"),
        (lambda cp: _own(cp)["policy"].update(hlg=True), SnapshotError, "does not implement"),
        (lambda cp: _own(cp)["policy"].update(stopSequences=["\n\n"]), SnapshotError, "stops on tokens only"),
        (lambda cp: _own(cp)["policy"].pop("seed"), CorruptSnapshotError, "seedMode"),
        (lambda cp: cp.update(promptTokens=[1]), None, None),  # an unknown field: ignored
    ],
)
def test_damaged_checkpoint_is_refused(models, tmp_path, edit, error, match):
    path = str(tmp_path / "s.safetensors")
    s = Session.start(models("llama"), prompt(4), sampler=Sampler(temp=0.5), seed=2)
    s.generate(2)
    s.save(path)
    rewrite_header(path, lambda h: edit(h["generationCheckpoint"]))
    if error is None:
        Session.restore(path, models("llama")).generate(1)
        return
    with pytest.raises(error, match=match):
        Session.restore(path, models("llama"))


def test_restore_checks_the_model(models, tmp_path):
    path = str(tmp_path / "s.safetensors")
    Session.start(models("llama"), prompt(4)).save(path)
    with pytest.raises(mlxkv.MLXKVError):
        Session.restore(path, models("gemma3"))


# -- mlx-bun's files ---------------------------------------------------------------------------


def test_a_session_saved_as_mlx_bun_resumes_bit_for_bit(models, tmp_path):
    model = models("gemma3")  # rings and kv4 (the hybrid's one-array recurrent state has no mlx-bun form)
    sampler = Sampler(temp=0.9, top_k=30, repetition_penalty=1.2, repetition_context_size=5)
    s = Session.start(model, prompt(9), "kv4-start8", sampler=sampler, seed=6)
    s.generate(12)
    path = str(tmp_path / "s.mlxkv")
    s.save(path, format="mlx-bun")
    raw = json.loads(open(path, "rb").read()[26 : 26 + int.from_bytes(open(path, "rb").read()[10:14], "little")])
    assert raw["formatVersion"] == 3 and list(raw["generationCheckpoint"])[:7] == list(s.checkpoint().to_header())[:7]
    logits = []
    want = s.generate(6, lambda _, row: logits.append(_f32(row)))
    got_logits = []
    r = Session.restore(path, model)
    assert r.generate(6, lambda _, row: got_logits.append(_f32(row))) == want
    assert np.array_equal(np.stack(got_logits), np.stack(logits))


@pytest.mark.parametrize(
    "sampler",
    [Sampler(temp=1.1, repetition_penalty=1.3, repetition_context_size=7), Sampler(temp=0.9, xtc_probability=0.6)],
    ids=["penalty", "xtc"],
)
def test_an_mlx_bun_checkpoint_resumes_with_the_given_sampler(models, tmp_path, sampler):
    """mlx-bun's checkpoint records no sampler state. Given the sampler, mlxkv resumes with
    the PRNG key a session of that seed holds after the same samples, and the recent tokens
    of the single request: the continuation of the uninterrupted session."""
    model = models("llama")
    s = Session.start(model, prompt(8), sampler=sampler, seed=21)
    s.generate(9)
    path = str(tmp_path / "bun.mlxkv")
    s.save(path, format="mlx-bun")
    rewrite_mlx_bun_checkpoint(path, lambda cp: cp.pop("mlxkv"))
    want = s.generate(8)
    with pytest.raises(SnapshotError, match="pass sampler="):
        Session.restore(path, model)
    r = Session.restore(path, model, sampler=sampler)
    assert r.request_key == s.request_key  # the file's key, kept
    assert r.generate(8) == want


def rewrite_mlx_bun_checkpoint(path, edit):
    """Edit the generationCheckpoint of an mlx-bun file written by mlxkv (rewritten by mlxkv:
    the same caches, the edited checkpoint)."""
    snap = mlxkv.load(path)
    cp = dict(snap.header["generationCheckpoint"])
    edit(cp)
    mlxkv.save(path, snap.caches, snap.tokens, format="mlx-bun", generation_checkpoint=cp)
