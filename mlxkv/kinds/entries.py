"""Caches as header entries and back: the entry form every file format, the prompt store and
prefix reuse share (docs/format.md section 7).

A :class:`Layer` is one cache as the formats carry it: its header entry and its arrays as
the cache holds them, no live cache. ``cache_layer`` takes one from a live cache through
its family's codec (after the checks every writer makes: a known kind, a cache holding
tokens, an offset that is ``len(tokens)``); ``read_layers`` takes them from a checked header
and its tensors, so a conversion carries a file's layers from its reader to another
format's writer without building a cache. ``layer_entries`` names each stored tensor
``caches.<i>.<slot>`` (``encode_entries``: the same from caches); ``decode_entries``
rebuilds live caches from checked entries and their tensors, wrapping a pending bf16-first
conversion, each cache with the reuse floor its entry records. Nothing here reads or writes a
file, and nothing here imports a live cache until it decodes one (header checks,
verification and conversion import this module).
"""

from dataclasses import dataclass

import mlx.core as mx

from ..caches.conversion import conversion_due, conversion_floor
from ..caches.schemes import scheme_for_pending
from ..errors import EmptyCacheError, MLXKVError, SnapshotError
from ..families import family_of_kind, family_of_persisted, kind_of
from .predicates import is_recurrent_cache


@dataclass
class Layer:
    """One cache between a reader and a writer: ``entry`` its header entry without tensor
    references (``kind``, its codec's fields in their order, ``minimumReusableOffset``, a
    ``pendingConversion``), ``held`` its (slot, array) pairs as the cache holds them (a ring
    whole, as laid out: mlx-bun's form; :meth:`stored` is mlxkv's), ``kind`` the live kind a
    refusal names (the persisted kind when the source was a file)."""

    entry: dict
    held: list
    kind: str = ""

    @property
    def codec(self):
        return family_of_persisted(self.entry["kind"]).codec

    def stored(self) -> list:
        """The (slot, array) pairs an mlxkv entry stores (``Codec.stored``)."""
        return self.codec.stored(self.entry, self.held)

    @property
    def live_kind(self) -> str:
        return self.kind or self.entry["kind"]


def layer_entry(entry: dict) -> dict:
    """The entry of a layer from any entry of a checked kind: its kind, its codec's fields in
    the codec's order, its reuse floor and pending conversion, nothing else (the form
    ``encode`` gives a live cache, so a file's entry is written back as a cache's would be)."""
    codec = family_of_persisted(entry["kind"]).codec
    out = {"kind": entry["kind"], **{f: entry[f] for f in codec.fields}}
    out["minimumReusableOffset"] = entry["minimumReusableOffset"]
    if "pendingConversion" in entry:
        out["pendingConversion"] = dict(entry["pendingConversion"])
    return out


def is_empty(cache) -> bool:
    if is_recurrent_cache(cache):
        return all(a is None for a in cache.cache)
    return cache.offset == 0


def check_holds(i: int, kind: str, empty: bool, offset, tokens) -> None:
    """The checks every writer makes of layer ``i``: it holds tokens, and a positional one
    (``offset`` not None) is at ``len(tokens)`` (recurrent state has no token axis)."""
    if empty:
        raise EmptyCacheError(f"layer {i} ({kind}) holds no tokens: run the prompt through the model before saving")
    if offset is not None and offset != len(tokens):
        raise SnapshotError(
            f"layer {i} ({kind}) is at offset {offset} but {len(tokens)} tokens were given: "
            "tokens must be the exact prefix the caches encode"
        )


def cache_layer(i: int, cache, tokens) -> Layer:
    """Layer ``i`` of a live cache, after the checks every writer makes (``check_holds``, on
    the cache: an empty one has nothing to encode). Writes nothing."""
    kind = kind_of(cache)
    family = family_of_kind(kind)  # unknown kinds fail before anything is written
    check_holds(i, kind, is_empty(cache), None if is_recurrent_cache(cache) else cache.offset, tokens)
    fields, held = family.codec.encode(held_storage(cache))
    entry = {"kind": family.persisted, **fields, "minimumReusableOffset": cache.minimum_reusable_offset}
    pending = getattr(cache, "pending_conversion", None)
    if pending is not None:
        entry["pendingConversion"] = pending
    return Layer(entry, held, kind)


def cache_layers(caches, tokens) -> list[Layer]:
    return [cache_layer(i, cache, tokens) for i, cache in enumerate(caches)]


