"""The codec interface: how one persisted kind turns into header fields and tensor slots.

A codec declares what an entry of its persisted kind holds: the kind (``persisted``), its
header fields with their types (``fields``), its tensor slots in order (``slots``) and, when
mlx-bun has a codec for the kind, the entry as mlx-bun lays it out (``bun``, a
:class:`BunForm`). The kind table and the file formats read these; nothing restates them.
It knows nothing of files: the formats ask it to ``encode`` a cache into ``(fields, slots)``
and, after checking the file, to ``check`` a header entry (before any tensor is read) and
``decode`` the tensors back. ``check_fields`` applies the field types before any codec looks.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..checks import INT32_MAX, is_count32, is_int
from ..errors import CorruptSnapshotError, MLXKVError
from ..families import COUNT, FLAG, SIGN, family_of_persisted

_FIELD_RULES = {
    COUNT: (is_count32, f"an integer in 0..{INT32_MAX}"),
    SIGN: (lambda v: is_int(v) and v in (1, -1), "+1 or -1"),
    FLAG: (lambda v: isinstance(v, bool), "a JSON bool"),
}


def check_fields(entry: dict, fields: Mapping[str, str]) -> None:
    """Every declared header field is present with its type (:data:`~mlxkv.families.COUNT`,
    ``SIGN`` or ``FLAG``); raise :class:`CorruptSnapshotError` naming the first that is not."""
    for name, kind in fields.items():
        ok, what = _FIELD_RULES[kind]
        if not ok(entry.get(name)):
            raise CorruptSnapshotError(
                f"{entry.get('kind')!s} entry: field {name!r} must be {what}, got {str(entry.get(name))[:40]}"
            )


@dataclass(frozen=True)
class BunForm:
    """How mlx-bun's codec table (``mlx-cache-v3``, docs/mlx-bun.md section 4.3) writes an
    entry of a codec's kind. Its integer fields are the codec's ``fields`` without
    ``implied``, in the same order; its tensors are the codec's ``slots`` (or ``slots``)."""

    #: the codec's fields mlx-bun's entry lacks, with the value they always have for it
    implied: Mapping[str, int] = field(default_factory=dict)
    #: the mlxkv slot names of mlx-bun's tensors, in order, where they are not the codec's
    slots: tuple[str, ...] | None = None
    #: the tensors are the whole ring as laid out, its unwritten tail included
    ring: bool = False
    #: an entry without ``minimumReusableOffset`` is reusable at its full offset only (an
    #: early TurboQuant file), so its writer always writes the field
    floor_at_offset: bool = False

    def fields(self, codec: "Codec") -> tuple[str, ...]:
        """mlx-bun's integer fields before ``tensors``, in emission order."""
        return tuple(f for f in codec.fields if f not in self.implied)

    def slot_names(self, codec: "Codec") -> tuple[str, ...]:
        return self.slots if self.slots is not None else codec.slots


def check_entry(entry: dict, shapes: dict):
    """Every check a header entry goes through before any tensor is read: the field types its
    kind's codec declares, then that codec's rules over fields and slot shapes. Returns the
    entry's family."""
    family = family_of_persisted(entry.get("kind"))
    check_fields(entry, family.codec.fields)
    family.codec.check(entry, shapes)
    return family


class Codec:
    #: the kind written in header entries (``"kv"``, ``"qkv"``, ...): the kind table's key
    persisted: str = ""
    #: the header fields of an entry besides ``kind``, ``tensors`` and
    #: ``minimumReusableOffset``, in the order ``encode`` returns them, each with its type
    #: (:data:`~mlxkv.families.COUNT`, ``SIGN``, ``FLAG``)
    fields: Mapping[str, str] = {}
    #: the tensor slots of an entry, in order (an entry may omit the optional ones its
    #: ``check`` names); empty where the codec names its slots per entry
    slots: tuple[str, ...] = ()
    #: the entry as mlx-bun writes it, or None: mlx-bun has no codec for the kind
    bun: BunForm | None = None
    #: the entry's ``offset`` counts the snapshot's tokens (every attention kind); recurrent
    #: state advances by what its model reports, so its codec says False
    positional: bool = True

    def encode(self, cache) -> tuple[dict, list[tuple[str, mx.array]]]:
        """Header fields (besides kind, tensors and minimumReusableOffset) and the
        (slot name, array) pairs in slot order, as the cache holds them (``stored`` gives
        what an mlxkv entry holds of them)."""
        raise NotImplementedError

    def stored(self, entry: dict, held: list[tuple[str, mx.array]]) -> list[tuple[str, mx.array]]:
        """The (slot, array) pairs an mlxkv entry stores of what a cache holds (``encode``'s
        arrays, or a file's as read): the held arrays themselves, unless the codec keeps
        rows an entry does not store (a ring's unwritten tail)."""
        return list(held)

    def check_values(self, entry: dict, tensors: dict[str, mx.array]) -> None:
        """The rules on a checked entry's stored values (read after their checksums
        passed), which ``decode`` and a conversion apply; raise
        :class:`CorruptSnapshotError`. None by default: the header checks say it all."""

    def check(self, entry: dict, shapes: dict[str, Sequence[int]]) -> None:
        """Validate a header entry and the declared slot shapes; raise
        :class:`CorruptSnapshotError` naming what is wrong. Reads no tensor."""
        raise NotImplementedError

    def decode(self, entry: dict, tensors: dict[str, mx.array]):
        """Rebuild the live cache from a checked entry and its tensors."""
        raise NotImplementedError

    def trimmable(self, entry: dict, shapes: dict[str, Sequence[int]]) -> bool:
        """Would the cache a checked entry restores be trimmable (``is_trimmable()``)? From
        the header alone: no tensor is read and no cache built."""
        raise NotImplementedError

    def prefix(self, entry: dict, tensors: dict[str, mx.array], p: int):
        """A cache holding the first ``p`` positions of a checked, trimmable entry, over
        views of ``tensors`` (nothing copied, and no row past ``p`` held). This default
        decodes and trims, right for caches whose ``trim`` slices their stored rows; a
        codec whose cache trims by moving its offset slices before it decodes."""
        cache = self.decode(entry, tensors)
        drop = entry["offset"] - p
        if drop and cache.trim(drop) != drop:
            refuse_prefix(entry, p)
        return cache

    def capacity(self, entry: dict):
        """Rows along the token axis the restored slots should have (slack included), or
        None to restore them position-exact."""
        return None

    def geometry(self, entry: dict, shapes: dict[str, Sequence[int]]):
        """(n_kv_heads, head_dim) of the stored keys, or None for state without heads."""
        return None


def expect_slots(entry: dict, shapes: dict[str, Sequence[int]], names: Sequence[str]) -> None:
    got = list(shapes)
    if got != list(names):
        raise CorruptSnapshotError(
            f"{entry.get('kind')} entry: tensor slots {got} do not match the slot order {list(names)}"
        )


def same_prefix(entry: dict, shapes: dict[str, Sequence[int]], names: Sequence[str], axes: int = 3):
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


def refuse_prefix(entry: dict, p: int):
    raise MLXKVError(
        f"a {entry.get('kind')} entry at offset {entry.get('offset')} cannot trim to {p} positions: "
        f"it cannot serve a prefix of {p}"
    )


def cut(a: mx.array, p: int) -> mx.array:
    """The first ``p`` positions of a [B, H, T, X] array: the array itself when it holds
    exactly ``p``, else a view."""
    return a if a.shape[2] == p else a[..., :p, :]
