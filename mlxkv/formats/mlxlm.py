"""mlx-lm's own prompt-cache files (``mlx_lm.models.cache.save_prompt_cache``), read and
written.

The current mlx-lm layout (since ml-explore/mlx-lm PR #1778, which put the scalars into
each cache's ``state`` and dropped ``meta_state``) is a safetensors file whose
``__metadata__`` is the flattened list ``[metadata, class names, scalars]``:

- ``"0.<key>"``: the user metadata (``mlx_lm.cache_prompt`` writes ``model`` and
  ``tokenizer_config``);
- ``"1.<i>"``: the class name of cache ``i``;
- ``"2.0" == ""`` (a sentinel), then ``"2.<k>.0"`` / ``"2.<k>.1"``: the name of a tensor that
  stands for a scalar and its type (``scalar``, ``string``, ``none``).

Tensors are named by the flattened ``state`` of each cache: ``"<i>.<j>[.<k>]"``. The older
layout flattened ``[meta_state per cache, metadata, class names]`` instead (class names under
``"2.<i>"``, offsets in string meta states, keys sliced to the offset); it is recognised and
refused with a message saying how to re-save it.

Class names are mapped explicitly to mlxkv caches (never looked up by name); any other
class raises :class:`UnsupportedPromptCacheClassError`. mlx-lm files do not record the tokens
their caches cover, so they are no snapshot to load: the format table converts them
(:func:`convert_source`; ``mlxkv.convert_prompt_cache`` says where the tokens come from).

:func:`save_mlx_lm` writes the same layout from the caches' entries (``kinds.entries``) for
the kinds mlx-lm has a class of (:data:`MLX_LM_FORMS`); the tokens go into the metadata's
``tokens`` entry, which this reader takes back, beside ``model`` and ``tokenizer_config``,
which ``mlx_lm.generate --prompt-cache-file`` reads.
"""

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from ..checks import check_ring_size, is_count, is_int_list
from ..codecs.affine import SLOTS as AFFINE_SLOTS
from ..codecs.affine import affine_slots
from ..errors import (
    CacheConfigError,
    CorruptSnapshotError,
    MLXKVError,
    SnapshotError,
    UnknownKindError,
    UnsupportedKindError,
)
from ..io.safetensors import SafetensorsFile, write_atomic
from ..io.tensor_reader import TensorReader
from ..kinds.entries import Layer, cache_layers, check_holds, check_layers, layer_entries
from ..math.affine import check_affine
from ..state.identity import UNKNOWN, Identity
from .mlxkv_header import META_KEY, not_a_snapshot
from .snapshot import Carried

TOKENS_METADATA_KEY = "tokens"


class OldPromptCacheLayoutError(SnapshotError):
    """A prompt-cache file in mlx-lm's layout from before scalars moved into ``state``."""


class MissingTokensError(SnapshotError):
    """The tokens a converted snapshot must record are not known."""


class UnsupportedPromptCacheClassError(UnknownKindError, SnapshotError):
    """An mlx-lm cache class in a prompt-cache file that mlxkv has no cache for."""

    def __init__(self, class_name: str, layer: int, path: str):
        self.kind = class_name
        MLXKVError.__init__(
            self,
            f"{path}: layer {layer} is an mlx-lm {class_name!r}, which mlxkv cannot convert; "
            f"convertible classes: {', '.join(CONVERTERS)}",
        )


@dataclass
class PromptCacheFile:
    """What an mlx-lm prompt-cache file holds, as mlxkv caches."""

    caches: list
    tokens: list[int] | None  # None when neither the caller nor the file gave them
    metadata: dict[str, str]
    classes: list[str]
    offset: int  # the positions the caches cover
    path: str = ""
    scalars: dict[str, object] = field(default_factory=dict)


# -- layout ---------------------------------------------------------------------------


def _indexed(meta: dict[str, str], prefix: str) -> dict[int, str]:
    pat = re.compile(re.escape(prefix) + r"(\d+)")
    return {int(m.group(1)): v for k, v in meta.items() if (m := pat.fullmatch(k))}