def check_layers(layers, tokens) -> None:
    """``check_holds`` over a file's layers (a live cache's were checked as it was encoded)."""
    for i, layer in enumerate(layers):
        positional = layer.codec.positional
        empty = not layer.held if not positional else layer.entry["offset"] == 0
        check_holds(i, layer.live_kind, empty, layer.entry["offset"] if positional else None, tokens)


def held_storage(cache):
    """The storage a cache encodes as: a bf16-first cache's held one (``Bf16FirstCache.inner``),
    any other cache itself."""
    from ..caches.transition import Bf16FirstCache

    return cache.inner if isinstance(cache, Bf16FirstCache) else cache


def layer_entries(layers) -> tuple[list, list]:
    """(header entries, (name, array) tensors) of ``layers``: each layer's entry with its
    tensor references (``caches.<i>.<slot>``, named by slot) and its stored arrays (views
    of the held ones)."""
    if not layers:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    entries, tensors = [], []
    for i, layer in enumerate(layers):
        entry = {**layer.entry, "tensors": []}
        for slot, array in layer.stored():
            name = f"caches.{i}.{slot}"
            entry["tensors"].append({"name": name, "slot": slot})
            tensors.append((name, array))
        entries.append(entry)
    return entries, tensors


def encode_entries(caches, tokens) -> tuple[list, list]:
    """(header entries, (name, array) tensors) of live ``caches`` (``layer_entries``); the
    arrays are the caches' own stored rows (views)."""
    if not caches:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    return layer_entries(cache_layers(caches, tokens))


def read_layers(header: dict, arrays: dict[str, mx.array], path: str = "") -> list[Layer]:
    """The layers of a checked header and its tensors by name (held as read: exact, no
    slack rows), each entry's stored values checked (``Codec.check_values``), no cache built.
    An entry whose pending conversion is already due at its offset converts as its restore
    would (``Bf16FirstCache``): that layer alone goes through its live cache."""
    where = f"{path}: " if path else ""
    layers = []
    for i, entry in enumerate(header["caches"]):
        pending = entry.get("pendingConversion")
        if pending is not None and conversion_due(pending["start"], entry["offset"]):
            (cache,) = decode_entries({"caches": [entry]}, arrays, path)
            layers.append(cache_layer(i, cache, header["tokens"]))
            continue
        held = [(t["slot"], arrays[t["name"]]) for t in entry["tensors"]]
        layer = Layer(layer_entry(entry), held)
        try:
            layer.codec.check_values(entry, dict(held))
        except SnapshotError as e:
            raise type(e)(f"{where}cache entry {i}: {e}") from None
        layers.append(layer)
    return layers


def decode_entries(header: dict, arrays: dict[str, mx.array], path: str = "", prefix: int | None = None) -> list:
    """Live caches from a checked header and its tensors by name (one shared masks object);
    with ``prefix``, each holds only the first ``prefix`` positions (``Codec.prefix``: the
    entries must be trimmable to it).

    The caches hold the given arrays (or views of them) as they are; nothing is evaluated or
    copied. A rule on the stored values (eviction positions) that does not hold refuses the
    snapshot."""
    from ..caches.masks import ForwardMasks
    from ..caches.transition import Bf16FirstCache

    masks = ForwardMasks()
    where = f"{path}: " if path else ""
    caches = []
    for i, entry in enumerate(header["caches"]):
        codec = family_of_persisted(entry["kind"]).codec
        try:
            tensors = {t["slot"]: arrays[t["name"]] for t in entry["tensors"]}
            cache = codec.decode(entry, tensors) if prefix is None else codec.prefix(entry, tensors, prefix)
            cache.minimum_reusable_offset = entry["minimumReusableOffset"]
            if "pendingConversion" in entry:
                cache = Bf16FirstCache(scheme_for_pending(entry["pendingConversion"]), cache)
        except SnapshotError as e:
            raise type(e)(f"{where}cache entry {i}: {e}") from None
        except MLXKVError as e:  # the header checks should have refused it: still a refusal of ours
            raise SnapshotError(f"{where}cannot restore cache entry {i}: {e}") from None
        cache.masks = masks
        caches.append(cache)
    return caches


def restored_floor(entry: dict) -> int:
    """The reuse floor of the cache a checked entry restores to: its
    ``minimumReusableOffset``, raised by a pending conversion already due at its offset
    (the restored cache converts as it is built, ``Bf16FirstCache``)."""
    floor, pending = entry["minimumReusableOffset"], entry.get("pendingConversion")
    if pending is not None and conversion_due(pending["start"], entry["offset"]):
        floor = max(floor, conversion_floor(pending["start"], entry["offset"]))
    return floor
