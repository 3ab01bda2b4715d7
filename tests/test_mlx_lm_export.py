"""Prompt-cache files for mlx-lm (``save(..., format="mlx-lm")``, ``mlxkv convert --to
mlx-lm``): mlx-lm's own ``load_prompt_cache`` and ``mlx_lm.generate --prompt-cache-file``
read them in a fresh process that imports no mlxkv, and continue as mlxkv's caches do."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import mlxkv
from mlxkv.errors import SnapshotError, UnsupportedKindError
from mlxkv.models.seeded import prompt, save_model_dir, tokenizer

#: (architecture, scheme, prompt length): every kind mlx-lm has a class of; gemma3's
#: 40-token prompt wraps its 32-slot rings (a ring of maxSize - 1 + S rows)
CASES = [
    ("llama", "bf16", 20),
    ("llama", "kv4", 20),
    ("gemma3", "bf16", 40),
    ("gemma3", "kv8-g32", 40),
    ("hybrid", "bf16", 20),
    ("hybrid", "kv8-g32", 20),
]
CONTINUE = 6

#: run by a fresh interpreter: mlx-lm alone loads each file and continues greedily
MLX_LM_SIDE = r"""
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache

out = {}
for case in json.loads(sys.argv[1]):
    model, _ = load(case["model"])
    cache, meta = load_prompt_cache(case["file"], return_metadata=True)
    steps = generate_step(mx.array([case["last"]]), model, prompt_cache=cache, max_tokens=case["n"])
    out[case["file"]] = {
        "tokens": [int(t) for t, _ in steps],
        "classes": [type(c).__name__ for c in cache],
        "meta": meta,
        "mlxkv": any(m.startswith("mlxkv") for m in sys.modules),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {a: save_model_dir(a, str(tmp_path_factory.mktemp(f"seeded-{a}"))) for a in ("llama", "gemma3", "hybrid")}


def _prefilled(model_dir, scheme, n):
    """mlxkv caches of ``scheme`` holding all but the last of n prompt tokens."""
    from mlx_lm import load

    model, _ = load(model_dir)
    tokens = prompt(n)
    caches = mlxkv.make_cache(model, scheme)
    model(mx.array([tokens[:-1]]), cache=caches)
    return model, caches, tokens


def _mlxkv_continuation(model, caches, last, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array([last]), model, prompt_cache=caches, max_tokens=n)]


def _run_mlx_lm(cases):
    r = subprocess.run(
        [sys.executable, "-c", MLX_LM_SIDE, json.dumps(cases)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_mlx_lm_loads_and_continues_every_kind_it_has(model_dirs, tmp_path):
    """Each file, loaded by mlx-lm's own ``load_prompt_cache`` in a fresh process, continues
    with exactly the greedy tokens mlxkv's caches it was written from give."""
    cases, want = [], {}
    for arch, scheme, n in CASES:
        model, caches, tokens = _prefilled(model_dirs[arch], scheme, n)
        path = str(tmp_path / f"{arch}-{scheme}.safetensors")
        header = mlxkv.save(path, caches, tokens[:-1], format="mlx-lm", model_id=model_dirs[arch])
        want[path] = (_mlxkv_continuation(model, caches, tokens[-1], CONTINUE), header["classes"], tokens[:-1], arch)
        cases.append({"model": model_dirs[arch], "file": path, "last": tokens[-1], "n": CONTINUE})
    got = _run_mlx_lm(cases)
    seen = set()
    for path, (tokens, classes, covered, arch) in want.items():
        g = got[path]
        assert not g["mlxkv"]  # mlx-lm's code alone read the file
        assert g["classes"] == classes and g["tokens"] == tokens, path
        assert json.loads(g["meta"]["tokens"]) == covered and g["meta"]["model"] == model_dirs[arch]
        seen.update(classes)
    assert seen == {"KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache"}


def test_convert_to_mlx_lm_and_mlx_lm_generate_continue(model_dirs, tmp_path):
    """``mlxkv convert SNAP OUT --to mlx-lm`` (a fresh process), then ``mlx_lm.generate
    --prompt-cache-file OUT`` (another) continues the prompt; the file converts back to the
    same snapshot caches and tokens (the tokens ride in its metadata)."""
    model, caches, tokens = _prefilled(model_dirs["gemma3"], "bf16", 40)
    snap, out = str(tmp_path / "snap.safetensors"), str(tmp_path / "prompt.safetensors")
    mlxkv.save(snap, caches, tokens[:-1], model_id=model_dirs["gemma3"])
    r = subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", "convert", snap, out, "--to", "mlx-lm"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "(mlx-lm)" in r.stdout
    want = _mlxkv_continuation(model, caches, tokens[-1], CONTINUE)
    text = tokenizer().decode(want)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--prompt-cache-file",
            out,
            "--prompt",
            f"<{tokens[-1]:02x}>",
            "--max-tokens",
            str(CONTINUE),
            "--ignore-chat-template",
            "--temp",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert text.strip() and text.strip() in r.stdout, (text, r.stdout)
    pc = mlxkv.read_prompt_cache(out)  # what docs/sessions.md says it returns
    assert pc.tokens == tokens[:-1] and pc.offset == len(tokens) - 1 and pc.metadata["model"] == model_dirs["gemma3"]
    assert pc.classes == [type(c).__name__ for c in caches] and [c.kind for c in pc.caches] == [c.kind for c in caches]
    back = str(tmp_path / "back.safetensors")
    from mlxkv.formats.table import convert

    convert(out, back)
    again = mlxkv.load(back)
    original = mlxkv.load(snap)
    assert again.tokens == original.tokens
    for a, b in zip(again.caches, original.caches):
        assert a.kind == b.kind and mx.array_equal(a.state[0], b.state[0])


@pytest.mark.parametrize(
    "arch, scheme, options",
    [
        ("llama", "turbo-k8v3", {}),
        ("llama", "tova-b32-s4", {}),
        ("llama", "qfilters-b32-s4-r8", {}),
        ("llama", "kv4-start16", {}),
        ("llama", "kv4", {"max_kv_size": 16}),
    ],
)
def test_kinds_mlx_lm_lacks_are_refused_by_name_before_writing(model_dirs, tmp_path, arch, scheme, options):
    from mlx_lm import load

    model, _ = load(model_dirs[arch])
    caches = mlxkv.make_cache(model, scheme, **options)
    tokens = prompt(12)
    model(mx.array([tokens]), cache=caches)
    path = tmp_path / "out.safetensors"
    with pytest.raises(UnsupportedKindError) as e:
        mlxkv.save(str(path), caches, tokens, format="mlx-lm")
    assert caches[0].kind.split(":")[1] in str(e.value) or "bf16-first" in str(e.value)
    assert "mlxkv snapshot or an mlx-bun file" in str(e.value)
    assert not path.exists() and not os.listdir(tmp_path)


def test_what_mlx_lm_files_have_no_place_for_is_refused(model_dirs, tmp_path):
    from mlx_lm import load

    model, _ = load(model_dirs["llama"])
    caches = mlxkv.make_cache(model, "bf16")
    tokens = prompt(8)
    model(mx.array([tokens]), cache=caches)
    with pytest.raises(SnapshotError, match="no place for attachments"):
        mlxkv.save(str(tmp_path / "a.safetensors"), caches, tokens, format="mlx-lm", attachments={"x": 1})
    assert not os.listdir(tmp_path)
