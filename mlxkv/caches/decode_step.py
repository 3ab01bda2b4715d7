"""Compiled decode: what one decode step needs from a cache, and the cache a traced model sees.

``mx.compile`` replays a traced graph whose array shapes are fixed, and a graph cannot hold a
cache object. So a cache enters a compiled step as a :class:`DecodeStep`, prepared outside
the graph by its family (``mlxkv.caches.step_builders``):

- ``layout``: hashable; everything the traced code depends on besides the shapes and dtypes
  of the input arrays: the family's constants and the :class:`Phase`. Equal layouts share
  one trace.
- ``arrays``: the graph inputs. Attention caches hand in their stored window at a row count
  that is fixed for the phase (a buffer's capacity, positions rounded up to 256 rows, a
  ring), the RoPE position of the new token and the row it is written to (int32: traced
  inputs, so the trace does not depend on them). Recurrent state hands in its arrays.
- ``commit(new, effects)``: the write after the step. ``new`` is what the stand-in recorded:
  the step's new keys and values, then the window arrays with the new position written
  (the store's ``written``; none for TurboQuant, whose commit appends).
  Plain, affine and ring steps hand in the cache's own buffer (grown outside the graph
  exactly as the eager append grows it) and the cache adopts the written buffer: the graph
  writes in place, no copy. Other attention steps (TurboQuant, eviction, a bf16-first cache
  before its conversion) append the new keys and values through the cache's own
  ``update_and_fetch``, so the stored bytes are the eager append's by construction.
  Recurrent state takes the arrays the step left in it.

Inside the trace ``layout.open(arrays)`` builds the stand-in cache the model calls: its
``offset`` is the traced position, its ``update_and_fetch`` writes the new position into
the window at the traced row and returns the whole window, and its ``make_mask`` hides the
rows past the new position (and applies a sliding window) from traced integers. Attending a
padded window with masked rows gives the same floats as attending the exact window
(checked bit for bit against the eager step in the tests, on the CPU backend).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..errors import MLXKVError
from ..math import turboquant as tq
from . import codes_window


@dataclass(frozen=True)
class Phase:
    """Which trace a decode step of a cache takes: the kind it attends, the phase name
    (``window``, ``ring-fill``, ``ring-wrapped``, ``recurrent``, or ``eager`` for a step
    that cannot run compiled: an empty cache's first append), and the rows it attends."""

    kind: str
    name: str
    rows: int = 0


@dataclass
class DecodeStep:
    layout: Any  # hashable; ``layout.open(arrays)`` builds the stand-in inside the trace
    arrays: tuple  # the graph inputs
    commit: Callable  # (new, effects) -> None, after the step

    @property
    def phase(self) -> Phase:
        return self.layout.phase


# -- stores: how a window is read and how one new position is written into it ------------


@dataclass(frozen=True)
class PlainStore:
    """Keys and values as stored (one array each)."""

    width = 1
    quantized_window = False

    def join(self, keys, values, k, v, at):
        put = lambda a, x: mx.slice_update(a, x.astype(a.dtype), at, axes=(2,))
        return put(keys[0], k), put(values[0], v)

    def written(self, wk, wv):
        """The arrays the step leaves the graph with (the commit adopts them)."""
        return wk, wv


@dataclass(frozen=True)
class AffineStore:
    """mlx-lm's affine triples (codes, scales, biases); the stand-in carries ``bits`` and
    ``group_size``, so mlx-lm's attention takes its quantized SDPA, as it does eagerly."""

    bits: int
    group_size: int
    width = 3
    quantized_window = True

    def join(self, keys, values, k, v, at):
        def put(stored, x):
            new = mx.quantize(x, group_size=self.group_size, bits=self.bits)
            return tuple(mx.slice_update(a, n, at, axes=(2,)) for a, n in zip(stored, new))

        return put(keys, k), put(values, v)

    def written(self, wk, wv):
        return (*wk, *wv)


@dataclass(frozen=True)
class TurboStore(codes_window.CodesReader):
    """TurboQuant's five code arrays with the new position's codes written at the traced row:
    attended as codes (``codes``: the stand-in shows ``bits``, as the eager cache does) or
    decoded in the new keys' dtype (the exact read). Read as codes, the written code arrays
    leave the graph and the cache adopts them; decoded, only the new keys and values leave
    it and the commit appends them through the cache."""

    k_bits: int
    v_bits: int
    codes: bool = True
    width = 5  # all five arrays travel on the "keys" side; the values side is empty

    def join(self, keys, values, k, v, at):
        codes = tq.encode_codes(k, v, self.k_bits, self.v_bits, stacked=True)  # one position
        if self.codes:
            new = tq.pack_codes(codes, self.k_bits, self.v_bits)
            return codes_window.window(
                (mx.slice_update(a, n, at, axes=(2,)) for a, n in zip(keys, new)), self.k_bits, self.v_bits
            )
        dk, dv = tq.decode(keys, self.k_bits, self.v_bits)
        nk, nv = tq.decode_codes(codes, self.v_bits)
        put = lambda a, x: mx.slice_update(a.astype(k.dtype), x.astype(k.dtype), at, axes=(2,))
        return put(dk, nk), put(dv, nv)

    def written(self, wk, wv):
        return tuple(wk.stored) if self.codes else ()


# -- the stand-in a traced model calls ------------------------------------------------------


class StepCache:
    """One layer's cache inside the trace (see the module docstring)."""

    def __init__(self, layout, offset, write_at, keys, values, roll=None):
        self.layout = layout
        self.offset = offset  # traced int32 scalar: the new token's position (RoPE)
        self.write_at = write_at  # traced int32 [1]: the window row it is written to
        self.roll = roll
        self.keys, self.values = keys, values
        self.new = None
        store = layout.store
        if store.quantized_window:  # mlx-lm routes on hasattr(cache, "bits")
            self.bits, self.group_size = store.bits, store.group_size

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1:
            raise MLXKVError(f"a compiled decode step appends one position per row, got L={keys.shape[2]}")
        if self.new is not None:
            raise MLXKVError("a compiled decode step appends to each cache once")
        store = self.layout.store
        wk, wv = store.join(self.keys, self.values, keys, values, self.write_at)
        self.new = (keys, values, *store.written(wk, wv))
        return wk, wv

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        if N != 1:
            raise MLXKVError(f"a compiled decode step masks one query position, got N={N}")
        return self.layout.mask(self, window_size)

    def outputs(self):
        """``(keys, values, *window)``: the new position, then the written window arrays."""
        if self.new is None:
            raise MLXKVError("the model never appended to this layer's cache in the decode step")
        return self.new

    def effects(self):
        return None


def _rows_upto(at, rows: int):
    """``arange(rows) <= at``: the window rows a query at window row ``at`` may see."""
    return mx.arange(rows, dtype=mx.int32) <= at


@dataclass(frozen=True)
class WindowLayout:
    """A linear window (plain, affine, TurboQuant, eviction): ``rows`` fixed for the trace,
    the new position written at a traced row, later rows masked. With ``gapped`` the rows
    are not positions (an eviction cache keeps some), so no sliding window can be applied."""

    phase: Phase
    store: Any
    gapped: bool = False

    def open(self, arrays):
        offset, write_at, *stored = arrays
        w = self.store.width
        return StepCache(self, offset, write_at, tuple(stored[:w]), tuple(stored[w:]))

    def mask(self, cache, window_size):
        valid = _rows_upto(cache.write_at, self.phase.rows)
        if window_size is None:
            return valid
        if self.gapped:
            raise MLXKVError(
                f"{self.phase.kind}: a compiled decode step cannot apply a sliding window to an "
                "eviction cache's gapped positions; decode it eagerly"
            )
        return valid & (mx.arange(self.phase.rows, dtype=mx.int32) > cache.offset - window_size)


@dataclass(frozen=True)
class RingLayout:
    """A ring (plain or affine rows). While it fills, rows are positions and the rows past
    the new one are masked; once it wraps the whole ring is attended and a sliding window
    narrower than the ring is mlx-lm's rolled mask, rolled by a traced shift."""

    phase: Phase
    store: Any
    max_size: int

    def open(self, arrays):
        offset, write_at, roll, *stored = arrays
        w = self.store.width
        return StepCache(self, offset, write_at, tuple(stored[:w]), tuple(stored[w:]), roll)

    def mask(self, cache, window_size):
        rows = self.phase.rows
        if self.phase.name == "ring-fill":
            valid = _rows_upto(cache.write_at, rows)
            if window_size is None:
                return valid
            return valid & (mx.arange(rows, dtype=mx.int32) > cache.offset - window_size)
        if window_size is None or self.max_size <= window_size:
            return None
        # mlx-lm: mx.roll(mx.arange(n) >= n - window, shift=idx + 1), with a traced shift
        return ((mx.arange(rows, dtype=mx.int32) - cache.roll) % rows) >= rows - window_size


# -- recurrent state ------------------------------------------------------------------------


class RecurrentStepCache:
    """Recurrent state inside the trace: the model reads and replaces entries and advances
    it; what it leaves behind leaves the graph as arrays. ``left_padding`` (traced, or None)
    is what the model's mask reads; the commit's ``advance`` moves the real one."""

    def __init__(self, entries, left_padding=None):
        self.cache = list(entries)
        self.lengths, self.left_padding = None, left_padding
        self.advanced = 0

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value):
        self.cache[i] = value

    def advance(self, n: int):
        self.advanced += n

    def make_mask(self, N: int, **_):
        if self.left_padding is None:
            return None
        # mlx-lm's ArraysCache.make_mask, before this step's advance
        return mx.arange(N)[None, :] >= self.left_padding[:, None]

    def outputs(self):
        return tuple(a for a in self.cache if a is not None)

    def effects(self):
        """What the commit replays on the real cache, fixed for the trace."""
        return tuple(a is not None for a in self.cache), self.advanced


@dataclass(frozen=True)
class RecurrentLayout:
    phase: Phase
    present: tuple  # which entries hold arrays (the others are None)
    padded: bool = False  # the last array is the left padding

    def open(self, arrays):
        arrays = list(arrays)
        left_padding = arrays.pop() if self.padded else None
        it = iter(arrays)
        return RecurrentStepCache([next(it) if p else None for p in self.present], left_padding)


@dataclass(frozen=True)
class EagerLayout:
    """A step that cannot run compiled (an empty cache's first append fixes its geometry)."""

    phase: Phase = field(default_factory=lambda: Phase("", "eager"))
