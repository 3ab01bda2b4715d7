"""Bf16-first caches: store and attend bf16, then convert the live window once.

``Bf16FirstCache`` holds a plain cache until an append leaves it holding ``start`` positions
(with ``start == 0``: until the first append), as mlx-bun's ``transitionDue``. That append is
attended in bf16; the storage converts with the target's ``from_cache`` at the end of the
same append, so a snapshot taken right after a long prefill is already compact. Every later
append is stored and attended in the target's precision.

mlx-lm picks its attention by ``hasattr(cache, "bits")`` *after* the append, so the wrapper
answers ``bits`` only while the window it last returned is a quantized window (an affine
triple, or TurboQuant codes; ``mlxkv.caches.codes_window``): the append that converts still
returned bf16, the next one returns the target's window. It reports the kind of the
storage it holds now, as mlx-bun does; a pending conversion travels in snapshots, and a
storage restored at or past its start (written by an mlxkv that converted one append later)
converts as it is built, at the position it would have converted at.

The rule (``PendingConversion.due`` and ``apply``) is one: batched rows follow it per row
(``mlxkv.batched.attention``).
"""

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CacheConfigError
from .base import CacheContract
from .conversion import conversion_due, conversion_floor
from .plain import KVCache

#: attributes a wrapper shows only while its last window was a quantized window
QUANTIZED_WINDOW_ATTRIBUTES = ("bits", "group_size")


@dataclass(frozen=True)
class PendingConversion:
    scheme: str  # the target scheme without its start, e.g. "kv4-g64", "turbo-k8v3"
    start: int
    convert: Callable  # plain cache -> converted cache (consumes the plain cache)

    def due(self, offset):
        return conversion_due(self.start, offset)

    def floor(self, at):
        return conversion_floor(self.start, at)

    def apply(self, plain):
        """Convert ``plain`` (consumed), raising its reuse floor (``floor``)."""
        at = plain.offset
        out = self.convert(plain)
        out.minimum_reusable_offset = max(out.minimum_reusable_offset, self.floor(at))
        return out

    def target(self):
        """An empty cache of the target storage (what a converted row is)."""
        return self.convert(KVCache())


class Bf16FirstCache(CacheContract):
    def __init__(self, pending: PendingConversion, inner=None):
        """``inner``: the held storage, plain (not converted yet) or the target's (converted)."""
        if pending.start < 0:
            raise CacheConfigError(f"conversion start must be >= 0, got {pending.start}")
        self.inner = inner if inner is not None else KVCache()
        self.pending = pending
        self.settle()
        self._window_quantized = hasattr(self.inner, "bits")

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

    @minimum_reusable_offset.setter
    def minimum_reusable_offset(self, value: int):
        self.inner.minimum_reusable_offset = value

    @property
    def converted(self) -> bool:
        return self.inner.kind != KVCache.kind

    @property
    def pending_conversion(self):
        """``{"scheme", "start"}`` while the conversion has not happened, else None."""
        p = self.pending
        return None if self.converted else {"scheme": p.scheme, "start": p.start}

    def settle(self):
        """Convert now if the conversion is due (``PendingConversion.due``)."""
        if not self.converted and self.pending.due(self.inner.offset):
            self.inner = self.pending.apply(self.inner)

    def _appended(self, out):
        """After an append through the held storage: remember whether it returned a quantized
        window, then convert if that append reached ``start``."""
        self._window_quantized = hasattr(self.inner, "bits")
        self.settle()
        return out

    def update_and_fetch(self, keys, values):
        self.settle()  # a storage appended to outside this wrapper (a compiled step) converts late
        return self._appended(self.inner.update_and_fetch(keys, values))

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    # named reads are the held storage's own (a TurboQuant cache may read deferred); the
    # read keeps the storage it was made from, so it attends what it was handed
    def append_decode(self, keys, values, **kwargs):
        self.settle()
        return self._appended(self.inner.append_decode(keys, values, **kwargs))

    def append_window(self, keys, values, **kwargs):
        self.settle()
        return self._appended(self.inner.append_window(keys, values, **kwargs))

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
        # Only reached for names this class lacks: state, keys, empty(), ... and ``bits``,
        # shown only while the last window was a quantized window.
        if name.startswith("__") or name in ("inner", "pending", "_window_quantized"):
            raise AttributeError(name)
        if name in QUANTIZED_WINDOW_ATTRIBUTES and not self.__dict__.get("_window_quantized", False):
            raise AttributeError(f"{name}: the window this cache last returned is not a quantized window")
        return getattr(self.inner, name)