def _parse_layout(path: str, meta: dict[str, str]):
    """(user metadata, class names, {tensor name: scalar type}) of the current layout."""
    if META_KEY in meta:
        raise SnapshotError(f"{path}: this is already an mlxkv snapshot; open it with mlxkv.load")
    if meta.get("2.0") != "":
        old_classes = _indexed(meta, "2.")
        if old_classes and all(v and "." not in v for v in old_classes.values()):
            raise OldPromptCacheLayoutError(
                f"{path}: written by an mlx-lm older than the current save_prompt_cache layout "
                "(per-cache meta_state strings, classes under '2.<i>'; mlx-lm changed it when "
                "the scalars moved into each cache's state). Load it with the mlx-lm that wrote "
                "it, upgrade mlx-lm, re-save it with mlx_lm.models.cache.save_prompt_cache, "
                "then convert the new file"
            )
        raise SnapshotError(
            f"{path}: not an mlx-lm prompt-cache file (no class list and scalar sentinel in "
            "__metadata__); expected a file written by mlx_lm.models.cache.save_prompt_cache"
        )
    user = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    by_index = _indexed(meta, "1.")
    classes = [by_index.get(i) for i in range(len(by_index))]
    if not classes or None in classes:
        raise CorruptSnapshotError(f"{path}: the class list in __metadata__ is empty or has holes")
    scalars = {}
    entries = sorted({int(m.group(1)) for k in meta if (m := re.fullmatch(r"2\.(\d+)\.[01]", k))})
    for k in entries:
        name, kind = meta.get(f"2.{k}.0"), meta.get(f"2.{k}.1")
        if name is None or kind not in ("scalar", "string", "none"):
            raise CorruptSnapshotError(f"{path}: scalar entry 2.{k} is malformed ({name!r}, {kind!r})")
        scalars[name] = kind
    return user, classes, scalars


# -- per-class state paths ------------------------------------------------------------
# Each converter lists the state paths (relative to the layer) it needs and which of them are
# scalars, then gives the layer's mlxkv entry and arrays (``kinds.entries.Layer``) from the
# values, or None for a cache that holds nothing (which ``EMPTY_CACHES`` builds): no live
# cache, so a conversion of an mlx-lm file imports nothing of mlx-lm.


def _slice(a, n):
    return a[..., :n, :]


def _layer(kind: str, fields: dict, held: list) -> Layer:
    return Layer({"kind": kind, **fields, "minimumReusableOffset": 0}, held)


def _kv(v, ctx):
    keys, values, offset = v["0"], v["1"], v["2"]
    if keys is None or offset == 0:
        return None
    ctx.rows(keys, offset)
    ctx.rows(values, offset)
    return _layer("kv", {"offset": offset}, [("keys", _slice(keys, offset)), ("values", _slice(values, offset))])


def _quantized(v, ctx):
    offset, group, bits = v["2"], v["3"], v["4"]
    try:
        check_affine(bits, group)
    except CacheConfigError as e:
        raise SnapshotError(f"{ctx.where}: {e}") from None
    keys = tuple(v[f"0.{j}"] for j in range(3))
    values = tuple(v[f"1.{j}"] for j in range(3))
    if keys[0] is None or offset == 0:
        return None
    for a in keys + values:
        ctx.rows(a, offset)
    held = affine_slots(keys, values, offset)
    return _layer("qkv", {"offset": offset, "groupSize": group, "bits": bits}, held)


def _rotating(v, ctx):
    keys, values, offset, keep, max_size, idx = (v[str(j)] for j in range(6))
    try:
        check_ring_size(max_size, keep)
    except CacheConfigError as e:
        raise SnapshotError(f"{ctx.where}: {e}") from None
    if keys is None or offset == 0:
        return None
    rows = keys.shape[2]
    if keys.ndim != 4 or values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
        raise CorruptSnapshotError(
            f"{ctx.where}: keys {list(keys.shape)} and values {list(values.shape)} are not one ring"
        )
    if not 0 <= idx <= rows or rows < min(offset, max_size):
        raise CorruptSnapshotError(
            f"{ctx.where}: ring of {rows} rows with offset={offset} idx={idx} max_size={max_size} "
            "is not a ring mlx-lm writes"
        )
    fields = {"offset": offset, "idx": idx, "maxSize": max_size, "keep": keep}
    return _layer("rotating", fields, [("keys", keys), ("values", values)])


