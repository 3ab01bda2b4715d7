"""Compiled decode steps of the batched layouts (mlx-lm's ``BatchGenerator`` decodes over them).

``batched_attention_step`` serves ``BatchedKVCache`` rows of plain, affine, ring, affine
ring and TurboQuant storage. The batch's whole buffer ``[B, H, capacity, X]`` enters the
graph and is written at a traced column (the batch adopts it: written in place); the step
attends its first columns up to the append's, rounded up to ``ATTEND_STEP``. The capacity
changes only when the batch repacks (every 256 columns of growth, a row joining or
leaving), so one trace serves up to 64 steps (a ring, once it has wrapped and holds its
columns, every step until its next repack). Outside the graph the step
takes the eager append's own plan (``BatchedKVCache._plan``): ring eviction (metadata), and
when the buffer is full the same repack gather. Inside, the new position is encoded and
written at a traced column, and the stand-in's mask is ``visibility_mask``'s rule
(``columns.visible``) over traced per-row columns, so padding, gaps, evicted and unwritten
columns stay hidden. The commit adopts the written buffers and finishes the append as the
eager ``update_and_fetch`` does (columns, offsets, ``_after_append``), so the stored bytes
are the eager step's.

Phases: ``window`` (rows = the columns attended); ``eager`` for an empty batch's first append and
for a step inside a padded prefill (``prepare`` .. ``finalize``), which are prefill steps.

Refused (``UnknownKindError`` naming the kind and why; ``fallback="eager"`` decodes them
eagerly): a bf16-first batch while some row has not converted (each row attends its own
precision through a dense window), and the eviction layouts (TOVA, Q-Filters), whose
per-row policy after every append is data-dependent and rewrites the rows.
"""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..caches.decode_step import DecodeStep, EagerLayout, Phase
from ..errors import MLXKVError, UnknownKindError
from .bf16first import Bf16FirstBatch
from .columns import visible

#: the columns a step attends are the buffer's first columns up to the append's, rounded up
#: to this (at most the capacity): one trace per 64 columns of growth, at most 63 attended
#: columns beyond the eager window (masked)
ATTEND_STEP = 64


def _i32(x) -> mx.array:
    return mx.array(np.asarray(x).astype(np.int32))


def _plan(cache):
    """The eager append's plan for one position and the traced column inputs it gives (the
    write column, ``idx``, per-row ``s``, ``e``, ``w`` and query rank), built once per step
    for every layer of the batch that shares these integers (the batch's mask memo)."""
    key = ("decode-step", cache.fmt.max_size, cache.fmt.keep, cache.capacity, cache.cols.key())

    def build():
        p = cache._plan(1)
        c = p.cols
        return p, (_i32([c.idx - 1]), _i32(c.idx), _i32(c.s), _i32(c.e), _i32(c.w), _i32(p.counts_before))

    return cache.masks.get(key, build)


def batched_attention_step(cache) -> DecodeStep:
    """The decode step of a ``BatchedKVCache`` of plain, affine, ring or TurboQuant rows (a
    bf16-first batch's once every row has converted: its target's)."""
    kind = cache.kind
    if isinstance(cache, Bf16FirstBatch):
        if cache.bf16 is not None:
            raise UnknownKindError(
                kind,
                f"bf16-first rows {cache.bf16_rows.tolist()} have not converted yet and attend their bf16 "
                "positions; the batch decodes compiled once every row has converted",
            )
        cache = cache.target
    if cache.key_arrays is None or cache._remaining is not None:
        return DecodeStep(EagerLayout(Phase(kind, "eager")), (), None)
    p, where = _plan(cache)
    keys, values = cache.key_arrays, cache.value_arrays
    if p.pack is not None:  # the buffer is full: the eager append's own repack
        src, grown = p.pack
        keys, values = cache._repacked(src, p.cols.idx - 1, grown)
    st, cols = cache.fmt.storage, p.cols
    capacity = keys[0].shape[2]
    width = min(capacity, -(-cols.idx // ATTEND_STEP) * ATTEND_STEP)
    layout = BatchedWindowLayout(Phase(kind, "window", width), st, cache.fmt.max_size, capacity)
    arrays = (cache.offset, *where, *keys, *values)
    n = len(keys)  # (the commit holds no buffer: the step can write it in place)

    def commit(new, dtype):
        cache.key_arrays, cache.value_arrays = tuple(new[:n]), tuple(new[n:])
        cache.dtype = dtype
        cache.cols = cols
        cache._set_offsets(cache.offsets + 1)
        cache._after_append(1)

    return DecodeStep(layout, arrays, commit)


def eviction_batch_step(cache) -> DecodeStep:
    raise UnknownKindError(
        cache.kind,
        "batched eviction rows run their policy per row after every append (data-dependent, rows "
        "rewritten); no compiled decode step",
    )


@dataclass(frozen=True)
class BatchedWindowLayout:
    phase: Phase  # rows: the buffer's capacity
    storage: Any  # the batch's storage (plain, affine, TurboQuant)
    max_size: int | None  # a ring's window (None for linear rows)
    capacity: int  # the buffer's columns (the phase's rows are the first columns attended)

    def open(self, arrays):
        offset, at, idx, s, e, w, q, *stored = arrays
        n = len(self.storage.key_fills)
        return BatchedStepCache(self, offset, at, idx, (s, e, w, q), tuple(stored[:n]), tuple(stored[n:]))


class BatchedStepCache:
    """One layer's batch inside the trace: ``offset`` is the traced per-row positions [B]
    (RoPE), ``update_and_fetch`` writes the new column at a traced index and returns the
    whole buffer (decoded as the batch's storage fetches it), ``make_mask`` hides every
    column a row does not attend."""

    def __init__(self, layout, offset, at, idx, columns, keys, values):
        self.layout = layout
        self.offset = offset
        self.at, self.idx, self.columns = at, idx, columns
        self.keys, self.values = keys, values
        self.dtype = None
        st = layout.storage
        if st.quantized_window:  # mlx-lm routes on hasattr(cache, "bits"), as eagerly
            self.bits, self.group_size = st.bits, st.group_size

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1:
            raise MLXKVError(f"a compiled decode step appends one position per row, got L={keys.shape[2]}")
        if self.dtype is not None:
            raise MLXKVError("a compiled decode step appends to each cache once")
        st = self.layout.storage
        put = lambda a, x: mx.slice_update(a, x.astype(a.dtype), self.at, axes=(2,))
        self.keys = tuple(put(a, x) for a, x in zip(self.keys, st.encode_keys(keys)))
        self.values = tuple(put(a, x) for a, x in zip(self.values, st.encode_values(values)))
        self.dtype = keys.dtype
        attended = lambda t: tuple(a[..., : self.layout.phase.rows, :] for a in t)
        return st.fetch(attended(self.keys), attended(self.values), keys.dtype)

    def make_mask(self, N: int, window_size=None, return_array: bool = False, **_):
        if N != 1:
            raise MLXKVError(f"a compiled decode step masks one query position, got N={N}")
        s, e, w, q = self.columns
        c = mx.arange(self.layout.phase.rows, dtype=mx.int32)
        return visible(s, e, w, self.idx, c, q[:, None], window_size or self.layout.max_size)

    def outputs(self):
        if self.dtype is None:
            raise MLXKVError("the model never appended to this layer's cache in the decode step")
        return (*self.keys, *self.values)

    def effects(self):
        return self.dtype
