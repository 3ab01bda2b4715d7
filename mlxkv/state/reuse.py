"""Prefix reuse: which stored prefix may serve a prompt, and lending it without consuming it.

A stored entry (caches + the tokens they encode) can serve a new prompt from position
``p = min(common_prefix, len(prompt) - 1)``: at least one prompt token is always forwarded so
the model produces logits. It is usable only if ``p >= minimum_reusable_offset`` of every
cache, and either ``p`` is the whole entry or every cache can be trimmed back to ``p`` and no
method attachment rides on the entry (attachments are never trimmed). That is the whole rule
(:func:`prefix_for`); every store tier and every caller applies it through this module, and
knows of a cache only its ``minimum_reusable_offset`` and ``is_trimmable()``.

Reuse lends: :func:`lend` builds new caches holding the first ``p`` positions over views of
the donor's arrays, each through its codec's ``prefix`` (no decode, trim, re-encode round
trip). MLX arrays are values: an append to a lent cache makes new arrays (a growing append
concatenates; a write into a row the lent cache already holds copies the buffer, because
the donor still holds it), so the donor's bytes never change. :func:`probe` answers the
rule's two questions of a stored entry from its header alone (``Codec.trimmable``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..errors import MLXKVError
from ..families import family_of_persisted
from ..kinds.entries import decode_entries, encode_entries, restored_floor

_SPAN = 64  # tokens compared per slice before the token-by-token finish


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of two token lists (known equal below ``start``)."""
    a = a if isinstance(a, list) else list(a)
    b = b if isinstance(b, list) else list(b)
    n, i = min(len(a), len(b)), min(start, len(a), len(b))
    while i < n:  # whole slices compare at C speed
        j = min(i + _SPAN, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Reuse:
    """What the prefix rule needs of an entry: the highest ``minimum_reusable_offset`` of its
    caches, and whether it can be trimmed (every cache trimmable, no attachment)."""

    floor: int
    trimmable: bool


def reuse_of(caches: Sequence, attachments: dict | None = None) -> Reuse:
    floor = max((int(c.minimum_reusable_offset) for c in caches), default=0)
    return Reuse(floor, not attachments and all(c.is_trimmable() for c in caches))


def prefix_for(entry_tokens: Sequence[int], reuse: Reuse, prompt: Sequence[int], start: int = 0) -> int | None:
    """How many positions of the entry the prompt may reuse, or None if it may not.
    ``start``: tokens already known to agree (a block index found them)."""
    if not prompt:
        return None
    p = min(common_prefix(entry_tokens, prompt, start), len(prompt) - 1)
    return p if prefix_allowed(len(entry_tokens), reuse, p) else None


def prefix_allowed(entry_len: int, reuse: Reuse, p: int) -> bool:
    """May an entry of ``entry_len`` positions serve its first ``p`` (``p`` already at most
    the shared prefix and ``len(prompt) - 1``)? Not below its floor; short of its whole
    length only when it can trim."""
    return p > 0 and reuse.floor <= p and (p == entry_len or reuse.trimmable)


def usable_prefix(
    entry_tokens: Sequence[int], caches: Sequence, prompt: Sequence[int], attachments: dict | None = None
) -> int | None:
    """:func:`prefix_for` of live caches."""
    return prefix_for(entry_tokens, reuse_of(caches, attachments), prompt)


def covers(new_tokens: Sequence[int], new: Reuse, old_tokens: Sequence[int], old: Reuse) -> bool:
    """Can the entry ``new`` serve every prompt the shorter entry ``old`` can serve, at
    least as long a prefix? Then ``old`` is redundant (a store drops it). ``old`` serves
    prefixes from ``max(old.floor, 1)`` to its length (only its length when it cannot trim);
    ``new`` serves a shorter prefix only if it trims, and not below its floor."""
    n = len(old_tokens)
    if n >= len(new_tokens) or not new.trimmable or common_prefix(new_tokens, old_tokens) < n:
        return False
    lowest = max(old.floor, 1) if old.trimmable else n
    return new.floor <= lowest


def lend(header: dict, arrays: dict[str, mx.array], p: int) -> list:
    """New caches holding the first ``p`` positions of an encoded snapshot (``header`` and its
    tensors by name, as ``snapshot.encode`` or ``snapshot.read`` give them), over views of
    ``arrays``: nothing is copied, no lent cache holds a row past ``p``, and nothing a lent
    cache does changes ``arrays``.

    ``p`` must be the whole snapshot or a prefix every cache can trim to (``prefix_for``
    decided so); each codec cuts its own entry (``Codec.prefix``)."""
    views = {name: a[...] for name, a in arrays.items()}  # new array objects: setitem stays local
    whole = p == len(header["tokens"])
    return decode_entries(header, views, prefix=None if whole else p)


def reuse_prefix(
    entry_tokens: Sequence[int], caches: Sequence, prompt: Sequence[int], attachments: dict | None = None
) -> tuple[list, list[int], int]:
    """Lend the usable prefix of live ``caches`` to ``prompt``: returns (new caches trimmed
    to p, the prompt tokens still to forward, p). ``caches`` are not modified."""
    p = usable_prefix(entry_tokens, caches, prompt, attachments)
    if p is None:
        raise MLXKVError(
            "this entry cannot serve the prompt: no usable prefix (it diverges at token 0, would "
            "need a trim below minimum_reusable_offset, or needs a trim the caches cannot make)"
        )
    tokens = [int(t) for t in entry_tokens]
    entries, tensors = encode_entries(list(caches), tokens)
    return lend({"tokens": tokens, "caches": entries}, dict(tensors), p), list(prompt[p:]), p


def probe(header: dict) -> Reuse:
    """:class:`Reuse` of a checked snapshot header without its tensors: each entry's reuse
    floor (``kinds.entries.restored_floor``) and its codec's ``trimmable`` answer; no byte
    is read and no cache built."""
    floor, trimmable = 0, not header.get("attachments")
    for entry in header["caches"]:
        shapes = {t["slot"]: t["shape"] for t in entry["tensors"]}
        floor = max(floor, restored_floor(entry))
        trimmable = trimmable and family_of_persisted(entry["kind"]).codec.trimmable(entry, shapes)
    return Reuse(floor, trimmable)
