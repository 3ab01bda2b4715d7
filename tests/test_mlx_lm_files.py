"""Files written by mlx-lm's own ``save_prompt_cache``: read, converted, continued."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.errors import CorruptSnapshotError, SnapshotError, UnknownKindError
from mlxkv.formats.mlxlm import (
    MissingTokensError,
    OldPromptCacheLayoutError,
    UnsupportedPromptCacheClassError,
    parse_tokens,
    read_prompt_cache,
)
from mlxkv.formats.table import convert_prompt_cache
from mlxkv.models.seeded import prompt

PROMPT = 40  # > gemma3's 32-slot sliding window: its rings have wrapped


def _mlx_lm_file(model, path, tokens, caches=None, metadata=None, decode=2):
    """Prefill ``tokens`` (then decode a couple of greedy steps) with mlx-lm caches and save
    them with mlx-lm. Returns the full token list the caches cover."""
    caches = caches if caches is not None else mlx_cache.make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=caches)[0, -1]
    tokens = list(tokens)
    for _ in range(decode):
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[0, -1]
    mx.eval(logits)
    mlx_cache.save_prompt_cache(path, caches, metadata or {"model": "seeded"})
    return tokens


def _continue(model, caches, first, n):
    out, y = [], first
    for _ in range(n):
        logits = model(mx.array([[y]]), cache=caches)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        y = int(mx.argmax(logits).item())
    return np.stack(out)


def _ring_caches(model, size, keep):
    return [mlx_cache.RotatingKVCache(max_size=size, keep=keep) for _ in model.layers]


def _quant_caches(model):
    return [mlx_cache.QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]


FILES = [
    ("llama", None),
    ("gemma3", None),
    ("hybrid", None),
    ("llama", "ring24-keep4"),
    ("llama", "quantized"),
]


@pytest.mark.parametrize("arch,variant", FILES, ids=[f"{a}-{v or 'own'}" for a, v in FILES])
def test_converted_file_continues_like_mlx_lm(models, tmp_path, arch, variant):
    model = models(arch)
    src, dst = str(tmp_path / "mlx.safetensors"), str(tmp_path / "mlxkv.safetensors")
    caches = {None: None, "ring24-keep4": _ring_caches(model, 24, 4), "quantized": _quant_caches(model)}[variant]
    tokens = _mlx_lm_file(model, src, prompt(PROMPT, seed=3), caches)

    header = convert_prompt_cache(src, dst, tokens=tokens)
    assert header["tokens"] == tokens and header["modelId"] == "seeded"
    snap = mlxkv.load(dst, model=model)
    theirs = mlx_cache.load_prompt_cache(src)
    assert [c.offset for c in snap.caches if c.kind != "ssm"] == [
        c.offset for c in theirs if not isinstance(c, mlx_cache.ArraysCache)
    ]
    ours = _continue(model, snap.caches, 17, 12)
    reference = _continue(model, theirs, 17, 12)
    assert np.array_equal(ours, reference)


def test_kinds_and_no_slack_on_disk(models, tmp_path):
    model = models("gemma3")
    src, dst = str(tmp_path / "mlx.safetensors"), str(tmp_path / "mlxkv.safetensors")
    tokens = _mlx_lm_file(model, src, prompt(PROMPT), decode=0)
    convert_prompt_cache(src, dst, tokens=tokens)
    head = mlxkv.read_header(dst)
    assert [e["kind"] for e in head["caches"]] == ["rotating", "kv", "rotating", "kv"]
    plain = head["caches"][1]["tensors"][0]
    assert plain["shape"][2] == PROMPT  # mlx-lm wrote 256 rows; the snapshot holds the offset
    assert os.path.getsize(dst) < os.path.getsize(src)


def test_hybrid_recurrent_layers_take_the_token_count(models, tmp_path):
    model = models("hybrid")
    src = str(tmp_path / "mlx.safetensors")
    tokens = _mlx_lm_file(model, src, prompt(12))
    pc = read_prompt_cache(src, tokens)
    assert pc.classes == ["ArraysCache", "KVCache", "ArraysCache", "KVCache"]
    assert [c.kind for c in pc.caches] == ["ssm", "kv:plain", "ssm", "kv:plain"]
    assert all(c.offset == len(tokens) for c in pc.caches)


def test_tokens_from_metadata(models, tmp_path):
    model = models("llama")
    src, dst = str(tmp_path / "mlx.safetensors"), str(tmp_path / "mlxkv.safetensors")
    toks = prompt(9)
    _mlx_lm_file(model, src, toks, metadata={"model": "m", "tokens": json.dumps(toks)}, decode=0)
    assert convert_prompt_cache(src, dst)["tokens"] == toks
    with pytest.raises(MissingTokensError, match="differ"):
        convert_prompt_cache(src, dst, tokens=toks[::-1])


def test_missing_or_wrong_tokens_are_refused(models, tmp_path):
    model = models("llama")
    src, dst = str(tmp_path / "mlx.safetensors"), str(tmp_path / "mlxkv.safetensors")
    tokens = _mlx_lm_file(model, src, prompt(9), decode=0)
    with pytest.raises(MissingTokensError, match="do not record their tokens.*9 positions.*--tokens"):
        convert_prompt_cache(src, dst)
    with pytest.raises(MissingTokensError, match="cover 9 positions but 8 tokens"):
        convert_prompt_cache(src, dst, tokens=tokens[:-1])
    assert not os.path.exists(dst)


def _old_layout_file(path, model, tokens):
    """A file in mlx-lm's layout before the scalars moved into ``state``:
    ``[meta_state per cache, metadata, class names]``, keys sliced to the offset."""
    caches = mlx_cache.make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    n = len(tokens)
    state = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in caches]
    meta = [["" for _ in caches], {"model": "old"}, [type(c).__name__ for c in caches]]
    mx.save_safetensors(path, dict(tree_flatten(state)), dict(tree_flatten(meta)))


def test_old_layout_is_refused(models, tmp_path):
    src = str(tmp_path / "old.safetensors")
    _old_layout_file(src, models("llama"), prompt(6))
    with pytest.raises(OldPromptCacheLayoutError, match="older than the current save_prompt_cache layout"):
        convert_prompt_cache(src, str(tmp_path / "out.safetensors"), tokens=prompt(6))
    with pytest.raises(OldPromptCacheLayoutError):
        read_prompt_cache(src)


def test_unsupported_class_is_named(tmp_path):
    src = str(tmp_path / "list.safetensors")
    c = mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.KVCache())
    for sub in c.caches:
        sub.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    mlx_cache.save_prompt_cache(src, [c])
    with pytest.raises(UnsupportedPromptCacheClassError, match="'CacheList'") as e:
        read_prompt_cache(src)
    assert isinstance(e.value, UnknownKindError)


def test_not_a_prompt_cache_file(models, tmp_path):
    m = models("llama")
    caches = mlxkv.make_cache(m)
    m(mx.array([prompt(4)]), cache=caches)
    ours = str(tmp_path / "snap.safetensors")
    mlxkv.save(ours, caches, prompt(4))
    with pytest.raises(SnapshotError, match="already an mlxkv snapshot"):
        read_prompt_cache(ours)
    plain = str(tmp_path / "plain.safetensors")
    mx.save_safetensors(plain, {"w": mx.zeros((2,))})
    with pytest.raises(SnapshotError, match="not an mlx-lm prompt-cache file"):
        read_prompt_cache(plain)


def test_damaged_structure_is_refused(models, tmp_path):
    """A scalar the class needs stored as a plain tensor: refused before building caches."""
    src = str(tmp_path / "bad.safetensors")
    arrays = {
        "0.0": mx.zeros((1, 2, 4, 64), mx.bfloat16),
        "0.1": mx.zeros((1, 2, 4, 64), mx.bfloat16),
        "0.2": mx.array(4),
    }
    mx.save_safetensors(src, arrays, {"1.0": "KVCache", "2.0": ""})  # "0.2" not declared a scalar
    with pytest.raises(CorruptSnapshotError, match="not a scalar"):
        read_prompt_cache(src)
    arrays["0.2"] = mx.array(9)  # offset beyond the stored rows
    mx.save_safetensors(src, arrays, {"1.0": "KVCache", "2.0": "", "2.1.0": "0.2", "2.1.1": "scalar"})
    with pytest.raises(CorruptSnapshotError, match="cannot hold offset 9"):
        read_prompt_cache(src)


@pytest.mark.parametrize("text", ["1,2,3", "1 2 3", "[1, 2, 3]", " 1, 2 ,3\n"])
def test_parse_tokens(text):
    assert parse_tokens(text) == [1, 2, 3]


def test_parse_tokens_from_file_and_errors(tmp_path):
    f = tmp_path / "ids.json"
    f.write_text("[4, 5]")
    assert parse_tokens(f"@{f}") == [4, 5]
    with pytest.raises(mlxkv.MLXKVError):
        parse_tokens("1,x,3")
    with pytest.raises(mlxkv.MLXKVError):
        parse_tokens('["a"]')
