"""Caches as header entries and back: the entry form every file format, the prompt store and
prefix reuse share (docs/format.md section 7).

``encode_entries`` runs every cache through its family's codec (after the checks every
writer makes: a known kind, a cache holding tokens, an offset that is ``len(tokens)``) and
names each tensor ``caches.<i>.<slot>``; ``decode_entries`` rebuilds live caches from
checked entries and their tensors, wrapping a pending bf16-first conversion, each cache with
the reuse floor its entry records. Nothing here reads or writes a file, and nothing here
imports a live cache until it decodes one (header checks and verification import this module).
"""

import mlx.core as mx

from ..caches.schemes import scheme_for_pending
from ..errors import EmptyCacheError, MLXKVError, SnapshotError
from ..families import family_of_kind, family_of_persisted, kind_of
from .predicates import is_recurrent_cache


def is_empty(cache) -> bool:
    if is_recurrent_cache(cache):
        return all(a is None for a in cache.cache)
    return cache.offset == 0


def encode_layer(i: int, cache, tokens: list):
    """(family, header fields, (slot, array) pairs) of layer ``i``, after the checks every
    writer makes: a known kind, a cache that holds tokens, and an offset that is
    ``len(tokens)`` (recurrent state has no token axis). Writes nothing."""
    kind = kind_of(cache)
    family = family_of_kind(kind)  # unknown kinds fail before anything is written
    if is_empty(cache):
        raise EmptyCacheError(f"layer {i} ({kind}) holds no tokens: run the prompt through the model before saving")
    if not is_recurrent_cache(cache) and cache.offset != len(tokens):
        raise SnapshotError(
            f"layer {i} ({kind}) is at offset {cache.offset} but {len(tokens)} tokens were given: "
            "tokens must be the exact prefix the caches encode"
        )
    fields, slots = family.codec.encode(held_storage(cache))
    return family, fields, slots


def held_storage(cache):
    """The storage a cache encodes as: a bf16-first cache's held one (``Bf16FirstCache.inner``),
    any other cache itself."""
    from ..caches.transition import Bf16FirstCache

    return cache.inner if isinstance(cache, Bf16FirstCache) else cache


def encode_entries(caches, tokens) -> tuple[list, list]:
    """(header entries, (name, array) tensors) of ``caches``: each entry its kind, its
    codec's fields, ``minimumReusableOffset``, a pending conversion, and its tensor
    references (``caches.<i>.<slot>``, named by slot); the arrays are the caches' own
    stored rows (views)."""
    if not caches:
        raise EmptyCacheError("nothing to save: the cache list is empty")
    entries, tensors = [], []
    for i, cache in enumerate(caches):
        family, fields, slots = encode_layer(i, cache, tokens)
        entry = {"kind": family.persisted, **fields, "minimumReusableOffset": cache.minimum_reusable_offset}
        pending = getattr(cache, "pending_conversion", None)
        if pending is not None:
            entry["pendingConversion"] = pending
        entry["tensors"] = []
        for slot, array in slots:
            name = f"caches.{i}.{slot}"
            entry["tensors"].append({"name": name, "slot": slot})
            tensors.append((name, array))
        entries.append(entry)
    return entries, tensors


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
    from ..caches.transition import conversion_due, conversion_floor

    floor, pending = entry["minimumReusableOffset"], entry.get("pendingConversion")
    if pending is not None and conversion_due(pending["start"], entry["offset"]):
        floor = max(floor, conversion_floor(pending["start"], entry["offset"]))
    return floor
