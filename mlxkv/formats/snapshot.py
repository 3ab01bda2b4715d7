"""What a load gives, whatever the file's format: a :class:`Snapshot`, and the two forms of a
creation time the formats record (mlxkv's ISO form, mlx-bun's milliseconds)."""

import calendar
import time
from dataclasses import dataclass

from ..checks import is_int
from ..errors import SnapshotError

ISO_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass
class Snapshot:
    """Restored caches, the tokens they encode, the checked mlxkv header (an mlx-bun file's
    translated, ``formats.mlxbun``) and the method attachments the file holds (an mlxkv
    snapshot's: a JSON object or None; an mlx-bun file's: a list with tensors)."""

    caches: list
    tokens: list[int]
    header: dict
    path: str = ""
    attachments: object = None

    @property
    def generation_checkpoint(self) -> dict | None:
        return self.header.get("generationCheckpoint")

    @property
    def created_at(self):
        """The creation time as the file records it (here: ISO seconds)."""
        return self.header.get("createdAt")


@dataclass
class Carried:
    """What a conversion carries from a file to another format's writer: its layers
    (``kinds.entries.Layer``: entries and arrays, no live cache), the tokens they encode, the
    checked mlxkv header (identity, checkpoint), the attachments and the creation time as the
    file records them."""

    layers: list
    tokens: list[int]
    header: dict
    path: str = ""
    attachments: object = None
    created_at: object = None

    def __post_init__(self):
        if self.created_at is None:
            self.created_at = self.header.get("createdAt")

    @property
    def generation_checkpoint(self) -> dict | None:
        return self.header.get("generationCheckpoint")


def iso_time(ms: int) -> str:
    """The ISO form of ``ms``: whole seconds as ``YYYY-MM-DDTHH:MM:SSZ``, else with the
    milliseconds (``...:SS.123Z``), so an mlx-bun time survives a round trip through mlxkv."""
    seconds = time.strftime(ISO_FORMAT, time.gmtime(ms // 1000))
    return seconds if ms % 1000 == 0 else f"{seconds[:-1]}.{ms % 1000:03d}Z"


def iso_created(created_at) -> str:
    """The ISO form to record of a creation time given as None (now), milliseconds or ISO
    (recorded as given)."""
    if is_int(created_at):
        return iso_time(created_at)
    return created_at or time.strftime(ISO_FORMAT, time.gmtime())


def epoch_ms(created_at) -> int:
    """Milliseconds since the epoch from None (now), milliseconds, or the ISO form."""
    if created_at is None:
        return int(time.time() * 1000)
    if is_int(created_at):
        return created_at
    try:
        whole, dot, frac = created_at.removesuffix("Z").partition(".")
        if dot and not (len(frac) == 3 and frac.isdigit()):
            raise ValueError(frac)
        return calendar.timegm(time.strptime(whole + "Z", ISO_FORMAT)) * 1000 + (int(frac) if dot else 0)
    except (AttributeError, TypeError, ValueError):
        raise SnapshotError(
            f"created_at {created_at!r}: give milliseconds since the epoch or 'YYYY-MM-DDTHH:MM:SS[.mmm]Z'"
        ) from None


def human_bytes(n: int) -> str:
    """``n`` bytes as a reader takes them in: ``"512 B"``, ``"1.5 KiB"``, ... ``"GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
