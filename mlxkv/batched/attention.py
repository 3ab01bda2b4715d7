"""``BatchedKVCache``: the batched row layout of the attention caches (plain, affine, ring,
affine ring, TurboQuant; the eviction caches subclass it in ``batched.eviction``).

Rows are right-aligned and left-padded (see ``batched.columns``). A row format
(``RowFormat``; ``batched.formats``) says how one serial kind stores its positions: ``read``
a serial cache's stored positions in temporal order, ``restore`` a serial cache from them;
its storage (``batched.storages``) says how positions are encoded. Row surgery moves stored
arrays only: nothing is decoded and re-encoded.

Every append goes through one plan, computed from host integers, that both ``make_mask``
(before the append) and ``update_and_fetch`` use: ring eviction (metadata only), then, when
the buffer is full, one gather that packs the rows and adds slack.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..caches.base import CacheContract, DtypeAttribute, row_bytes
from ..caches.reads import AttentionRead
from ..errors import CacheConfigError, MLXKVError
from .columns import (
    Columns,
    RowOffsets,
    check_row,
    evict_oldest,
    gather_columns,
    packed_columns,
    source_columns,
    stack_left_padded,
    stored_mask,
    visibility_mask,
)

_NOT_QUANTIZED = "{}: these rows are not read as a quantized window (plain, ring or eviction rows)"


class MlxLmRowSurgery:
    """mlx-lm's names for a batch's row surgery (its ``BatchGenerator`` calls these); methods,
    so a layout that overrides the surgery is reached through either name."""

    def extend(self, other):
        return self.extend_rows(other)

    def filter(self, batch_indices):
        return self.filter_rows(batch_indices)

    def extract(self, idx: int):
        return self.extract_row(idx)


@dataclass(frozen=True)
class _Plan:
    cols: Columns  # layout right after the append
    counts_before: np.ndarray  # stored positions each row attends besides the new ones
    lo: int  # first column returned
    pack: tuple[Columns, int] | None  # (layout to pack from, new capacity) or None


class BatchedKVCache(MlxLmRowSurgery, RowOffsets, CacheContract):
    """Rows of one serial attention kind; ``offset`` is the per-row position array.

    ``key_arrays``/``value_arrays`` are the storage's tuples of ``[B, H, capacity, X]``
    arrays (None before anything is stored); ``keys``/``values`` show them as mlx-lm shows
    its caches' (the storage's ``shown``). ``row_state`` holds per-row extras of a format
    (arrays indexed by row on axis 0).
    """

    step = 256  # slack columns allocated whenever the buffer is (re)packed
    dtype = DtypeAttribute()

    def __init__(self, fmt, keys, values, cols: Columns, offsets, min_reuse, masks=None, row_state=None, dtype=None):
        self.fmt = fmt
        self.key_arrays, self.value_arrays = keys, values  # tuples of [B, H, cap, X] arrays, or None
        self.cols = cols
        self._init_rows(offsets, min_reuse)
        self.row_state = dict(row_state or {})
        self.dtype = dtype
        if masks is not None:
            self.masks = masks
        self._remaining = None  # prepare(): real tokens each row still appends in a padded prefill

    # -- identity and position ----------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.fmt.batched_kind

    @property
    def capacity(self) -> int:
        return 0 if self.key_arrays is None else self.key_arrays[0].shape[2]

    # mlx-lm's view of the stored arrays: one [B, H, capacity, D] array for plain, ring and
    # eviction rows (its BatchKVCache's ``keys``), the affine triple for affine rows (its
    # QuantizedKVCache's); assigning one replaces it (its pipeline-parallel models do)
    @property
    def keys(self):
        return None if self.key_arrays is None else self.fmt.storage.shown(self.key_arrays)

    @keys.setter
    def keys(self, shown):
        self.key_arrays = self.fmt.storage.replaced(self.key_arrays, shown)

    @property
    def values(self):
        return None if self.value_arrays is None else self.fmt.storage.shown(self.value_arrays)

    @values.setter
    def values(self, shown):
        self.value_arrays = self.fmt.storage.replaced(self.value_arrays, shown)

    def keys_and_values(self):
        """``keys`` and ``values`` cut to the columns rows use (mlx-lm's ``keys_and_values``)."""
        if self.key_arrays is None:
            return None, None
        cut = lambda t: self.fmt.storage.shown(tuple(a[..., : self.cols.idx, :] for a in t))
        return cut(self.key_arrays), cut(self.value_arrays)

    # mlx-lm takes its quantized SDPA on hasattr(cache, "bits"): shown by rows whose window is
    # a quantized window (affine triples, TurboQuant codes); asked by every layer at every
    # step, so the refusal's message is a constant (no kind formatted)
    @property
    def bits(self) -> int:
        if not self.fmt.storage.quantized_window:
            raise AttributeError(_NOT_QUANTIZED.format("bits"))
        return self.fmt.storage.bits

    @property
    def group_size(self) -> int:
        if not self.fmt.storage.quantized_window:
            raise AttributeError(_NOT_QUANTIZED.format("group_size"))
        return self.fmt.storage.group_size

    # -- mlx-lm's right-padded prefill ----------------------------------------------------
    def prepare(self, *, lengths=None, right_padding=None, left_padding=None):
        """mlx-lm's batch engine right-pads prompts of different lengths: row i appends
        ``lengths[i]`` real tokens then padding. Each append of the bracket drops every row's
        padding columns before it returns, so rows hold (and evict for, report) only
        their own tokens, and ``finalize`` has nothing left to move."""
        if left_padding is not None and max(left_padding, default=0) > 0:
            raise MLXKVError(
                f"{self.kind}: left-padded prefill is not supported; pass lengths= and right_padding= "
                "(mlx-lm's BatchGenerator does)"
            )
        if right_padding is not None and max(right_padding, default=0) > 0:
            lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
            if len(lengths) != self.batch_size:
                raise MLXKVError(f"{self.kind}: {len(lengths)} lengths for a batch of {self.batch_size} rows")
            self._remaining = lengths

    def finalize(self):
        self._remaining = None

    def _real_counts(self, N: int) -> np.ndarray | None:
        """Tokens of an N-token append that are each row's own (the rest is padding); None
        outside a padded prefill: all N, for every row."""
        if self._remaining is None:
            return None
        real = np.minimum(self._remaining, np.int64(N))
        self._remaining = self._remaining - real
        return real

    # -- the append plan ----------------------------------------------------------------
    def _plan(self, N: int) -> _Plan:
        """The append plan: a function of the layout, the capacity and N only, so it is
        computed once per forward for every layer of a batch (which then share its
        ``Columns``: each derives its counts and key once)."""
        key = ("plan", self.fmt.max_size, self.fmt.keep, self.step, N, self.capacity, self.cols.key())
        return self.masks.shared(key, lambda: self._new_plan(N))

    def _new_plan(self, N: int) -> _Plan:
        cols = self.cols
        if self.fmt.max_size is not None:
            cols = evict_oldest(cols, self.fmt.keep, self.fmt.max_size - 1)
        counts = cols.counts
        pack = None
        if cols.idx + N > self.capacity:
            packed = packed_columns(counts)
            pack = (cols, round_up(packed.idx + N, self.step))
            cols = packed
        return _Plan(Columns(cols.s, cols.e, cols.w, cols.idx + N), counts, cols.lo, pack)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_):
        window = window_size or self.fmt.max_size
        key = ("batched", self.fmt.max_size, self.fmt.keep, N, window, self.capacity, self.cols.key())

        def build():
            p = self._plan(N)
            return visibility_mask(p.cols, p.counts_before, N, p.lo, window)

        return self.masks.get(key, build)

    def _encode(self, keys: mx.array, values: mx.array):
        st = self.fmt.storage
        return st.encode_keys(keys), st.encode_values(values)

    def _after_append(self, N: int):
        """Hook run after the new positions are stored (eviction policies)."""

    def _repacked(self, cols: Columns, end: int, width: int, counts=None):
        """(keys, values) with every row right-aligned at column ``end`` of ``width``
        columns from layout ``cols`` (only each row's first ``counts`` positions when given):
        one gather; the batch is not changed."""
        rows = np.arange(self.batch_size)
        src, valid = source_columns(cols, rows, width, counts, end)
        st = self.fmt.storage
        keys = gather_columns(self.key_arrays, rows, src, valid, st.key_fills)
        values = gather_columns(self.value_arrays, rows, src, valid, st.value_fills)
        return keys, values

    def _repack(self, cols: Columns, end: int, width: int, counts=None):
        self.key_arrays, self.value_arrays = self._repacked(cols, end, width, counts)

    def _keep_first(self, counts: np.ndarray):
        """Keep each row's first ``counts`` stored positions (drop its tail), repacked."""
        if self.key_arrays is not None:
            end = int(counts.max(initial=0))
            self._repack(self.cols, end, max(self.capacity, end), counts)
        self.cols = packed_columns(counts)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        self.dtype = keys.dtype
        real = self._real_counts(N)
        before = self.offsets
        k_new, v_new = self._encode(keys, values)
        p = self._plan(N)
        st = self.fmt.storage
        if p.pack is not None:
            src_cols, cap = p.pack
            if self.key_arrays is None:
                full = lambda t, fills: tuple(
                    mx.full((a.shape[0], a.shape[1], cap, *a.shape[3:]), f, a.dtype) for a, f in zip(t, fills)
                )
                self.key_arrays, self.value_arrays = full(k_new, st.key_fills), full(v_new, st.value_fills)
            else:
                self._repack(src_cols, p.cols.idx - N, cap)
        at = p.cols.idx - N
        for store, new in ((self.key_arrays, k_new), (self.value_arrays, v_new)):
            for a, n in zip(store, new):
                a[..., at : at + N, :] = n
        self.cols = p.cols
        if real is None:  # every layer advances the same offsets: one array (and mx.array) for all
            self._share_offsets(self.masks.shared(("offsets", before.tobytes(), N), lambda: self._advanced(before, N)))
        else:
            self._set_offsets(before + real)
        out = self._window(p.lo, p.cols.idx, keys.dtype)
        if real is not None and (real < N).any():  # a padded prefill: every row keeps only its own tokens
            self._keep_first(self.cols.counts - (N - real))
        self._after_append(N)
        return out

    def _window(self, lo: int, idx: int, dtype):
        """What the attention of this append reads: the stored columns ``[lo, idx)`` as the
        storage fetches them (affine triples, TurboQuant codes: mlx-lm's quantized SDPA)."""
        st = self.fmt.storage
        cut = lambda t: tuple(a[..., lo:idx, :] for a in t)
        return st.fetch(cut(self.key_arrays), cut(self.value_arrays), dtype)

    # -- contract -----------------------------------------------------------------------
    @property
    def state(self):
        return self.key_arrays, self.value_arrays, self.offset

    def size(self) -> int:
        return int(self.cols.counts.max(initial=0))

    def empty(self) -> bool:
        return self.key_arrays is None

    @property
    def nbytes(self) -> int:
        if self.key_arrays is None:
            return 0
        return sum(a.nbytes for a in self.key_arrays + self.value_arrays)

    def bytes_per_token(self) -> int:
        return 0 if self.key_arrays is None else row_bytes(*self.key_arrays, *self.value_arrays)

    def projected_bytes(self, rows=(), tokens: int = 0) -> int:
        """Bytes this batch will hold once rows holding ``rows`` positions each have joined
        and every row has appended ``tokens`` more, within one allocation step (``step``
        columns of every row) of what it will really hold."""
        per_column = self._column_bytes()
        if per_column is None:
            return self.nbytes
        counts = np.concatenate([self.cols.counts, np.asarray(rows, dtype=np.int64)]) + tokens
        stored = np.minimum(counts, self._stored_limit())
        return per_column * len(counts) * round_up(int(stored.max(initial=0)) + 1, self.step)

    def _stored_limit(self) -> int:
        """Positions a row can hold after an append (rings: max_size - 1 plus the append)."""
        return np.iinfo(np.int64).max if self.fmt.max_size is None else self.fmt.max_size

    def _column_bytes(self) -> int | None:
        """Bytes of one column of one row in the batch's storage (None before any append)."""
        if self.key_arrays is None:
            return None
        return row_bytes(*self.key_arrays, *self.value_arrays)

    def is_trimmable(self) -> bool:
        """Plain, affine and TurboQuant rows always; ring rows while no row has wrapped."""
        return self.fmt.max_size is None or bool((self.offsets < self.fmt.max_size).all())

    def _trimmable_rows(self) -> np.ndarray:
        if self.fmt.max_size is None:
            return np.ones(self.batch_size, dtype=bool)
        return self.offsets < self.fmt.max_size

    def trim(self, n: int) -> int:
        """Trim every row by n (at most the shortest row); mlx-lm's ``trim``."""
        if not self.is_trimmable() or self.batch_size == 0:
            return 0
        n = int(min(n, self.cols.counts.min()))
        c = self.cols
        self.cols = Columns(c.s, c.e, c.w, c.idx - n)
        self._set_offsets(self.offsets - n)
        self._after_trim(np.full(self.batch_size, n, dtype=np.int64))
        return n

    def trim_rows(self, counts) -> np.ndarray:
        """Trim row i by ``counts[i]`` positions (speculative decoding rolls each row back by
        its own rejected count). Every row must be able to trim that far, or nothing changes."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if len(counts) != self.batch_size or (counts < 0).any():
            raise MLXKVError(f"{self.kind}: trim_rows needs {self.batch_size} counts >= 0, got {counts.tolist()}")
        stored = self.cols.counts
        bad = np.nonzero((counts > 0) & (~self._trimmable_rows() | (counts > stored)))[0]
        if len(bad):
            i = int(bad[0])
            raise CacheConfigError(
                f"{self.kind}: row {i} cannot trim {int(counts[i])} positions (it stores {int(stored[i])}"
                f"{'' if self._trimmable_rows()[i] else ' and has wrapped or evicted'}); nothing was trimmed"
            )
        if not counts.any():
            return counts
        if (counts == counts[0]).all():
            self.trim(int(counts[0]))
            return counts
        self._keep_first(stored - counts)
        self._set_offsets(self.offsets - counts)
        self._after_trim(counts)
        return counts

    def _after_trim(self, counts: np.ndarray):
        """Hook run after rows were trimmed by ``counts`` (Q-Filters thaws)."""

    def dense_window(self):
        """All rows' stored columns ``[cols.lo, cols.idx)``, decoded, padding included
        (``stored_mask`` says which)."""
        if self.key_arrays is None or not self.cols.counts.any():
            return None
        lo, idx, st = self.cols.lo, self.cols.idx, self.fmt.storage
        cut = lambda t: tuple(a[..., lo:idx, :] for a in t)
        dtype = self.dtype or mx.bfloat16
        return st.decode_keys(cut(self.key_arrays), dtype), st.decode_values(cut(self.value_arrays), dtype)

    def read_block(self, keys: mx.array, values: mx.array) -> AttentionRead:
        """Attend each row's stored positions plus the block; padding and gaps stay hidden."""
        return block_read(self.cols, self.dense_window(), keys, values)

    # -- row surgery ----------------------------------------------------------------------
    def _compatible(self, other):
        if not isinstance(other, BatchedKVCache) or type(other) is not type(self) or other.fmt != self.fmt:
            raise CacheConfigError(
                f"cannot join a {getattr(other, 'kind', type(other).__name__)} batch "
                f"({getattr(other, 'fmt', None)}) into a {self.kind} batch ({self.fmt}): "
                "rows of one batched cache share one kind and one geometry"
            )
        mine, theirs = self.key_arrays, other.key_arrays
        if (
            mine is not None
            and theirs is not None
            and (mine[0].shape[1] != theirs[0].shape[1] or mine[0].dtype != theirs[0].dtype)
        ):
            raise CacheConfigError(f"{self.kind}: rows with other head geometry or dtype cannot be joined")
        if self._remaining is not None or other._remaining is not None:
            raise MLXKVError(f"{self.kind}: rows cannot join in the middle of a padded prefill (finalize first)")

    def extend_rows(self, other: "BatchedKVCache"):
        """Join ``other``'s rows after ours (in place): the shorter side is left-padded."""
        self._compatible(other)
        T = max(self.cols.idx, other.cols.idx)
        slack = max(c.capacity - c.cols.idx for c in (self, other))  # the next appends write in place
        st = self.fmt.storage
        like = self if self.key_arrays is not None else other

        def widened(c, t, like_t, fills):
            """``c``'s arrays ``t`` left-padded to T columns plus the slack (all padding when it
            stores nothing)."""
            if t is None:
                shape = lambda a: (c.batch_size, a.shape[1], T + slack, *a.shape[3:])
                return tuple(mx.full(shape(a), f, a.dtype) for a, f in zip(like_t, fills))
            d = T - c.cols.idx
            return tuple(
                mx.pad(a[..., : c.cols.idx, :], [(0, 0), (0, 0), (d, slack), (0, 0)], constant_values=f)
                for a, f in zip(t, fills)
            )

        sides = []
        for c in (self, other):
            cols = c.cols.shifted(T - c.cols.idx)
            if like.key_arrays is None:
                sides.append((None, None, cols))
            else:
                keys = widened(c, c.key_arrays, like.key_arrays, st.key_fills)
                sides.append((keys, widened(c, c.value_arrays, like.value_arrays, st.value_fills), cols))
        if like.key_arrays is not None:
            self.key_arrays = tuple(mx.concatenate(p, axis=0) for p in zip(sides[0][0], sides[1][0]))
            self.value_arrays = tuple(mx.concatenate(p, axis=0) for p in zip(sides[0][1], sides[1][1]))
        a, b = sides[0][2], sides[1][2]
        self.cols = Columns(np.concatenate([a.s, b.s]), np.concatenate([a.e, b.e]), np.concatenate([a.w, b.w]), T)
        self._set_offsets(np.concatenate([self.offsets, other.offsets]))
        self.row_minimum_reusable_offsets = np.concatenate(
            [self.row_minimum_reusable_offsets, other.row_minimum_reusable_offsets]
        )
        self.row_state = {k: _concat_rows(v, other.row_state[k]) for k, v in self.row_state.items()}
        self.dtype = self.dtype or other.dtype
        return self

    def filter_rows(self, keep):
        """Keep rows ``keep`` (in that order): one take along the rows; the columns left of
        every survivor's first position go, the others (and the slack) stay where they are.
        Inside a padded prefill each survivor keeps its count of real tokens to come."""
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        for i in keep:
            check_row(int(i), self.batch_size)
        keep = keep % max(self.batch_size, 1)
        cols = self.cols.take(keep)
        shift = cols.lo
        if self.key_arrays is not None:
            rows = mx.array(keep.astype(np.int32))
            self.key_arrays = tuple(mx.take(a, rows, axis=0)[..., shift:, :] for a in self.key_arrays)
            self.value_arrays = tuple(mx.take(a, rows, axis=0)[..., shift:, :] for a in self.value_arrays)
        self.cols = cols.shifted(-shift)
        self._set_offsets(self.offsets[keep])
        self.row_minimum_reusable_offsets = self.row_minimum_reusable_offsets[keep]
        self.row_state = {k: _take_rows(v, keep) for k, v in self.row_state.items()}
        if self._remaining is not None:
            self._remaining = self._remaining[keep]
        return self

    def extract_row(self, i: int):
        """Row ``i`` as an owned serial cache of its own kind at its own offset."""
        i = check_row(i, self.batch_size)
        rows = np.array([i])
        count = int(self.cols.counts[i])
        if self.key_arrays is None or count == 0:
            k = v = None
        else:
            st = self.fmt.storage
            src, valid = source_columns(self.cols, rows, count)
            k = gather_columns(self.key_arrays, rows, src, valid, st.key_fills)
            v = gather_columns(self.value_arrays, rows, src, valid, st.value_fills)
        extras = {name: _take_rows(a, rows) for name, a in self.row_state.items()}
        row = self.fmt.restore(k, v, int(self.offsets[i]), count, self.dtype, extras)
        row.masks = self.masks
        row.minimum_reusable_offset = int(self.row_minimum_reusable_offsets[i])
        return row