def _arrays(v, ctx):
    if v.get("1") is not None or v.get("2") is not None:
        raise SnapshotError(
            f"{ctx.where}: a batched ArraysCache (left_padding or lengths set) cannot be "
            "converted: save a single-sequence cache"
        )
    size = ctx.list_size("0")
    held = [(str(j), a) for j in range(size) if (a := v.get(f"0.{j}")) is not None]
    # the offset is the tokens' (recurrent state records none): set once they are known
    return _layer("ssm", {"offset": 0, "size": size}, held) if held else None


def _empty_kv(v):
    from ..caches.plain import KVCache

    return KVCache()


def _empty_quantized(v):
    from ..caches.quantized import QuantizedKVCache

    return QuantizedKVCache(group_size=v["3"], bits=v["4"])


def _empty_rotating(v):
    from ..caches.rotating import RotatingKVCache

    return RotatingKVCache(v["4"], v["3"])


def _empty_arrays(v):
    from ..caches.arrays import ArraysCache

    return ArraysCache(len([k for k in v if k.startswith("0.")]))


#: the cache ``read_prompt_cache`` gives for a layer that holds nothing, by class
EMPTY_CACHES: dict[str, Callable] = {
    "KVCache": _empty_kv,
    "QuantizedKVCache": _empty_quantized,
    "RotatingKVCache": _empty_rotating,
    "ArraysCache": _empty_arrays,
}


CONVERTERS: dict[str, Callable] = {
    "KVCache": _kv,
    "QuantizedKVCache": _quantized,
    "RotatingKVCache": _rotating,
    "ArraysCache": _arrays,
}

# the state paths each class must have (ArraysCache's list is variable: "0.<j>")
REQUIRED_PATHS = {
    "KVCache": ["0", "1", "2"],
    "QuantizedKVCache": ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2", "2", "3", "4"],
    "RotatingKVCache": ["0", "1", "2", "3", "4", "5"],
    "ArraysCache": ["1", "2"],
}
SCALAR_PATHS = {
    "KVCache": {"2"},
    "QuantizedKVCache": {"2", "3", "4"},
    "RotatingKVCache": {"2", "3", "4", "5"},
    "ArraysCache": set(),
}


class _LayerContext:
    def __init__(self, path, layer, cls, names):
        self.where = f"{path}: layer {layer} ({cls})"
        self.names = names

    def rows(self, keys, offset):
        if keys.ndim != 4 or keys.shape[2] < offset:
            raise CorruptSnapshotError(f"{self.where}: keys of shape {list(keys.shape)} cannot hold offset {offset}")

    def list_size(self, prefix):
        idx = [int(n[len(prefix) + 1 :]) for n in self.names if re.fullmatch(re.escape(prefix) + r"\.\d+", n)]
        if not idx or sorted(idx) != list(range(len(idx))):
            raise CorruptSnapshotError(f"{self.where}: state list {prefix}.* is empty or has holes")
        return len(idx)


# -- reading --------------------------------------------------------------------------


def _scalar_value(a, name, kind, where):
    if kind == "none":
        return None
    if kind == "string":
        return "".join(chr(int(c)) for c in a.tolist())
    if a.ndim != 0:
        raise CorruptSnapshotError(f"{where}: scalar {name!r} has shape {list(a.shape)}")
    return a.item()


def _tokens_from_metadata(path, meta) -> list[int] | None:
    text = meta.get(TOKENS_METADATA_KEY)
    if text is None:
        return None
    try:
        tokens = json.loads(text)
    except ValueError:
        tokens = None
    if not is_int_list(tokens):
        raise CorruptSnapshotError(f"{path}: metadata {TOKENS_METADATA_KEY!r} must be a JSON list of token ids")
    return tokens


