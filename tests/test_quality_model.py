"""The committed quality model and the quality benchmark (docs/choosing-a-scheme.md).

- the numpy llama the model is trained with computes mlx-lm's llama: loss and gradients
  equal MLX autograd's on the mlx-lm module;
- the committed weights are the ones the recorded training run wrote, and load as an
  mlx-lm llama;
- with bf16 caches the model recalls answer letters above chance at its full context;
- the benchmark's reduced grid runs and its table is sane.
"""

import hashlib
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

import mlxkv
from mlxkv.models import numpy_llama
from mlxkv.models import toy as quality_model
from mlxkv.models.toy import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Answer letters are uniform over 26 lowercase letters: a model that does not look back at the
# definitions gets 1/26 of them right (teacher-forced top-1). With bf16 caches at its full
# context the model must beat that by at least this much.
CHANCE = 1 / 26
RECALL_MARGIN = 0.1


@pytest.fixture(scope="module")
def model():
    return quality_model.load()


def test_numpy_llama_is_mlx_lms_llama():
    from mlx_lm.utils import _get_classes

    cfg = {**quality_model.config(), "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    params = numpy_llama.init_params(cfg, seed=3)
    rng = np.random.default_rng(4)
    for k in params:  # move away from the init's unit norms and tiny weights
        params[k] = (params[k] * 5 + (0.1 * rng.standard_normal(params[k].shape) if "norm" in k else 0)).astype(
            np.float32
        )
    x, y = rng.integers(0, cfg["vocab_size"], (2, 40)), rng.integers(0, cfg["vocab_size"], (2, 40))
    w = rng.random((2, 40)).astype(np.float32)
    loss, grads, _ = numpy_llama.loss_and_grads(params, cfg, x, y, w)

    model_class, args_class = _get_classes(cfg)
    m = model_class(args_class.from_dict(cfg))
    m.load_weights([(k, mx.array(v)) for k, v in params.items()])

    def weighted_ce(m, x, y, w):
        return (nn.losses.cross_entropy(m(x), y) * w).sum() / w.sum()

    want_loss, want = nn.value_and_grad(m, weighted_ce)(m, mx.array(x), mx.array(y), mx.array(w))
    want = dict(tree_flatten(want))
    assert set(want) == set(grads)
    assert abs(loss - want_loss.item()) < 1e-4
    for k, g in grads.items():
        ref = np.array(want[k])
        assert np.abs(g - ref).max() <= 1e-4 * np.abs(ref).max(), k


def test_committed_weights_are_the_recorded_run(model):
    record = quality_model.training_record()
    path = quality_model.MODEL_DIR / "model.safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["model_sha256"]
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert n == record["parameters"]
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(model.parameters()))
    assert record["corpus"] == data.CORPUS_NAME
    files = ("config.json", "model.safetensors", "train.json")
    shipped = sum((quality_model.MODEL_DIR / f).stat().st_size for f in files)
    assert shipped < 2_000_000, f"the shipped model takes {shipped} bytes"


def test_bf16_recall_beats_chance_at_full_context(model):
    L = quality_model.config()["max_position_embeddings"]
    batch = data.recall_batch(seed=7, batch=4, length=L, n_pairs=16, text=data.corpus_split("eval"))
    acc, _ = data.recall_accuracy(model, mlxkv.make_cache(model, "bf16"), batch, chunk=512)
    assert acc >= CHANCE + RECALL_MARGIN, f"recall {acc:.3f} on {batch.n_queries * 4 * data.VALUE_LEN} letters"


def test_reduced_benchmark_table(tmp_path):
    """The benchmark's documented CI command runs as written and writes a sane table."""
    out = tmp_path / "quality.json"
    cmd = [sys.executable, "-m", "benchmarks.quality", "--reduced", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    table = json.loads(out.read_text())
    plot = [sys.executable, "-m", "benchmarks.quality.plot", str(out), "--markdown"]
    shown = subprocess.run([*plot, "256"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.count("\n| ") == len(table["rows"])
    absent = subprocess.run([*plot, "256", "1024"], cwd=ROOT, capture_output=True, text=True)
    assert absent.returncode == 2 and "no rows at context [1024]: it measured [256]" in absent.stderr
    rows = {(r["family"], r["setting"]): r for r in table["rows"]}
    families = ("tova", "qfilters-calibrated", "qfilters-fallback", "window")
    want = {("bf16", "bf16"), ("kv", "4-bit"), ("kv", "8-bit"), ("turbo", "k8v3"), *((f, "64") for f in families)}
    assert set(rows) == want
    fields = {
        "family",
        "scheme",
        "setting",
        "budget",
        "context",
        "bytes_per_token",
        "marginal_bytes_per_token",
        "ppl",
        "rel_ppl",
        "kl",
        "recall",
        "recall_exact",
        "seconds",
    }
    assert all(set(r) == fields for r in table["rows"])
    bf16 = rows["bf16", "bf16"]
    assert bf16["rel_ppl"] == 1.0 and bf16["kl"] == 0.0
    cfg = quality_model.config()
    assert bf16["bytes_per_token"] == cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 2
    assert rows["kv", "8-bit"]["kl"] < 1e-2
    assert rows["kv", "4-bit"]["bytes_per_token"] < rows["kv", "8-bit"]["bytes_per_token"] < bf16["bytes_per_token"]
    filter_bytes = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # Q-Filters
    for r in table["rows"]:
        assert 0.0 <= r["recall_exact"] <= r["recall"] <= 1.0 and r["kl"] >= 0.0 and r["rel_ppl"] > 0.5
        if r["budget"] is not None:  # holds at most its budget
            assert r["bytes_per_token"] * r["context"] <= r["budget"] * r["marginal_bytes_per_token"] + filter_bytes
