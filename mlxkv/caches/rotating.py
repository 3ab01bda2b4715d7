"""Ring caches: ``RotatingKVCache`` (``kv:rotating-plain``) and
``RotatingQuantizedKVCache`` (``kv:rotating-quant:<bits>:<group>``).

One ring, written once, over a storage that is either one array (plain) or mlx-lm's affine
triple (quantized). The ring arithmetic is mlx-lm's ``RotatingKVCache`` to the letter, so a
plain ring gives mlx-lm's logits bit for bit, and ``keep`` leading positions are never
overwritten. Both rings are mlx-lm ``RotatingKVCache``s for ``isinstance`` (every method is
this module's own), as mlxkv's ``KVCache`` is an mlx-lm ``KVCache``.
"""

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from ..checks import check_ring_size
from ..math.affine import check_affine
from . import names
from .base import CacheContract, row_bytes


def _map(fn, x):
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


class _Ring(CacheContract, mlx_cache.RotatingKVCache):
    step = 256

    def __init__(self, max_size: int, keep: int = 0):
        check_ring_size(max_size, keep)
        self.max_size, self.keep = max_size, keep
        self.keys = self.values = None
        self.offset = 0
        self._idx = 0

    # -- storage hooks (overridden by the quantized ring) -------------------------------
    def _encode(self, x: mx.array):
        return x

    def _decode(self, x):
        return x

    # -- ring arithmetic (mlx-lm's) ----------------------------------------------------
    def _rows(self) -> int:
        return _first(self.keys).shape[2]

    def _trim(self, trim_size, v, append=None):
        def one(a, extra=None):
            parts = [a[..., : self.keep, :], a[..., trim_size + self.keep :, :]] if trim_size > 0 else [a]
            if extra is not None:
                parts.append(extra)
            return mx.concatenate(parts, axis=2)

        return _map(one, v) if append is None else _map2(one, v, append)

    def _temporal_order(self, v):
        rows = _first(v).shape[2]
        if self._idx == rows:
            return v
        if self._idx < self.offset:
            return _map(
                lambda a: mx.concatenate(
                    [a[..., : self.keep, :], a[..., self._idx :, :], a[..., self.keep : self._idx, :]], axis=2
                ),
                v,
            )
        return _map(lambda a: a[..., : self._idx, :], v)

    def _update_concat(self, keys, values):
        keys, values = self._encode(keys), self._encode(values)
        S = _first(keys).shape[2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = self._rows()
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += S
        self._idx = self._rows()
        return self.keys, self.values

    def _write_plan(self, keys, values, S: int):
        """The storage an in-place append of ``S`` positions writes into, and the row it
        writes at, as ``(keys, values, idx)``: grown, trimmed and wrapped exactly as the
        append does it, without changing the ring (``keys``/``values`` are the encoded new
        positions, read for their shapes and dtypes only)."""
        k, v, idx = self.keys, self.values, self._idx
        prev = self.offset
        rows = lambda x: _first(x).shape[2]
        if k is None or (prev >= rows(k) and rows(k) < self.max_size):
            new_size = min(self.step, self.max_size - prev)
            zeros = lambda a: mx.zeros((*a.shape[:2], new_size, a.shape[3]), a.dtype)
            if k is not None:
                cat = lambda a, b: mx.concatenate([a, b], axis=2)
                k, v = _map2(cat, k, _map(zeros, keys)), _map2(cat, v, _map(zeros, values))
            else:
                k, v = _map(zeros, keys), _map(zeros, values)
            idx = prev
        trim_size = rows(k) - self.max_size
        if trim_size > 0:
            k, v = self._trim(trim_size, k), self._trim(trim_size, v)
            idx = self.max_size
        if idx == self.max_size:
            idx = self.keep
        return k, v, idx

    def _update_in_place(self, keys, values):
        keys, values = self._encode(keys), self._encode(values)
        S = _first(keys).shape[2]
        k, v, i = self._write_plan(keys, values, S)
        for store, new in ((k, keys), (v, values)):
            for s, n in zip(_flat(store), _flat(new)):
                s[..., i : i + S, :] = n
        self._written(k, v, i, S)
        return self.keys_and_values()

    def _written(self, keys, values, idx: int, S: int):
        """Take the storage ``S`` positions were written into at row ``idx``."""
        self.keys, self.values = keys, values
        self._idx = idx + S
        self.offset += S

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def keys_and_values(self):
        if self.offset < self._rows():
            cut = lambda a: a[..., : self.offset, :]
            return _map(cut, self.keys), _map(cut, self.values)
        return self.keys, self.values

    def size(self):
        return min(self.offset, self.max_size)

    @property
    def state(self):  # mlx-lm's RotatingKVCache state, so its save/load and eval work
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return self.offset < self.max_size

    def trim(self, n):
        n = min(self.offset, n) if self.is_trimmable() else 0
        self.offset -= n
        self._idx -= n
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        key = ("ring", N, window_size, return_array, self.max_size, self.offset, self._idx)
        return self.masks.get(key, lambda: self._build_mask(N, window_size, return_array))

    def _build_mask(self, N, window_size, return_array):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        if self.offset >= window_size and self.max_size > window_size:
            idx = 0 if self._idx >= self.max_size else self._idx
            mask_size = self.offset + 1 if self.offset < self.max_size else self.max_size
            return mx.roll(mx.arange(mask_size) >= (mask_size - window_size), shift=idx + 1)
        return None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in _flat(self.keys) + _flat(self.values))

    def bytes_per_token(self) -> int:
        return 0 if self.keys is None else row_bytes(*_flat(self.keys), *_flat(self.values))

    def dense_window(self):
        if self.keys is None or self.offset == 0:
            return None
        k, v = self.keys_and_values()
        return self._decode(k), self._decode(v)

    def adopt(self, keys, values, offset: int, idx: int):
        """Take a ring exactly as laid out (position-exact restore)."""
        self.keys, self.values, self.offset, self._idx = keys, values, offset, idx
        return self


def _flat(x):
    return list(x) if isinstance(x, tuple) else [x]


def _map2(fn, a, b):
    return tuple(fn(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else fn(a, b)


class RotatingKVCache(_Ring):
    kind = names.RING_KIND


class RotatingQuantizedKVCache(_Ring):
    """A ring of mlx-lm affine triples; ``bits`` is real (mlx-lm's quantized SDPA reads it)."""

    kind_prefix = names.AFFINE_RING_KIND_PREFIX

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8):
        check_affine(bits, group_size)
        super().__init__(max_size, keep)
        self.group_size, self.bits = group_size, bits

    @property
    def kind(self) -> str:
        return f"{self.kind_prefix}{self.bits}:{self.group_size}"

    def _encode(self, x):
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _decode(self, x):
        return mx.dequantize(*x, group_size=self.group_size, bits=self.bits)
