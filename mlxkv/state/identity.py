"""Who a snapshot belongs to: model id, config fingerprint, tokenizer hash, adapter namespace,
and the geometry (layer count, kv heads, head dim) a model expects."""

import hashlib
import json
from dataclasses import dataclass

from ..caches.schemes import attention_geometry, make_cache, model_config

IDENTITY_FIELDS = {  # python keyword -> header field
    "model_id": "modelId",
    "config_fingerprint": "configFingerprint",
    "tokenizer_hash": "tokenizerHash",
    "ns": "ns",
}


def config_fingerprint(model_or_config) -> str:
    """sha256 hex of the canonical JSON of a model config (or of a config dict)."""
    import mlx.nn as nn

    plain_dict = isinstance(model_or_config, dict) and not isinstance(model_or_config, nn.Module)
    cfg = model_or_config if plain_dict else model_config(model_or_config)
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 hex over a tokenizer's vocabulary (token -> id, sorted)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else dict(tokenizer)
    text = json.dumps(sorted(vocab.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_identity(model) -> dict:
    """The identity fields a snapshot of this model carries (ids mlxkv can derive)."""
    cfg = model_config(model)
    model_id = getattr(model, "mlxkv_model_id", None) or cfg.get("_name_or_path") or cfg.get("model_type", "")
    return {"model_id": str(model_id), "config_fingerprint": config_fingerprint(cfg)}


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int | None
    head_dim: int | None


def model_geometry(model) -> Geometry:
    return Geometry(len(make_cache(model, "bf16")), *attention_geometry(model))
