"""The codec interface: how one persisted kind turns into header fields and tensor slots.

A codec knows a live cache class and its slot order; it knows nothing of files. The state
layer asks it to ``encode`` a cache into ``(fields, slots)`` and, after checking the file,
to ``check`` a header entry (before any tensor is read) and ``decode`` the tensors back.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx

from ..errors import CorruptSnapshotError


@dataclass(frozen=True)
class SlotSpec:
    """What a reader may expect of one slot before reading it."""

    name: str
    dtypes: Tuple[str, ...]  # allowed safetensors dtype names ("BF16", "U32", ...)
    rank: int = 4


class Codec:
    #: the short name written in snapshot headers ("kv", "qkv", ...)
    persisted_kind: str = ""

    def handles(self, kind: str) -> bool:
        """Does this codec persist caches whose live ``kind`` is ``kind``?"""
        raise NotImplementedError

    def encode(self, cache) -> Tuple[dict, List[Tuple[str, mx.array]]]:
        """Header fields (besides kind, tensors and minimumReusableOffset) and the
        (slot name, array) pairs in slot order."""
        raise NotImplementedError

    def check(self, entry: dict, shapes: Dict[str, Sequence[int]]) -> None:
        """Validate a header entry and the declared slot shapes; raise
        :class:`CorruptSnapshotError` naming what is wrong. Reads no tensor."""
        raise NotImplementedError

    def decode(self, entry: dict, tensors: Dict[str, mx.array]):
        """Rebuild the live cache from a checked entry and its tensors."""
        raise NotImplementedError

    def capacity(self, entry: dict):
        """Rows along the token axis the restored slots should have (slack included), or
        None to restore them position-exact."""
        return None

    def geometry(self, entry: dict, shapes: Dict[str, Sequence[int]]):
        """(n_kv_heads, head_dim) of the stored keys, or None for state without heads."""
        return None


def require(entry: dict, *names: str, kind: str = "") -> None:
    """Every header field in ``names`` is present and an integer."""
    for n in names:
        v = entry.get(n)
        if not isinstance(v, int) or isinstance(v, bool):
            raise CorruptSnapshotError(
                f"{kind or entry.get('kind')!s} entry: field {n!r} must be an integer, got {v!r}"
            )


def expect_slots(entry: dict, shapes: Dict[str, Sequence[int]], names: Sequence[str]) -> None:
    got = list(shapes)
    if got != list(names):
        raise CorruptSnapshotError(
            f"{entry.get('kind')} entry: tensor slots {got} do not match the slot order {list(names)}"
        )


def same_prefix(entry: dict, shapes: Dict[str, Sequence[int]], names: Sequence[str], axes: int = 3):
    """The named slots are [B, H, T, X] and agree on their first ``axes`` dimensions."""
    for n in names:
        if len(shapes[n]) != 4:
            raise CorruptSnapshotError(
                f"{entry.get('kind')} entry: slot {n} has shape {list(shapes[n])}; expected [B, H, T, X]"
            )
    first = tuple(shapes[names[0]][:axes])
    for n in names[1:]:
        if tuple(shapes[n][:axes]) != first:
            raise CorruptSnapshotError(
                f"{entry.get('kind')} entry: slot {n} has shape {list(shapes[n])}, "
                f"inconsistent with {names[0]} {list(shapes[names[0]])}"
            )
