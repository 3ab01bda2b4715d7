"""``TurboQuantKVCache`` (``kv:turboquant:<kBits>:<vBits>``): encoded at rest, attended from the codes.

Storage is the five arrays of the vLLM-Metal reference encode (``mlxkv.math.turboquant``):
``kIdx`` (int8 at kBits 8, else bit-packed uint8), ``kScales``/``kZeros`` (float16 per
32-group), ``vPacked`` (bit-packed uint8), ``vScales`` (float16 per 32-group), each
``[B, H, capacity, width]``, grown in 256-row steps. An append encodes only the new tokens.

Reads:

- codes (``codes=True``, the default): ``update_and_fetch`` returns the stored window as a
  ``CodesWindow`` and the cache shows ``bits``, so mlx-lm's own attention takes its
  quantized SDPA, which mlxkv routes to the attention straight from the codes
  (``mlxkv.caches.codes_window``, ``mlxkv.math.turboquant_attention``): scores from the
  keys' per-group affine terms, values through the codebook in the rotated domain, no
  decoded window. It agrees with the exact read to a documented tolerance
  (docs/turboquant.md). The named reads attend the same way;
- exact (``codes=False``): ``update_and_fetch`` returns the window decoded to the input
  dtype (no ``bits``), for an attention site that needs arrays; the named reads then read
  deferred by default (``deferred=``): values stay in the rotated domain (no inverse
  Hadamard over the T stored rows) and the read's ``finish`` un-rotates the attention output
  once, O(L d log d) instead of O(T d log d). Valid because attention is linear in V and the
  rotation is the same for every position and head.

Compiled decode (``mlxkv.caches.step_builders``): the five arrays enter the graph at a fixed row
count and the new position's codes are written at a traced row; the codes read attends
them (padded rows masked), the exact read decodes them, per position, as the eager read.
"""

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheConfigError, MLXKVError
from ..math import turboquant as tq
from . import codes_window, names
from .base import CacheContract, DenseKeysAndValues, DtypeAttribute
from .plain import KVCache
from .reads import AttentionRead


def unrotate_output(out: mx.array) -> mx.array:
    """The deferred read's ``finish``: attention output back from the rotated value domain."""
    return tq.unrotate(out).astype(out.dtype)


class CodesRead:
    """A read that attends from the stored codes: ``attend(q, scale)`` never decodes the
    window. ``keys``/``values`` decode it on first use, for a site that attends them itself."""

    finish = None

    def __init__(self, stored, k_bits: int, v_bits: int, mask, dtype):
        self.stored, self.k_bits, self.v_bits = stored, k_bits, v_bits
        self.mask, self.dtype = mask, dtype
        self._window = None

    def _decoded(self):
        if self._window is None:
            k, v = tq.decode(self.stored, self.k_bits, self.v_bits)
            self._window = (k.astype(self.dtype), v.astype(self.dtype))
        return self._window

    @property
    def keys(self):
        return self._decoded()[0]

    @property
    def values(self):
        return self._decoded()[1]

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        return codes_window.CodesWindow(self.stored, self.k_bits, self.v_bits).attend(queries, scale, self.mask)