def read_prompt_cache(path: str, tokens: Sequence[int] | None = None) -> PromptCacheFile:
    """Read an mlx-lm prompt-cache file into mlxkv caches (no code named by the file runs).

    ``tokens`` (or the file's ``tokens`` metadata, a JSON list) must have as many entries as
    the caches cover; without either, ``tokens`` is None in the result.
    """
    with SafetensorsFile(path) as file:  # one descriptor for the header and every tensor
        r = _read_prompt_cache(file, tokens)
    return PromptCacheFile(r.caches(), r.tokens, r.metadata, r.classes, r.offset, r.path, r.scalars)


def _read_prompt_cache(file: SafetensorsFile, tokens: Sequence[int] | None) -> "_Read":
    path, st = file.path, file.header
    user, classes, scalars = _parse_layout(path, st.metadata)

    # Everything about the structure is checked before a tensor is read.
    per_layer: dict[int, list[str]] = {i: [] for i in range(len(classes))}
    for name in st.tensors:
        head, _, rest = name.partition(".")
        if not head.isdigit() or int(head) >= len(classes) or not rest:
            raise CorruptSnapshotError(f"{path}: tensor {name!r} belongs to no cache of the class list")
        per_layer[int(head)].append(rest)
    for name in scalars:
        if name not in st.tensors:
            raise CorruptSnapshotError(f"{path}: scalar entry names tensor {name!r}, which the file lacks")
    for i, cls in enumerate(classes):
        if cls not in CONVERTERS:
            raise UnsupportedPromptCacheClassError(cls, i, path)
        names = set(per_layer[i])
        missing = [p for p in REQUIRED_PATHS[cls] if p not in names]
        if missing:
            raise CorruptSnapshotError(f"{path}: layer {i} ({cls}) lacks state entries {missing}")
        for p in SCALAR_PATHS[cls]:
            if f"{i}.{p}" not in scalars:
                raise CorruptSnapshotError(f"{path}: layer {i} ({cls}) state entry {p} is not a scalar")

    layers, empty, found_scalars = [], {}, {}
    arrays = TensorReader(file).read_all((name, None, None) for name in st.tensors)  # one pass over the file
    for i, cls in enumerate(classes):
        ctx = _LayerContext(path, i, cls, per_layer[i])
        values = {}
        for rest in sorted(per_layer[i]):
            name = f"{i}.{rest}"
            kind = scalars.get(name)
            if kind is not None:
                values[rest] = found_scalars[name] = _scalar_value(arrays.pop(name), name, kind, ctx.where)
            elif rest in SCALAR_PATHS[cls]:
                raise CorruptSnapshotError(f"{ctx.where}: state entry {rest} must be a scalar")
            else:
                values[rest] = arrays.pop(name)
        for p in SCALAR_PATHS[cls]:
            if not is_count(values[p]):
                raise CorruptSnapshotError(f"{ctx.where}: state entry {p} must be a non-negative integer")
        layer = CONVERTERS[cls](values, ctx)
        if layer is None:
            empty[i] = values
        layers.append(layer)

    positional = [
        (layer.entry["offset"] if layer else 0) for layer, cls in zip(layers, classes) if cls != "ArraysCache"
    ]
    offsets = set(positional)
    if len(offsets) > 1:
        raise CorruptSnapshotError(f"{path}: the caches disagree on their offset ({sorted(offsets)})")
    offset = offsets.pop() if offsets else None

    file_tokens = _tokens_from_metadata(path, user)
    if tokens is not None:
        tokens = [int(t) for t in tokens]
        if file_tokens is not None and file_tokens != tokens:
            raise MissingTokensError(f"{path}: the given tokens differ from the tokens recorded in the file's metadata")
    else:
        tokens = file_tokens
    if offset is None:  # recurrent state only: the tokens are the only record of the position
        offset = len(tokens) if tokens is not None else 0
    if tokens is not None and len(tokens) != offset:
        raise MissingTokensError(f"{path}: the caches cover {offset} positions but {len(tokens)} tokens were given")
    for layer, cls in zip(layers, classes):
        if layer is not None and cls == "ArraysCache":
            layer.entry["offset"] = offset
    return _Read(layers, empty, tokens, user, classes, offset, path, found_scalars)


