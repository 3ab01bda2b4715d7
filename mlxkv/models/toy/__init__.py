"""The toy model: a small llama (byte tokens, 690k parameters) trained on the associative-recall
task of ``data.py``, shipped with the package so the scheme tests have a model that looks back
at its context. ``benchmarks/quality/train.py`` trained it (``train.json`` records the run).
"""

import hashlib
import json
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent


def model_id(path: Path = MODEL_DIR) -> str:
    """``mlxkv/quality-model@<first 12 hex of the weights' sha256>``."""
    digest = hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()
    return f"mlxkv/quality-model@{digest[:12]}"


def load(path: Path = MODEL_DIR):
    """The model in eval mode, bfloat16 weights as stored; ``mlxkv_model_id`` is set."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    model.eval()
    model.mlxkv_model_id = model_id(path)
    return model


def config(path: Path = MODEL_DIR) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def training_record(path: Path = MODEL_DIR) -> dict:
    """``train.json``: seed, schedule, corpus hash, wall time and loss history of the run."""
    return json.loads((Path(path) / "train.json").read_text())
