"""Trim and prefix-reuse rules (docs/caches.md, "Trim and reuse").

A stored entry (caches + the tokens they encode) can serve a new prompt from position
``p = min(common_prefix, len(prompt) - 1)``: at least one prompt token is always forwarded so
the model produces logits. It is usable only if ``p >= minimum_reusable_offset`` of every
cache, and either ``p`` is the whole entry or every cache can be trimmed back to ``p`` and no
method attachment rides on the entry (attachments are never trimmed).
"""

from collections.abc import Sequence

from ..errors import MLXKVError


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def usable_prefix(
    entry_tokens: Sequence[int], caches: Sequence, prompt: Sequence[int], attachments: dict | None = None
) -> int | None:
    """How many positions of the entry the prompt may reuse, or None if it may not."""
    if not prompt:
        return None
    p = min(common_prefix(entry_tokens, prompt), len(prompt) - 1)
    if p <= 0 or any(p < c.minimum_reusable_offset for c in caches):
        return None
    if p == len(entry_tokens):
        return p
    if attachments or not all(c.is_trimmable() for c in caches):
        return None
    return p


def reuse_prefix(
    entry_tokens: Sequence[int], caches: Sequence, prompt: Sequence[int], attachments: dict | None = None
) -> tuple[list[int], int]:
    """Trim ``caches`` in place to the usable prefix; returns (tokens still to forward, p)."""
    p = usable_prefix(entry_tokens, caches, prompt, attachments)
    if p is None:
        raise MLXKVError(
            "this entry cannot serve the prompt: no usable prefix (it diverges at token 0, would "
            "need a trim below minimum_reusable_offset, or needs a trim the caches cannot make)"
        )
    drop = len(entry_tokens) - p
    if drop:
        for c in caches:
            if c.trim(drop) != drop:  # pragma: no cover - usable_prefix checked trimmability
                raise MLXKVError(f"{c.kind} refused to trim {drop} positions")
    return list(prompt[p:]), p