@dataclass
class _Read:
    """An mlx-lm file as read: a layer per cache (None: it holds nothing; ``empty`` has its
    state values by index), before any cache is built."""

    layers: list
    empty: dict
    tokens: list[int] | None
    metadata: dict[str, str]
    classes: list[str]
    offset: int
    path: str
    scalars: dict

    def caches(self) -> list:
        """The layers as mlxkv caches (one shared masks object)."""
        from ..caches.masks import ForwardMasks

        masks, caches = ForwardMasks(), []
        for i, (layer, cls) in enumerate(zip(self.layers, self.classes)):
            if layer is None:
                cache = EMPTY_CACHES[cls](self.empty[i])
                if cls == "ArraysCache":
                    cache.offset = self.offset
            else:
                cache = layer.codec.decode(layer.entry, dict(layer.held))
            cache.masks = masks
            caches.append(cache)
        return caches


def parse_tokens(text: str) -> list[int]:
    """Tokens from a command-line value: ``"1,2,3"``, ``"1 2 3"``, a JSON list, or
    ``@file`` holding any of those."""
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise MLXKVError(f"cannot read tokens from {text[1:]}: {e}") from None
    text = text.strip()
    try:
        if text.startswith("["):
            values = json.loads(text)
        else:
            values = [int(t) for t in re.split(r"[,\s]+", text) if t]
    except ValueError:
        values = None
    if not is_int_list(values):
        raise MLXKVError("tokens must be integers: '1,2,3', '1 2 3', a JSON list, or @file with those")
    return values


def refuse(file, *args, **kwargs):
    """What reading an mlx-lm file as a snapshot does (``mlxkv.load``, ``read_header``,
    ``verify``, ``inspect``): refuse it, naming the conversion."""
    raise not_a_snapshot(file.path)


def convert_source(file: SafetensorsFile, tokens: Sequence[int] | None) -> Carried:
    """What a conversion takes from an open mlx-lm prompt-cache file: its layers (no live
    cache is built; one that holds nothing is refused, as a save refuses it), the tokens
    they cover (``tokens``, else the file's ``tokens`` metadata; with neither the conversion
    is refused rather than write tokens that could make a prefix match lie) and the model id
    ``mlx_lm.cache_prompt`` records (``model``)."""
    pc = _read_prompt_cache(file, tokens)
    if pc.tokens is None:
        raise MissingTokensError(
            f"{pc.path}: mlx-lm prompt-cache files do not record their tokens and this one covers "
            f"{pc.offset} positions: pass the {pc.offset} token ids the cache was built from "
            "(convert_prompt_cache(..., tokens=ids), or `mlxkv convert SRC DST --tokens "
            "1,2,3` / `--tokens @ids.json`)"
        )
    for i in pc.empty:
        check_holds(i, pc.classes[i], True, None, pc.tokens)
    return Carried(pc.layers, pc.tokens, {"modelId": pc.metadata.get("model", "")}, pc.path)


# -- writing --------------------------------------------------------------------------


def _affine_state(f, t):
    return [[t[s] for s in AFFINE_SLOTS[:3]], [t[s] for s in AFFINE_SLOTS[3:]], f["offset"], f["groupSize"], f["bits"]]


#: mlx-lm's form of each persisted kind it has a class of: (class name, its ``state`` from
#: the entry's fields and slot arrays), the inverse of :data:`CONVERTERS`
MLX_LM_FORMS: dict[str, tuple[str, Callable]] = {
    "kv": ("KVCache", lambda f, t: [t["keys"], t["values"], f["offset"]]),
    "qkv": ("QuantizedKVCache", _affine_state),
    "rotating": (
        "RotatingKVCache",
        lambda f, t: [t["keys"], t["values"], f["offset"], f["keep"], f["maxSize"], f["idx"]],
    ),
    "ssm": ("ArraysCache", lambda f, t: [[t.get(str(j)) for j in range(f["size"])], None, None]),
}
#: why mlx-lm's files cannot hold a persisted kind mlxkv has
NO_MLX_LM_FORM = {
    "rotating-qkv": "mlx-lm has no quantized ring (its RotatingKVCache.to_quantized is not implemented)",
    "turboquant": "mlx-lm has no TurboQuant cache",
    "tova": "mlx-lm has no TOVA eviction cache",
    "qfilters": "mlx-lm has no Q-Filters eviction cache",
}
WHAT_TO_DO = (
    "save it as an mlxkv snapshot or an mlx-bun file (format='mlxkv' / 'mlx-bun'), or build the "
    "caches with a scheme mlx-lm has (bf16, kv<b>[-g<g>])"
)


