"""Column arithmetic shared by the batched row layouts (docs/batched.md).

A batched attention cache stores ``[B, H, T, X]`` arrays whose rows are right-aligned:
row ``b`` holds its stored positions, in temporal order, in the columns
``[s_b, e_b) ++ [w_b, idx)``. ``[s_b, e_b)`` are a ring's protected ``keep`` sinks and
``[e_b, w_b)`` is the gap its evictions opened; a row without a gap has ``s_b == e_b == w_b``
and is simply ``[s_b, idx)``. Everything left of a row's first column is padding.

The per-row integers live on the host (numpy): they change only by whole-batch arithmetic,
so no step has to read them back from the device.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ..errors import RowIndexError


def check_row(i: int, B: int) -> int:
    if not -B <= i < B:
        raise RowIndexError(f"row {i} does not exist in a batch of {B} rows")
    return i % B


@dataclass(frozen=True)
class Columns:
    """Where each row's stored positions are: sinks ``[s, e)`` then window ``[w, idx)``.

    Immutable (its arrays are never written in place), so what it derives is computed once
    per object: the layers of a batch share one ``Columns`` after each append (the append
    plan is memoized per forward), and each step derives ``counts``, ``lo`` and ``key`` once
    for all of them."""

    s: np.ndarray
    e: np.ndarray
    w: np.ndarray
    idx: int

    @cached_property
    def counts(self) -> np.ndarray:
        return (self.e - self.s) + (self.idx - self.w)

    @cached_property
    def lo(self) -> int:
        """First column any row uses (``idx`` when every row is empty)."""
        return int(min(self.s.min(initial=self.idx), self.idx))

    @cached_property
    def _key(self) -> tuple:
        return (self.idx, tuple(self.s.tolist()), tuple(self.e.tolist()), tuple(self.w.tolist()))

    def key(self) -> tuple:
        return self._key

    def take(self, rows) -> "Columns":
        return Columns(self.s[rows], self.e[rows], self.w[rows], self.idx)

    def shifted(self, d: int) -> "Columns":
        return Columns(self.s + d, self.e + d, self.w + d, self.idx + d)


def packed_columns(counts: np.ndarray) -> Columns:
    """Rows holding ``counts`` positions each, right-aligned with no gap."""
    counts = np.asarray(counts, dtype=np.int64)
    M = int(counts.max(initial=0))
    s = M - counts
    return Columns(s, s.copy(), s.copy(), M)


def evict_oldest(cols: Columns, n_keep: int, limit: int) -> Columns:
    """Drop, per row, the oldest non-sink positions beyond ``limit`` (metadata only).

    A ring attends its ``keep`` sinks plus its most recent positions; before an append it is
    cut to ``max_size - 1`` stored positions (mlx-lm's ring does exactly this), so
    ``limit = max_size - 1``.
    """
    s, e, w = cols.s, cols.e, cols.w
    over = np.maximum(0, cols.counts - limit)
    evicts = over > 0
    first_recent = np.where(e < w, w, s + n_keep)
    e = np.where(evicts, s + n_keep, e)
    w = np.where(evicts, first_recent + over, w)
    no_sinks = e == s  # rows without sinks are just their window
    s = np.where(no_sinks, w, s)
    e = np.where(no_sinks, w, e)
    return Columns(s, e, w, cols.idx)


def source_columns(
    cols: Columns, rows: np.ndarray, width: int, counts=None, end: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """For packing ``rows`` right-aligned into ``width`` columns: the source column of each
    target column and whether it holds a stored position (else padding or slack).

    ``counts`` (one per row of ``rows``) keeps only each row's first ``counts`` stored
    positions in temporal order (a row's tail dropped: padding of a right-padded prefill, a
    per-row trim); by default every stored position is kept. Rows end at column ``end``
    (default: the longest of them), so a subset of a batch's rows can be packed as the whole
    batch is."""
    s, e, w = cols.s[rows, None], cols.e[rows, None], cols.w[rows, None]
    if counts is None:
        counts = (e - s) + (cols.idx - w)
    else:
        counts = np.asarray(counts, dtype=np.int64).reshape(-1, 1)
    M = int(counts.max(initial=0)) if end is None else int(end)
    t = np.arange(width)[None, :]
    j = t - (M - counts)  # rank of the stored position at target column t
    valid = (j >= 0) & (j < counts)
    src = np.where(j < e - s, s + j, w + j - (e - s))
    return np.where(valid, src, 0), valid


def gather_columns(arrays: Sequence[mx.array], rows: np.ndarray, src: np.ndarray, valid: np.ndarray, fills=None):
    """``out[b, :, t] = a[rows[b], :, src[b, t]]`` where valid, else the array's fill value
    (0 unless ``fills`` says otherwise): one gather per array."""
    rows_mx = mx.array(rows.astype(np.int32))
    idx = mx.array(src.astype(np.int32))[:, None, :, None]
    keep = mx.array(valid)[:, None, :, None]
    fills = fills or (0,) * len(arrays)
    out = []
    for a, fill in zip(arrays, fills):
        if a.shape[2] == 0:  # nothing stored anywhere: the result is all padding
            out.append(mx.full((len(rows), a.shape[1], src.shape[1], *a.shape[3:]), fill, a.dtype))
            continue
        g = mx.take_along_axis(mx.take(a, rows_mx, axis=0), idx, axis=2)
        out.append(mx.where(keep, g, mx.array(fill, a.dtype)))
    return tuple(out)


def stack_left_padded(parts: list[Sequence[mx.array]], counts: Sequence[int], width: int, fills=None, end=None):
    """Right-align per-row storage ``parts[r][i]`` (``[1, H, counts[r], X_i]``) into
    ``[B, H, width, X_i]`` arrays, filled (0 unless ``fills`` says otherwise) on the left as
    padding and on the right as slack. Rows end at column ``end`` (default: the longest
    row's count).

    The rows are joined once along the token axis and placed by one gather, so the padding
    is array arithmetic, not a loop over rows.
    """
    counts = np.asarray(counts, dtype=np.int64)
    B, M = len(parts), int(counts.max(initial=0)) if end is None else int(end)
    starts = 1 + np.concatenate([[0], np.cumsum(counts)[:-1]])  # column 0 is the fill column
    t = np.arange(width)[None, :]
    j = t - (M - counts[:, None])
    valid = (j >= 0) & (j < counts[:, None])
    src = mx.array(np.where(valid, starts[:, None] + j, 0).reshape(-1).astype(np.int32))
    fills = fills or (0,) * len(parts[0])
    out = []
    for i, fill in enumerate(fills):
        ref = parts[0][i]
        pad = mx.full((1, ref.shape[1], 1, *ref.shape[3:]), fill, ref.dtype)
        flat = mx.concatenate([pad] + [p[i] for p in parts], axis=2)[0]  # [H, 1 + sum, X]
        g = mx.take(flat, src, axis=1).reshape(ref.shape[1], B, width, *ref.shape[3:])
        out.append(mx.contiguous(mx.swapaxes(g, 0, 1)))  # rows outermost, as attention reads them
    return tuple(out)


def visibility_mask(cols: Columns, counts_before: np.ndarray, N: int, lo: int, window: int | None):
    """Boolean mask ``[B, 1, N, idx - lo]`` for N new positions appended at ``cols.idx - N``.

    Ranks count a row's stored positions in temporal order (0 = oldest kept); query j of row b
    has rank ``counts_before[b] + j``. A key is visible when it is stored, not after the query
    and, with a window, within ``window`` ranks of it: mlx-lm's causal and sliding-window
    rules, applied to each row's own positions, so padding and gaps are never attended.
    """
    i32 = lambda x: mx.array(np.asarray(x).astype(np.int32))
    q = i32(counts_before)[:, None] + mx.arange(N)[None, :]
    return visible(i32(cols.s), i32(cols.e), i32(cols.w), cols.idx, mx.arange(lo, cols.idx), q, window)


def visible(s, e, w, idx, c, q, window: int | None):
    """The rule of ``visibility_mask`` over int32 arrays (a compiled decode step traces it):
    per-row ``s``, ``e``, ``w`` [B], ``idx`` (int or int32 scalar), columns ``c`` [C],
    query ranks ``q`` [B, N] -> ``[B, 1, N, C]``. Columns at or past ``idx`` are not stored."""
    s, e, w, c = s[:, None], e[:, None], w[:, None], c[None, :]
    stored = ((c >= s) & (c < e)) | ((c >= w) & (c < idx))
    rank = mx.where(c < e, c - s, (e - s) + c - w)[:, None, :]
    q = q[:, :, None]
    mask = stored[:, None, :] & (rank <= q)
    if window is not None:
        mask = mask & (rank > q - window)
    return mask[:, None]


def stored_mask(cols: Columns, lo: int) -> mx.array:
    """``[B, idx - lo]``: which columns hold a stored position."""
    s = mx.array(cols.s.astype(np.int32))[:, None]
    e = mx.array(cols.e.astype(np.int32))[:, None]
    w = mx.array(cols.w.astype(np.int32))[:, None]
    c = mx.arange(lo, cols.idx)[None, :]
    return ((c >= s) & (c < e)) | (c >= w)


class RowOffsets:
    """Per-row positions of a batched layout: host integers ``offsets`` (int64) and
    ``row_minimum_reusable_offsets``, with ``offset`` as the int32 mx.array mlx-lm's models
    hand to RoPE (built once per change)."""

    def _init_rows(self, offsets, min_reuse=None):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.row_minimum_reusable_offsets = (
            np.zeros_like(self.offsets) if min_reuse is None else np.asarray(min_reuse, dtype=np.int64)
        )
        self._offset_array = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    @property
    def offset(self) -> mx.array:
        """Each row's true position (mlx-lm's models pass it to RoPE as a vector offset)."""
        if self._offset_array is None:
            self._offset_array = mx.array(self.offsets.astype(np.int32))
        return self._offset_array

    def _set_offsets(self, offsets):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self._offset_array = None

    @staticmethod
    def _advanced(offsets: np.ndarray, n: int) -> tuple[np.ndarray, mx.array]:
        """(``offsets + n``, as the int32 mx.array ``offset`` shows): what layers share."""
        out = offsets + n
        return out, mx.array(out.astype(np.int32))

    def _share_offsets(self, advanced: tuple[np.ndarray, mx.array]):
        """Take offsets (and their mx.array) shared with the other layers (never written in place)."""
        self.offsets, self._offset_array = advanced

    @property
    def minimum_reusable_offset(self) -> int:
        return int(self.row_minimum_reusable_offsets.max(initial=0))
