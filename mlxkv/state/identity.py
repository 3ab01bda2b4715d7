"""Who a snapshot belongs to: model id, model fingerprint, tokenizer hash, adapter namespace,
and the geometry (layer count, kv heads, head dim) a model expects.

This module is the one place identity is derived; snapshots, sessions and stores call it.

The fingerprint a snapshot records (header field ``configFingerprint``) names the model that
computed its caches: sha256 over the model's canonical config and a CRC-32 of every
parameter's bytes (docs/format.md, section 3, gives the exact derivation). Two checkpoints of
one architecture differ in their weights, so they never share a fingerprint (short of a
CRC-32 collision in every tensor that differs: it is a guard against mistakes, not against
an adversary). It depends on neither the mlx-lm version nor where the model was loaded from.
"""

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass

import mlx.core as mx

from ..caches.schemes import attention_geometry, make_cache, model_config
from ..io.safetensors import array_buffer, crc32

IDENTITY_FIELDS = {  # python keyword -> header field
    "model_id": "modelId",
    "config_fingerprint": "configFingerprint",
    "tokenizer_hash": "tokenizerHash",
    "ns": "ns",
}

#: config keys that name, date or package a model without changing what it computes
NON_COMPUTING_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)
FINGERPRINT_TAG = b"mlxkv model fingerprint 1\n"


def canonical_config(model_or_config) -> dict:
    """The config a fingerprint covers: a config dict as given, or the model's config (the
    seeded models' ``mlxkv_config``; else mlx-lm's ``args`` without the fields left at their
    defaults, so a newer mlx-lm that adds fields does not change it), minus the keys that do
    not change the computation (:data:`NON_COMPUTING_KEYS`)."""
    import mlx.nn as nn

    if isinstance(model_or_config, dict) and not isinstance(model_or_config, nn.Module):
        cfg = dict(model_or_config)
    elif getattr(model_or_config, "mlxkv_config", None) is not None:
        cfg = dict(model_config(model_or_config))
    else:
        args = getattr(model_or_config, "args", None)
        cfg = {}
        if dataclasses.is_dataclass(args):
            for f in dataclasses.fields(args):
                value = getattr(args, f.name)
                if f.default is not dataclasses.MISSING and value == f.default:
                    continue
                if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
                    continue
                cfg[f.name] = value
        elif args is not None:
            cfg = dict(vars(args))
    return {k: v for k, v in cfg.items() if k not in NON_COMPUTING_KEYS}


def _config_text(model) -> bytes:
    return json.dumps(canonical_config(model), sort_keys=True, separators=(",", ":"), default=str).encode()


def _parameter_lines(params) -> bytes:
    """One line per parameter, sorted by name: name, dtype, shape, CRC-32 of its bytes."""
    lines = []
    for name, a in sorted(params, key=lambda p: p[0]):
        crc = crc32(array_buffer(a)) & 0xFFFFFFFF
        lines.append(f"{name} {a.dtype} {list(a.shape)} {crc:08x}\n")
    return "".join(lines).encode()


@dataclass
class _Cached:
    arrays: list  # weak references to the parameters it was computed from
    config: bytes
    fingerprint: str


def model_fingerprint(model) -> str:
    """sha256 hex of the model's canonical config and parameter bytes (cached on the model
    while its config and parameter arrays stay the same objects)."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    config = _config_text(model)
    cached = getattr(model, "_mlxkv_fingerprint", None)
    if (
        isinstance(cached, _Cached)
        and cached.config == config
        and len(cached.arrays) == len(params)
        and all(ref() is a for ref, (_, a) in zip(cached.arrays, params))
    ):
        return cached.fingerprint
    mx.eval([a for _, a in params])
    h = hashlib.sha256(FINGERPRINT_TAG)
    h.update(config + b"\n")
    h.update(_parameter_lines(params))
    fingerprint = h.hexdigest()
    object.__setattr__(model, "_mlxkv_fingerprint", _Cached([weakref.ref(a) for _, a in params], config, fingerprint))
    return fingerprint


def legacy_config_fingerprint(model) -> str:
    """The fingerprint mlxkv recorded before fingerprints covered the weights: sha256 of the
    model's config alone. Snapshots that carry it (format 1, and files converted from them)
    still load into a model of that config; every new save records ``model_fingerprint``."""
    text = json.dumps(model_config(model), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 hex over a tokenizer's vocabulary (token -> id, sorted)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else dict(tokenizer)
    text = json.dumps(sorted(vocab.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_identity(model) -> dict:
    """The identity fields a snapshot of this model records: its id (``mlxkv_model_id`` when
    it has one, else ``""``: an architecture name is not an identity) and its fingerprint."""
    model_id = getattr(model, "mlxkv_model_id", None) or ""
    return {"model_id": str(model_id), "config_fingerprint": model_fingerprint(model)}


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int | None
    head_dim: int | None


def model_geometry(model) -> Geometry:
    return Geometry(len(make_cache(model, "bf16")), *attention_geometry(model))
