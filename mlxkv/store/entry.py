"""A store entry: one encoded snapshot held in memory, and how it is made and lent.

An entry is what a snapshot file holds (the mlxkv header and the tensors by name), so every
tier keeps the same thing: RAM keeps the arrays, the disk tier a file, Redis pieces. Making
an entry (:func:`freeze`) encodes the caches through their codecs and keeps exactly the
stored rows: an array that is a view into a larger buffer (a cache's growth slack) is copied
to its own exact buffer, any other is kept as it is (MLX arrays are values), so ``nbytes``
is what the entry really keeps alive. Lending (``reuse.lend``) builds caches over views.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..formats.mlxkv import encode
from ..state.identity import Identity
from ..state.reuse import Reuse, lend, reuse_of


@dataclass(eq=False)
class Entry:
    key: str  # entry id: keys.entry_id(seed of its space, tokens)
    space: str  # what the id is seeded with: the namespace, or a checkpoint's generation
    tokens: list[int]  # a disk record's: array("I") (only its length and prefixes are asked)
    reuse: Reuse
    nbytes: int
    header: dict
    arrays: dict[str, mx.array] | None = None  # None: the bytes live in another tier
    pinned: bool = False
    used: int = 0  # the retention policy's clock at the entry's last put or lending
    serial: int = 0  # which put made it (a write is recorded against the put that queued it)
    extra: dict = field(default_factory=dict)  # a tier's own bookkeeping (path, mtime, ...)

    @property
    def ns(self) -> str:
        return self.header.get("ns", "")

    @property
    def checkpoint(self) -> dict | None:
        return self.header.get("generationCheckpoint")

    def lend(self, p: int) -> list:
        return lend(self.header, self.arrays, p)


def freeze(
    key: str,
    space: str,
    caches: Sequence,
    tokens: Sequence[int],
    identity: Identity,
    ns: str,
    checkpoint: dict | None = None,
    attachments: dict | None = None,
) -> Entry:
    """An entry holding the caches' current state; the caches stay the caller's."""
    header, tensors = encode(
        caches,
        tokens,
        identity=identity.replace(ns=ns),
        generation_checkpoint=checkpoint,
        attachments=attachments,
    )
    arrays = {name: mx.contiguous(a) for name, a in tensors}  # copies views of larger buffers only
    mx.eval(list(arrays.values()))
    nbytes = sum(a.nbytes for a in arrays.values())
    return Entry(key, space, list(header["tokens"]), reuse_of(caches, attachments), nbytes, header, arrays)