def _refuse(layer: Layer, i: int, why: str):
    kind = layer.live_kind
    raise UnsupportedKindError(
        kind,
        f"layer {i} ({kind}): {why}, so mlx-lm's prompt-cache files cannot hold it; nothing was written: " + WHAT_TO_DO,
    )


def _scalar_array(path: str, value, scalars: list):
    """A state leaf as mlx-lm's ``save_prompt_cache`` stores it (scalars recorded by name)."""
    if isinstance(value, mx.array):
        return value
    if value is None:
        scalars.append((path, "none"))
        return mx.array([])
    scalars.append((path, "scalar"))
    return mx.array(value)


def save_mlx_lm(path: str, caches: Sequence, tokens: Sequence[int], **kwargs) -> dict:
    """Write live ``caches`` as an mlx-lm prompt-cache file (``save_mlx_lm_layers`` documents
    the keywords)."""
    return save_mlx_lm_layers(path, cache_layers(list(caches), tokens), tokens, **kwargs)


def save_mlx_lm_layers(
    path: str,
    layers: Sequence[Layer],
    tokens: Sequence[int],
    *,
    identity: Identity = UNKNOWN,
    generation_checkpoint: dict | None = None,
    attachments: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    created_at=None,
) -> dict:
    """Write ``layers`` as an mlx-lm prompt-cache file ``mlx_lm.models.cache.load_prompt_cache``
    loads; returns ``{"tokens", "caches" (the entries), "classes", "metadata"}``. A kind mlx-lm
    has no class of, a pending bf16-first conversion, a generation checkpoint or attachments
    are refused before anything is written (the file has no place for them). The write is
    atomic."""
    tokens, layers = [int(t) for t in tokens], list(layers)
    check_layers(layers, tokens)
    entries, tensors = layer_entries(layers)
    if generation_checkpoint is not None or attachments:
        what = "a generation checkpoint" if generation_checkpoint is not None else "attachments"
        raise SnapshotError(
            f"mlx-lm's prompt-cache files have no place for {what}: save it as an mlxkv snapshot or an mlx-bun file"
        )
    arrays = dict(tensors)
    states, classes = [], []
    for i, entry in enumerate(entries):
        kind = entry["kind"]
        if "pendingConversion" in entry:
            pending = entry["pendingConversion"]
            why = f"a bf16-first cache (pending conversion {pending}) converts at its start, which no mlx-lm cache does"
            _refuse(layers[i], i, why)
        if kind not in MLX_LM_FORMS:
            _refuse(layers[i], i, NO_MLX_LM_FORM.get(kind, f"mlx-lm has no cache class for mlxkv's {kind!r}"))
        cls, state = MLX_LM_FORMS[kind]
        slots = {t["slot"]: arrays[t["name"]] for t in entry["tensors"]}
        states.append(state(entry, slots))
        classes.append(cls)
    scalars = [""]  # mlx-lm's sentinel
    flat = [(name, _scalar_array(name, leaf, scalars)) for name, leaf in tree_flatten(states)]
    metadata = {
        "model": identity.model_id,
        "tokenizer_config": "{}",
        TOKENS_METADATA_KEY: json.dumps(tokens, separators=(",", ":")),
    }
    flat_meta = dict(tree_flatten([metadata, classes, scalars]))
    write_atomic(path, flat, lambda crcs: flat_meta, progress=progress, fsync=fsync)
    return {"tokens": tokens, "caches": entries, "classes": classes, "metadata": metadata}
