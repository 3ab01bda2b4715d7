"""``RowFormat``: the base of the attention row formats (``batched.formats``, ``batched.eviction``).

A row format says how one serial kind stores its positions: ``read`` a serial cache's stored
positions in temporal order, ``restore`` a serial cache from them; its storage
(``batched.storages``) says how positions are encoded. ``merge(rows)`` builds the batch of
class ``batch_class()`` from serial caches of this format, ``merge_bf16_first`` a bf16-first
batch whose target layout is this format's (``batched.bf16first``).
"""

from functools import cached_property

from ..families import batched_kind, kind_of
from .attention import BatchedKVCache, merge_attention_rows
from .bf16first import Bf16FirstBatch


class RowFormat:
    """``restore`` builds one serial cache back, ``empty()`` a serial cache of this format
    that holds nothing."""

    max_size: int | None = None
    keep: int = 0

    def empty(self):  # pragma: no cover - every format implements it
        raise NotImplementedError

    @cached_property
    def serial_kind(self) -> str:
        """The kind of the serial caches of this format: an empty one's own (the live cache
        says its kind; the format does not repeat it)."""
        return kind_of(self.empty())

    @property
    def batched_kind(self) -> str:
        """A row layout's own kind (``families.batched_kind`` of the serial kind)."""
        return batched_kind(self.serial_kind)

    def dtype_of(self, row):
        return None

    def merge(self, rows):
        return merge_attention_rows(self, rows, cls=self.batch_class())

    def merge_bf16_first(self, rows, pending, plains: dict):
        """A bf16-first batch: ``rows`` are every row in this format (an unconverted row as
        its conversion would encode it), ``plains`` maps the unconverted rows' indices to
        their plain caches."""
        return Bf16FirstBatch.merge(self.merge(rows), pending, plains)

    @staticmethod
    def batch_class():
        return BatchedKVCache
