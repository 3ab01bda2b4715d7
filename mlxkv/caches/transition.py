"""Bf16-first caches: store and attend bf16, then convert the live window once.

``Bf16FirstCache`` holds a plain cache until ``start`` positions are stored (or, with
``start == 0``, until the first append is done), then converts it with the target's
``from_cache``. The append that reaches ``start`` is attended in bf16; the conversion runs at
the start of the next append, so the attention call that follows an append always sees the
storage it was handed (mlx-lm picks its SDPA by ``hasattr(cache, "bits")`` *after* the
append). It reports the kind of the storage it holds now, as mlx-bun does, and the pending
conversion travels in snapshots so a restored cache converts at the same position.
"""

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CacheConfigError
from .base import CacheContract
from .plain import KVCache


@dataclass(frozen=True)
class PendingConversion:
    scheme: str  # the target scheme without its start, e.g. "kv4-g64", "turbo-k8v3"
    start: int
    convert: Callable  # plain cache -> converted cache (consumes the plain cache)

    def due(self, offset: int) -> bool:
        """Does a plain cache holding ``offset`` positions convert before its next append?
        Once it holds ``start`` positions (with ``start == 0``: once it holds any)."""
        return offset > 0 and offset >= self.start

    def apply(self, plain):
        """Convert ``plain`` (consumed); a conversion after position 0 sets the reuse floor
        to the position it happened at: earlier prefixes were never stored in the target's
        precision."""
        at = plain.offset
        out = self.convert(plain)
        if self.start > 0:
            out.minimum_reusable_offset = max(out.minimum_reusable_offset, at)
        return out


class Bf16FirstCache(CacheContract):
    def __init__(self, pending: PendingConversion, inner=None):
        if pending.start < 0:
            raise CacheConfigError(f"conversion start must be >= 0, got {pending.start}")
        self.inner = inner if inner is not None else KVCache()
        self.pending = pending

    # identity and position are the held storage's
    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def offset(self) -> int:
        return self.inner.offset

    @property
    def masks(self):
        return self.inner.masks

    @masks.setter
    def masks(self, value):
        self.inner.masks = value

    @property
    def minimum_reusable_offset(self) -> int:
        return self.inner.minimum_reusable_offset

    @property
    def pending_conversion(self):
        """``{"scheme", "start"}`` while the conversion has not happened, else None."""
        p = self.pending
        return None if p is None else {"scheme": p.scheme, "start": p.start}

    def _maybe_convert(self):
        if self.pending is not None and self.pending.due(self.inner.offset):
            self.inner = self.pending.apply(self.inner)
            self.pending = None

    def update_and_fetch(self, keys, values):
        self._maybe_convert()
        return self.inner.update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    # named reads are the held storage's own (a TurboQuant cache may read deferred)
    def append_decode(self, keys, values, **kwargs):
        self._maybe_convert()
        return self.inner.append_decode(keys, values, **kwargs)

    def append_window(self, keys, values, **kwargs):
        self._maybe_convert()
        return self.inner.append_window(keys, values, **kwargs)

    def read_block(self, keys, values, **kwargs):
        return self.inner.read_block(keys, values, **kwargs)

    def is_trimmable(self):
        return self.inner.is_trimmable()

    def trim(self, n):
        return self.inner.trim(n)

    def bytes_per_token(self):
        return self.inner.bytes_per_token()

    def dense_window(self):
        return self.inner.dense_window()

    @property
    def nbytes(self):
        return self.inner.nbytes

    def __getattr__(self, name):
        # Only reached for names this class lacks: state, keys, bits (only once converted
        # to an affine layout), group_size, empty(), ...
        if name in ("inner", "pending"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def settled(row, i: int = 0):
    """The storage a serial row attends from its next append on, for joining a batch.

    A bf16-first row whose conversion is due is converted on a copy now, exactly as its
    next append would convert it; one still short of its start cannot share a batch,
    because a batched layer holds one storage. The row itself is never modified.
    """
    if not isinstance(row, Bf16FirstCache):
        return row
    p = row.pending
    if p is None:
        return row.inner
    plain = row.inner
    if not p.due(plain.offset):
        raise CacheConfigError(
            f"row {i} is bf16-first and converts to {p.scheme} at position {p.start} "
            f"(it is at {plain.offset}): a batched layer holds one storage, so it cannot "
            "convert one row mid-batch; decode that row alone until it converts"
        )
    copy = KVCache()
    copy.keys, copy.values, copy.offset = plain.keys, plain.values, plain.offset
    copy.masks, copy.minimum_reusable_offset = plain.masks, plain.minimum_reusable_offset
    return p.apply(copy)  # consumes the copy, never the caller's row
