"""Train the toy model and write it to ``mlxkv/models/toy/``.

A small mlx-lm ``llama`` (byte tokens) trained on the mix of ``mlxkv.models.toy.data``: corpus
text with associative-recall pairs and queries. Deterministic: the seed fixes the initial weights
and every batch, and the arithmetic (``mlxkv.models.numpy_llama``, numpy float32) is the same on
every run on the same machine. The weights are stored in bfloat16.

Usage:
  python -m benchmarks.quality.train             # train, write mlxkv/models/toy/
  python -m benchmarks.quality.train --check     # retrain in a temporary folder, compare hashes
"""

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mlxkv.models import numpy_llama as llama
from mlxkv.models.toy import MODEL_DIR as OUT
from mlxkv.models.toy import data

SEED = 15

CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": data.VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}

# (sequence length, batch, steps): the recall circuit forms on short sequences (cheap), then
# longer ones teach it the distances up to the full context.
PHASES = [(128, 16, 1200), (512, 8, 80), (2048, 2, 40)]
LR, WARMUP, DECAY_FROM, MIN_LR_FRACTION = 3e-3, 30, 0.75, 0.1
BETAS, ADAM_EPS, WEIGHT_DECAY, CLIP = (0.9, 0.98), 1e-8, 0.01, 1.0


def learning_rate(step: int, total: int) -> float:
    """Warm-up, then constant (the recall circuit forms late), then a linear decay to
    ``MIN_LR_FRACTION`` over the last quarter."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    start = int(DECAY_FROM * total)
    if step < start:
        return LR
    t = (step - start) / max(1, total - 1 - start)
    return LR * (1 - (1 - MIN_LR_FRACTION) * t)


class AdamW:
    def __init__(self, params: dict):
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def update(self, params: dict, grads: dict, lr: float):
        self.t += 1
        b1, b2 = BETAS
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for k in sorted(params):
            g = grads[k]
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            decay = WEIGHT_DECAY if params[k].ndim == 2 else 0.0
            step = (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + ADAM_EPS) + decay * params[k]
            params[k] = (params[k] - np.float32(lr) * step).astype(np.float32)


def clip(grads: dict) -> float:
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    if norm > CLIP:
        for k, g in grads.items():
            grads[k] = g * np.float32(CLIP / norm)
    return norm


WORKERS = 2


def batch_loss_and_grads(pool, params, x, y, w):
    """``loss_and_grads`` of the whole batch from its ``WORKERS`` slices, run in parallel and
    combined in a fixed order (the same bits every run)."""
    parts = np.array_split(np.arange(x.shape[0]), WORKERS)
    futures = [pool.submit(llama.loss_and_grads, params, CONFIG, x[i], y[i], w[i]) for i in parts]
    results = [f.result() for f in futures]
    shares = [float(w[i].sum()) for i in parts]
    total = sum(shares)
    loss = sum(r[0] * s for r, s in zip(results, shares)) / total
    grads = {k: sum(r[1][k] * np.float32(s / total) for r, s in zip(results, shares)) for k in params}
    stats = {k: np.concatenate([r[2][k] for r in results]) for k in results[0][2]}
    return loss, grads, stats


def train(seed: int = SEED, phases=PHASES, log=print):
    """Train from scratch; returns (float32 params, per-step history)."""
    params = llama.init_params(CONFIG, seed)
    opt = AdamW(params)
    rng = np.random.default_rng([seed, 1])
    text = data.corpus_split("train")
    total = sum(steps for _, _, steps in phases)
    history, step, t0 = [], 0, time.perf_counter()
    pool = ThreadPoolExecutor(WORKERS)
    for length, batch, steps in phases:
        for _ in range(steps):
            x, y, w = data.training_batch(rng, batch, length, text)
            loss, grads, stats = batch_loss_and_grads(pool, params, x, y, w)
            norm = clip(grads)
            lr = learning_rate(step, total)
            opt.update(params, grads, lr)
            recall = w == data.RECALL_WEIGHT
            text_tok = w == 1.0
            row = {
                "step": step,
                "length": length,
                "loss": loss,
                "grad_norm": norm,
                "lr": lr,
                "text_nll": float(stats["nll"][text_tok].mean()),
                "answer_top1": float(stats["hit"][recall].mean()) if recall.any() else None,
                "seconds": time.perf_counter() - t0,
            }
            history.append(row)
            if step % 10 == 0 or step == total - 1:
                log(
                    f"step {step:4d} len {length:4d} loss {loss:.3f} text {row['text_nll']:.3f} "
                    f"answer top-1 {row['answer_top1']} |g| {norm:.2f} {row['seconds']:.0f}s"
                )
            step += 1
    pool.shutdown()
    return params, history


def write_model(params: dict, out: str, meta: dict):
    """``config.json``, ``model.safetensors`` (bfloat16, mlx-lm names) and ``train.json``
    (``meta`` plus the weights' sha256); returns the record written."""
    import mlx.core as mx

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
        f.write("\n")
    weights = {k: mx.array(v).astype(mx.bfloat16) for k, v in sorted(params.items())}
    path = os.path.join(out, "model.safetensors")
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})
    meta = {**meta, "model_sha256": sha256_file(path)}
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(out: str) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    params, history = train()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    meta = {
        "seed": SEED,
        "phases": [{"length": n, "batch": b, "steps": s} for n, b, s in PHASES],
        "optimizer": {
            "lr": LR,
            "warmup": WARMUP,
            "decay_from": DECAY_FROM,
            "min_lr_fraction": MIN_LR_FRACTION,
            "betas": BETAS,
            "eps": ADAM_EPS,
            "weight_decay": WEIGHT_DECAY,
            "clip": CLIP,
        },
        "corpus": data.CORPUS_NAME,
        "corpus_sha256": data.corpus_sha256(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "train_seconds": round(wall, 1),
        "train_cpu_seconds": round(cpu, 1),
        "parameters": int(sum(v.size for v in params.values())),
        "final": history[-1],
        "history": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in h.items()} for h in history[::10]],
    }
    return write_model(params, out, meta)


def single_threaded_blas():
    """Re-run this script with one OpenBLAS thread per worker, unless it already has one:
    OpenBLAS's own threads spin and collapse on a shared machine, and a fixed count keeps the
    arithmetic the same from run to run. The ``WORKERS`` halves of each batch run in Python
    threads instead (numpy releases the GIL). The variable must be set before numpy loads."""
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])


def main(argv=None):
    single_threaded_blas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true", help="retrain into a temporary folder; compare weight hashes")
    args = ap.parse_args(argv)
    if not args.check:
        meta = run(args.out)
        print(f"trained in {meta['train_seconds']} s; wrote {args.out}")
        return 0
    committed = os.path.join(args.out, "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        meta = run(tmp)
        fresh = sha256_file(os.path.join(tmp, "model.safetensors"))
    want = sha256_file(committed)
    same = fresh == want
    print(
        f"retrained in {meta['train_seconds']} s; model.safetensors sha256 {fresh} "
        f"{'==' if same else '!='} committed {want}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
