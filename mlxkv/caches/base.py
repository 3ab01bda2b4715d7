"""What every mlxkv cache has beyond mlx-lm's cache API (the cache contract, docs/caches.md)."""

import mlx.core as mx

from ..errors import SchemeError
from ..families import row_merge
from . import kv_bits  # noqa: F401 - mlx-lm's kv_bits refused when generation starts, for every mlxkv cache
from .masks import ForwardMasks
from .reads import NamedReads


class DtypeAttribute:
    """An ``mx.Dtype`` attribute stored by name: ``mx.Dtype`` objects cannot be copied, and
    mlx-lm deep-copies caches (prompt-cache hits, every prompt-to-decode split of its batch
    engine). Reads give the ``mx.Dtype`` back (or None)."""

    def __set_name__(self, owner, name):
        self.stored_as = f"_{name}_name"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        name = obj.__dict__.get(self.stored_as)
        return None if name is None else getattr(mx, name)

    def __set__(self, obj, value):
        obj.__dict__[self.stored_as] = None if value is None else _dtype_name(value)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """``mx.float32`` -> ``"float32"`` (memoized: caches set their dtype on every append)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


class DenseKeysAndValues:
    """mlx-lm's ``keys_and_values()`` for caches whose storage is not mlx-lm's: the stored
    positions decoded to dense keys and values (``dense_window``), ``(None, None)`` when
    empty. mlx-lm's KV-shared layers (gemma3n, afm7) attend another layer's cache this way."""

    def keys_and_values(self):
        window = self.dense_window()
        return (None, None) if window is None else window


class CacheContract(NamedReads):
    """Mixin: ``kind``, the shared ``masks``, ``minimum_reusable_offset``, byte accounting.

    ``kind`` is the stable identity every dispatch compares; a subclass that forgets it
    fails loudly instead of being routed by its class name.
    """

    minimum_reusable_offset: int = 0
    #: a parameterized kind's stable part (``"kv:quant:"``): its family's record matches
    #: it, and ``kind`` appends the parameters; a kind without parameters is ``kind`` itself
    kind_prefix: str | None = None
    _masks: ForwardMasks = None

    @property
    def kind(self) -> str:  # pragma: no cover - every concrete cache overrides it
        raise NotImplementedError(f"{type(self).__name__} does not declare its kind")

    @property
    def masks(self) -> ForwardMasks:
        if self._masks is None:
            self._masks = ForwardMasks()
        return self._masks

    @masks.setter
    def masks(self, value: ForwardMasks):
        self._masks = value

    def bytes_per_token(self) -> int:
        """Physical bytes one more token costs one row (0 while the geometry is unknown)."""
        return 0

    @property
    def meta_state(self) -> tuple:
        """The scalars mlx-lm's older caches exposed as strings: identity and position.
        (mlx-lm 0.32 keeps its scalars in ``state``; this stays for tools that read it.)"""
        return (self.kind, str(self.offset))

    def dense_window(self):
        """The stored positions as dense (keys, values), or None when empty."""
        raise NotImplementedError

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Refused: mlx-lm's ``kv_bits`` calls this to swap a cache for its own kind-less
        ``QuantizedKVCache``. An mlxkv cache is quantized by its scheme instead."""
        raise SchemeError(
            f"mlx-lm's kv_bits={bits} would replace this {self.kind} cache by mlx-lm's own "
            "QuantizedKVCache; mlxkv caches are quantized by their scheme: pass "
            f"prompt_cache=mlxkv.make_cache(model, 'kv{bits}-g{group_size}') (add -start<N> for "
            "quantized_kv_start=N) and leave kv_bits unset"
        )

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching entry point: an mlxkv row layout, never mlx-lm's kind-less one."""
        return row_merge()(caches)

    def __repr__(self):
        return f"{type(self).__name__}(kind={self.kind!r}, offset={self.offset})"


def row_bytes(*arrays) -> int:
    """Bytes one token position occupies in [B, H, T, ...] arrays, for one batch row."""
    total = 0
    for a in arrays:
        if a is None:
            continue
        B, T = a.shape[0], a.shape[2]
        total += a.nbytes // (B * T) if B * T else 0
    return total