class TurboQuantKVCache(DenseKeysAndValues, CacheContract, mlx_cache._BaseCache):
    kind_prefix = names.TURBO_KIND_PREFIX
    step = 256
    dtype = DtypeAttribute()  # the dtype dense_window decodes to (the last append's)

    def __init__(
        self,
        k_bits: int = 8,
        v_bits: int = 3,
        deferred: bool = True,
        head_dim: int | None = None,
        codes: bool = True,
    ):
        tq.check_bits(k_bits, v_bits)
        if head_dim is not None:
            tq.check_head_dim(head_dim)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.deferred = bool(deferred)
        self.codes = bool(codes)
        self.head_dim = head_dim
        self.offset = 0
        self.storage = None  # [kIdx, kScales, kZeros, vPacked, vScales], capacity rows each
        self.dtype = mx.bfloat16

    @property
    def kind(self) -> str:
        return f"{self.kind_prefix}{self.k_bits}:{self.v_bits}"

    # mlx-lm's attention takes its quantized route on hasattr(cache, "bits"): shown only in
    # codes mode, where update_and_fetch returns codes (the route attends them)
    @property
    def bits(self) -> int:
        if not self.codes:
            raise AttributeError("bits: this cache's update_and_fetch returns the decoded window (codes=False)")
        return self.k_bits

    @property
    def group_size(self) -> int:
        if not self.codes:
            raise AttributeError("group_size: this cache's update_and_fetch returns the decoded window (codes=False)")
        return tq.GROUP

    # -- storage ------------------------------------------------------------------------

    def _capacity(self) -> int:
        return 0 if self.storage is None else self.storage[0].shape[2]

    def _set_head_dim(self, d: int):
        if self.head_dim is None:
            tq.check_head_dim(d)
            self.head_dim = d
        elif d != self.head_dim:
            raise CacheConfigError(f"this TurboQuant cache holds head_dim {self.head_dim}, got {d}")

    def _check_new(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.shape != keys.shape:
            raise CacheConfigError(
                f"TurboQuant appends keys and values of one shape [B, H, L, D]; got {keys.shape} and {values.shape}"
            )
        self._set_head_dim(keys.shape[3])
        if self.storage is not None and tuple(keys.shape[:2]) != tuple(self.storage[0].shape[:2]):
            raise CacheConfigError(
                f"this cache holds [B, H] = {list(self.storage[0].shape[:2])}, got {list(keys.shape[:2])}"
            )

    def capacity_for(self, rows: int) -> int:
        """The capacity an append of ``rows`` positions leaves: the current one while they fit,
        else whole 256-row steps (the compiled step's window is this, so the buffer it writes
        is the one the eager append would)."""
        need = self.offset + rows
        return self._capacity() if need <= self._capacity() else -(-need // self.step) * self.step

    def _grow(self, rows: int):
        """Make room for ``rows`` more positions (:meth:`capacity_for`)."""
        capacity = self.capacity_for(rows)
        if capacity == self._capacity():
            return
        grown = []
        for a in self.storage:
            live = a[..., : self.offset, :]
            pad = mx.zeros((*a.shape[:2], capacity - self.offset, a.shape[3]), a.dtype)
            grown.append(mx.concatenate([live, pad], axis=2))
        self.storage = grown

    def _write(self, stored):
        """Store the five packed arrays of L new positions at ``offset``."""
        rows = stored[0].shape[2]
        if self.storage is None:
            B, H = stored[0].shape[:2]
            self.storage = [mx.zeros((B, H, 0, a.shape[3]), a.dtype) for a in stored]
        self._grow(rows)
        prev, self.offset = self.offset, self.offset + rows
        for a, new in zip(self.storage, stored):
            a[..., prev : self.offset, :] = new
        return self.storage

    def _live(self):
        return [a[..., : self.offset, :] for a in self.storage]

    def _decoded(self, dtype, rotated: bool):
        k, v = tq.decode(self._live(), self.k_bits, self.v_bits, rotated)
        return k.astype(dtype), v.astype(dtype)

    # -- mlx-lm drop-in ---------------------------------------------------------------

    def _append(self, keys: mx.array, values: mx.array):
        self._check_new(keys, values)
        self.dtype = keys.dtype
        codes = tq.encode_codes(keys, values, self.k_bits, self.v_bits)
        self._write(tq.pack_codes(codes, self.k_bits, self.v_bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Encode the new positions; return the window as codes (codes mode) or decoded in
        the input dtype (``codes=False``)."""
        self._append(keys, values)
        if self.codes:
            return codes_window.window(self.storage, self.k_bits, self.v_bits, self.offset)
        return self._decoded(keys.dtype, rotated=False)

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        return self.masks.causal(N, self.offset, window_size, return_array)

    @property
    def state(self):
        return [] if self.storage is None or self.offset == 0 else self._live()

    @state.setter
    def state(self, v):
        if v is None or len(v) == 0:
            self.storage, self.offset = None, 0
        else:
            self.adopt(*v, offset=v[0].shape[2])

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.storage is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n positions (byte-safe: a group never spans two positions)."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else sum(a.nbytes for a in self.storage)

    def bytes_per_token(self) -> int:
        """Per batch row: kv heads times ``D*kBits/8 + D*vBits/8 + 3*(D/32)*2``."""
        if self.storage is None or self.head_dim is None:
            return 0
        return self.storage[0].shape[1] * tq.bytes_per_head(self.head_dim, self.k_bits, self.v_bits)

    def dense_window(self):
        return None if self.storage is None or self.offset == 0 else self._decoded(self.dtype, rotated=False)

    # -- named reads --------------------------------------------------------------------

    def _read(self, keys, values, mask, deferred, codes):
        self._append(keys, values)
        if self.codes if codes is None else codes:
            return CodesRead(self._live(), self.k_bits, self.v_bits, mask, keys.dtype)
        rotated = self.deferred if deferred is None else bool(deferred)
        k, v = self._decoded(keys.dtype, rotated)
        return AttentionRead(k, v, mask, None, unrotate_output if rotated else None)

    def append_decode(
        self, keys: mx.array, values: mx.array, deferred: bool | None = None, codes: bool | None = None
    ) -> AttentionRead:
        if keys.shape[2] != 1:
            raise MLXKVError(
                f"append_decode takes one position per row, got L={keys.shape[2]}; "
                "use append_window for several positions"
            )
        return self._read(keys, values, self.make_mask(1), deferred, codes)

    def append_window(
        self, keys: mx.array, values: mx.array, deferred: bool | None = None, codes: bool | None = None
    ) -> AttentionRead:
        return self._read(keys, values, self.make_mask(keys.shape[2]), deferred, codes)

    # -- conversion and restore ---------------------------------------------------------

    @classmethod
    def from_cache(
        cls, source, k_bits: int = 8, v_bits: int = 3, deferred: bool = True, codes: bool = True
    ) -> "TurboQuantKVCache":
        """Encode a plain cache's live window once; ``offset``, ``minimum_reusable_offset``
        and ``masks`` carry over and the source is consumed (its arrays are released)."""
        if getattr(source, "kind", None) != KVCache.kind:
            raise CacheConfigError(
                f"TurboQuantKVCache.from_cache converts a {KVCache.kind} cache, got {getattr(source, 'kind', None)!r}"
            )
        out = cls(k_bits, v_bits, deferred, codes=codes)
        out.masks = source.masks
        out.minimum_reusable_offset = source.minimum_reusable_offset
        n = source.offset
        if source.keys is not None and n > 0:
            k, v = source.keys[..., :n, :], source.values[..., :n, :]
            out._check_new(k, v)
            out.dtype = k.dtype
            out.storage = list(tq.encode(k, v, k_bits, v_bits))
        out.offset = n
        source.keys = source.values = None
        source.offset = 0
        return out

    def adopt(self, k_idx, k_scales, k_zeros, v_packed, v_scales, offset: int):
        """Restore from the five stored arrays holding exactly ``offset`` positions (takes
        ownership of them)."""
        stored = [k_idx, k_scales, k_zeros, v_packed, v_scales]
        self._set_head_dim(k_scales.shape[3] * tq.GROUP)
        d = self.head_dim
        want = (
            tq.key_width(d, self.k_bits),
            d // tq.GROUP,
            d // tq.GROUP,
            tq.value_width(d, self.v_bits),
            d // tq.GROUP,
        )
        if any(a.ndim != 4 or a.shape[:3] != k_idx.shape[:3] or a.shape[3] != w for a, w in zip(stored, want)):
            raise CacheConfigError(
                f"TurboQuant k{self.k_bits}v{self.v_bits} head_dim {d} stores widths {list(want)}; got shapes "
                f"{[list(a.shape) for a in stored]}"
            )
        if k_idx.shape[2] < offset:
            raise CacheConfigError(f"the arrays hold {k_idx.shape[2]} positions, fewer than offset {offset}")
        self.storage, self.offset = stored, offset
        return self