def block_read(cols: Columns, stored, keys: mx.array, values: mx.array) -> AttentionRead:
    """The block read over a batch laid out as ``cols`` whose decoded columns
    ``[cols.lo, cols.idx)`` are ``stored`` (None when empty): each row attends its stored
    positions plus the block; padding and gaps stay hidden."""
    if stored is None:
        return AttentionRead(keys, values, None)
    B, L = keys.shape[0], keys.shape[2]
    visible = mx.concatenate([stored_mask(cols, cols.lo), mx.ones((B, L), mx.bool_)], axis=1)
    sk, sv = stored
    return AttentionRead(
        mx.concatenate([sk, keys.astype(sk.dtype)], axis=2),
        mx.concatenate([sv, values.astype(sv.dtype)], axis=2),
        visible[:, None, None, :],
    )


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _concat_rows(a, b):
    if a is None and b is None:
        return None
    return mx.concatenate([a, b], axis=0) if isinstance(a, mx.array) else np.concatenate([a, b], axis=0)


def _take_rows(a, rows: np.ndarray):
    if a is None:
        return None
    return mx.take(a, mx.array(rows.astype(np.int32)), axis=0) if isinstance(a, mx.array) else a[rows]


def merge_attention_rows(fmt, rows, cls=BatchedKVCache):
    """One batch from serial caches of ``fmt``'s kind (one gather places every row).

    The buffer is exactly the longest row's columns, as mlx-lm's ``BatchKVCache.merge``
    makes it (``keys`` is ``[B, H, T, D]``, T its ``_idx``): the first append repacks it
    with ``step`` columns of slack, as mlx-lm's allocates ``step`` more."""
    read = [fmt.read(r) for r in rows]  # (keys tuple, values tuple, count, extras) per row
    counts = np.array([c for _, _, c, _ in read], dtype=np.int64)
    offsets = [int(r.offset) for r in rows]
    min_reuse = [int(getattr(r, "minimum_reusable_offset", 0)) for r in rows]
    full = [(k, v) for k, v, c, _ in read if c > 0]
    cols = packed_columns(counts)
    keys = values = None
    st = fmt.storage
    if full:
        ref = full[0][0][0]
        for k, _ in full:
            if k[0].shape[1] != ref.shape[1] or k[0].shape[3:] != ref.shape[3:] or k[0].dtype != ref.dtype:
                raise CacheConfigError(
                    f"{fmt.serial_kind} rows with different head geometry or dtype cannot share a batch: "
                    f"{tuple(ref.shape)} {ref.dtype} vs {tuple(k[0].shape)} {k[0].dtype}"
                )
        width = cols.idx
        empty = lambda t: tuple(a[..., :0, :] for a in t)
        ks = [k if c > 0 else empty(full[0][0]) for k, _, c, _ in read]
        vs = [v if c > 0 else empty(full[0][1]) for _, v, c, _ in read]
        keys = stack_left_padded(ks, counts, width, st.key_fills)
        values = stack_left_padded(vs, counts, width, st.value_fills)
    row_state = {}
    for name in read[0][3]:
        vals = [x[name] for _, _, _, x in read]
        row_state[name] = mx.concatenate(vals, axis=0) if isinstance(vals[0], mx.array) else np.asarray(vals)
    dtype = next((d for d in (fmt.dtype_of(r) for r in rows) if d is not None), None)
    return cls(fmt, keys, values, cols, offsets, min_reuse, rows[0].masks, row_state, dtype)
