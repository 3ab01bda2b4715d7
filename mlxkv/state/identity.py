"""Who a snapshot belongs to: model id, model fingerprint, tokenizer hash, adapter namespace
(:class:`Identity`), and the geometry (layer count, kv heads, head dim) a model expects.

This module is the one place identity is derived and the one place its fields are named:
snapshots, mlx-bun files, sessions, the command line and the prompt store all go through
:class:`Identity` for the mapping between Python keywords and header fields.

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

from ..caches.schemes import attention_geometry, layer_count, model_config
from ..errors import GeometryMismatchError, IdentityMismatchError, SnapshotError
from ..families import family_of_persisted
from ..io.safetensors import array_buffer, crc32

#: Python keyword -> header field of everything an identity holds, in header order. Every
#: snapshot records the first four ("" when unknown); ``kvScheme`` is recorded by a prompt
#: store's entries only (docs/store.md), and only when set.
FIELDS = {
    "model_id": "modelId",
    "config_fingerprint": "configFingerprint",
    "tokenizer_hash": "tokenizerHash",
    "ns": "ns",
    "kv_scheme": "kvScheme",
}
#: the keywords every snapshot header records, and the ones ``load(**expect)`` compares
RECORDED = ("model_id", "config_fingerprint", "tokenizer_hash", "ns")
RECORDED_FIELDS = tuple(FIELDS[key] for key in RECORDED)
#: what an entry must share with a prompt store to serve it: the model's computation, the
#: tokenizer and the cache scheme (an id names a model, it does not compute; the namespace is
#: part of every lookup already)
SERVES = ("config_fingerprint", "tokenizer_hash", "kv_scheme")


@dataclass(frozen=True)
class Identity:
    """Who a snapshot belongs to, as its header records it (docs/format.md section 3): the
    model's id and fingerprint, the tokenizer's hash, the adapter namespace, and (a prompt
    store's entries) the cache scheme. ``""`` is unknown."""

    model_id: str = ""
    config_fingerprint: str = ""
    tokenizer_hash: str = ""
    ns: str = ""
    kv_scheme: str = ""

    def __post_init__(self):
        for key in FIELDS:
            value = getattr(self, key)
            if not isinstance(value, str):
                raise SnapshotError(f"{key} must be a string, got {value!r}")

    @classmethod
    def from_header(cls, header: dict) -> "Identity":
        """The identity a checked header records (a field it lacks is ``""``)."""
        return cls(**{key: header.get(name, "") for key, name in FIELDS.items()})

    @classmethod
    def resolved(cls, model=None, **given) -> "Identity":
        """The identity to record: each keyword given (not None), else what ``model`` gives
        (:func:`model_identity`), else ``""``."""
        unknown = set(given) - set(FIELDS)
        if unknown:
            raise TypeError(f"unexpected identity keywords {sorted(unknown)}: identity fields are {list(FIELDS)}")
        derived = model_identity(model) if model is not None else cls()
        return cls(**{key: getattr(derived, key) if given.get(key) is None else given[key] for key in FIELDS})

    def replace(self, **changes) -> "Identity":
        """This identity with the given keywords (those not None) replaced."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def keywords(self) -> dict:
        """The keywords a snapshot records (``save(..., **identity.keywords())``)."""
        return {key: getattr(self, key) for key in RECORDED}

    def header_fields(self) -> dict:
        """Header field -> value, in header order: the four every snapshot records, then
        ``kvScheme`` when set."""
        out = {name: getattr(self, key) for key, name in zip(RECORDED, RECORDED_FIELDS)}
        if self.kv_scheme:
            out[FIELDS["kv_scheme"]] = self.kv_scheme
        return out

    def serves(self, header: dict) -> bool:
        """Does a snapshot with ``header`` belong to this identity's model computation,
        tokenizer and cache scheme (:data:`SERVES`)?"""
        return all(header.get(FIELDS[key], "") == getattr(self, key) for key in SERVES)

    def key_fields(self, ns: str) -> dict:
        """The fields a prompt store seeds its keys with in namespace ``ns`` (docs/store.md):
        :data:`SERVES` and the namespace, by header field."""
        out = {FIELDS[key]: getattr(self, key) for key in SERVES}
        out[FIELDS["ns"]] = ns
        return out


#: the identity of a snapshot saved without one: every field unknown
UNKNOWN = Identity()


def check_expected(where: str, header: dict, expect: dict) -> None:
    """Each given expectation (a keyword of :data:`RECORDED`, None: not compared) equals
    the header's field; else :class:`IdentityMismatchError`."""
    for key, value in expect.items():
        if key not in RECORDED:
            raise TypeError(f"load() got an unexpected expectation {key!r}")
        if value is None:
            continue
        name = FIELDS[key]
        if header.get(name) != value:
            raise IdentityMismatchError(
                f"{where}: {name} is {header.get(name)!r}, expected {value!r}: "
                "this snapshot belongs to another model, tokenizer, config or adapter"
            )


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


def model_identity(model, tokenizer=None) -> Identity:
    """The identity a snapshot of this model records: its id (``mlxkv_model_id`` when it
    has one, else ``""``: an architecture name is not an identity), its fingerprint, and the
    tokenizer's hash when a tokenizer is given."""
    model_id = getattr(model, "mlxkv_model_id", None) or ""
    return Identity(
        model_id=str(model_id),
        config_fingerprint=model_fingerprint(model),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
    )


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int | None
    head_dim: int | None


def model_geometry(model) -> Geometry:
    """The layer count and attention geometry a snapshot for ``model`` must have, from the
    model's own declarations (``caches.schemes.layer_count``, its config)."""
    return Geometry(layer_count(model), *attention_geometry(model))


def check_model_identity(where, header, model):
    """A snapshot that records a model fingerprint loads only into that model."""
    recorded = header.get("configFingerprint")
    if not recorded:
        return  # saved without a model: nothing to compare (the geometry still is)
    mine = model_fingerprint(model)
    if recorded != mine and recorded != legacy_config_fingerprint(model):
        raise IdentityMismatchError(
            f"{where}: the snapshot was computed by another model (fingerprint {recorded[:16]}..., "
            f"this model's is {mine[:16]}...; modelId {header.get('modelId')!r}): its caches would make this "
            "model generate garbage. Pass allow_other_model=True to load it anyway"
        )


def check_geometry(where, header, model):
    geo = model_geometry(model)
    entries = header["caches"]
    if len(entries) != geo.layers:
        raise GeometryMismatchError(f"{where}: snapshot has {len(entries)} cache layers, the model has {geo.layers}")
    for i, entry in enumerate(entries):
        shapes = {t["slot"]: t["shape"] for t in entry["tensors"]}
        g = family_of_persisted(entry["kind"]).codec.geometry(entry, shapes)
        if g is None:
            continue
        heads, dim = g
        if (geo.kv_heads is not None and heads != geo.kv_heads) or (geo.head_dim is not None and dim != geo.head_dim):
            raise GeometryMismatchError(
                f"{where}: layer {i} stores {heads} kv heads of dim {dim}; the model has "
                f"{geo.kv_heads} kv heads of dim {geo.head_dim}"
            )


def check_for_model(where, header, model, allow_other_model: bool = False):
    """What loading ``header`` into ``model`` needs: its recorded fingerprint (unless
    ``allow_other_model``), then its layer count and head geometry."""
    if not allow_other_model:
        check_model_identity(where, header, model)
    check_geometry(where, header, model)
