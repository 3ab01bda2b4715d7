"""Load the committed quality model (``fixtures/quality-model/``) as an mlx-lm llama."""

import hashlib
import json
import os
from pathlib import Path

MODEL_DIR = Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) / "fixtures" / "quality-model"


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
