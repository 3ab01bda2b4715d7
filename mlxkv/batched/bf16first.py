"""``Bf16FirstBatch``: a batch of bf16-first rows (``kv4-start256``, ``turbo-k8v3``,
``turbo-k4v2-start256``), the batched twin of the serial ``Bf16FirstCache``.

It wraps two batches of the general class (``batched.attention``). ``target`` holds every
row in the target's layout and encoding (affine or TurboQuant rows): an append encodes each
position on its own, so what an unconverted row accumulates there is byte for byte what its
conversion would encode from its bf16 window. ``bf16`` is a plain batch of the rows still
short of their start (``bf16_rows``: their indices in the batch, ascending), which keeps their
positions in the model's dtype and is what they attend. After each append the rows that
reached their start convert (``PendingConversion.due``, per row: the serial cache's rule) by
leaving ``bf16``; when none is left the batch is exactly its target.

Each row attends with the arithmetic its serial twin uses. A converted row attends the
target's read (mlx-lm's quantized SDPA over affine triples or TurboQuant codes; the dense
kernel over TurboQuant's decoded window with ``codes=False``); a row short of its start
attends its bf16 positions through the dense kernel. When the target is attended by the
dense kernel too, one window holds both (the unconverted rows' bf16 columns in place of their
codes); when it is not, the read is a
:class:`PrecisionSplit`, which mlx-lm's attention hands back to mlxkv
(``caches.routed_reads``): the converted rows through the target's attention, the others
through the dense kernel. Either way every row's logits are its serial twin's, bit for bit.

Both batches hold linear rows (bf16-first targets have no ring or eviction form), so every
row of either ends at its batch's last column and holds the same positions in both: the
columns the target's mask gives a row, read from the right, are the columns the plain batch
gives it.
"""

import copy
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention

from ..caches.routed_reads import RoutedRead
from ..caches.transition import Bf16FirstCache
from ..errors import CacheConfigError
from .attention import MlxLmRowSurgery, block_read, round_up
from .columns import check_row
from .rows import merge_rows


def _i32(rows: np.ndarray) -> mx.array:
    return mx.array(rows.astype(np.int32))


def _mask_rows(mask, rows: mx.array, width: int | None = None):
    """The mask of ``rows`` (over its last ``width`` columns: a plain batch's window)."""
    if mask is None or isinstance(mask, str):
        return mask
    mask = mx.take(mask, rows, axis=0)
    return mask if width is None else mask[..., mask.shape[-1] - width :]


def _taken(window, rows: mx.array):
    """``rows`` of the target's window: each array of affine triples, a routed read's own."""
    if isinstance(window, RoutedRead):
        return window.taken(rows)
    return tuple(mx.take(a, rows, axis=0) for a in window)


@dataclass(frozen=True, eq=False)
class PrecisionSplit(RoutedRead):
    """A mixed batch's read, split by precision: the ``converted`` rows attend the target's
    ``keys``/``values`` (every row's window; theirs taken) through mlx-lm's attention routed
    on ``target`` (its quantized SDPA), the ``bf16_rows`` their bf16 windows through the
    dense kernel; ``order`` puts the two outputs back in the batch's row order."""

    target: object
    keys: tuple
    values: tuple
    converted: mx.array
    bf16_rows: mx.array
    bf16_keys: mx.array
    bf16_values: mx.array
    order: mx.array

    def attend(self, queries, scale: float, mask):
        take = lambda x, rows: mx.take(x, rows, axis=0)
        own = scaled_dot_product_attention(
            take(queries, self.bf16_rows),
            self.bf16_keys,
            self.bf16_values,
            cache=None,
            scale=scale,
            mask=_mask_rows(mask, self.bf16_rows, self.bf16_keys.shape[2]),
        )
        if self.converted.size == 0:
            return own
        rows = self.converted
        keys = _taken(self.keys, rows)
        codes = scaled_dot_product_attention(
            take(queries, rows),
            keys,
            keys if self.values is self.keys else _taken(self.values, rows),
            cache=self.target,
            scale=scale,
            mask=_mask_rows(mask, rows),
        )
        return take(mx.concatenate([codes, own.astype(codes.dtype)]), self.order)


class Bf16FirstBatch(MlxLmRowSurgery):
    """``target`` (every row), ``pending`` (the conversion rule), ``bf16`` (a plain batch of
    the rows ``bf16_rows`` not converted yet, or None)."""

    def __init__(self, target, pending, bf16=None, bf16_rows=()):
        self.target = target
        self.pending = pending
        self.bf16 = bf16
        self.bf16_rows = np.asarray(bf16_rows, dtype=np.int64)
        if bf16 is not None:
            bf16.masks = target.masks

    @classmethod
    def merge(cls, target, pending, plains: dict) -> "Bf16FirstBatch":
        """From the target batch of every row and ``plains`` (row index -> its plain cache)."""
        rows = np.array(sorted(plains), dtype=np.int64)
        bf16 = merge_rows([plains[i] for i in rows]) if len(rows) else None
        return cls(target, pending, bf16, rows)

    # -- identity and position: the target's ----------------------------------------------
    @property
    def kind(self) -> str:
        return self.target.kind

    @property
    def masks(self):
        return self.target.masks

    @masks.setter
    def masks(self, value):
        self.target.masks = value
        if self.bf16 is not None:
            self.bf16.masks = value

    @property
    def offset(self) -> mx.array:
        return self.target.offset

    @property
    def offsets(self) -> np.ndarray:
        return self.target.offsets

    @property
    def batch_size(self) -> int:
        return self.target.batch_size

    @property
    def row_minimum_reusable_offsets(self) -> np.ndarray:
        return self.target.row_minimum_reusable_offsets

    @property
    def minimum_reusable_offset(self) -> int:
        return self.target.minimum_reusable_offset

    @property
    def keys(self):
        return self.target.keys

    @keys.setter
    def keys(self, shown):
        self.target.keys = shown

    @property
    def values(self):
        return self.target.values

    @values.setter
    def values(self, shown):
        self.target.values = shown

    @property
    def dtype(self):
        return self.target.dtype

    # mlx-lm takes its quantized SDPA (and so a PrecisionSplit's route) on hasattr(cache, "bits")
    @property
    def bits(self) -> int:
        return self.target.bits

    @property
    def group_size(self) -> int:
        return self.target.group_size

    # -- appends ----------------------------------------------------------------------------
    def prepare(self, *, lengths=None, right_padding=None, left_padding=None):
        self.target.prepare(lengths=lengths, right_padding=right_padding, left_padding=left_padding)
        if self.bf16 is not None and right_padding is not None and max(right_padding, default=0) > 0:
            pick = lambda x: np.asarray(x, dtype=np.int64).reshape(-1)[self.bf16_rows]
            self.bf16.prepare(lengths=pick(lengths), right_padding=pick(right_padding))

    def finalize(self):
        self.target.finalize()
        if self.bf16 is not None:
            self.bf16.finalize()

    def make_mask(self, *args, **kwargs):
        return self.target.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self.target.update_and_fetch(keys, values)
        if self.bf16 is None:
            return k, v
        sel = _i32(self.bf16_rows)
        bk, bv = self.bf16.update_and_fetch(mx.take(keys, sel, axis=0), mx.take(values, sel, axis=0))
        read = self._read(k, v, sel, bk, bv)
        self._convert_due_rows()
        return read

    def _read(self, k, v, sel, bk, bv):
        """What this append attends: one dense window when the target is attended densely,
        else the split."""
        if not hasattr(self.target, "bits"):
            return _overlaid(k, sel, bk), _overlaid(v, sel, bv)
        converted = np.setdiff1d(np.arange(self.batch_size), self.bf16_rows)
        order = np.argsort(np.concatenate([converted, self.bf16_rows]))
        split = PrecisionSplit(self.target, k, v, _i32(converted), sel, bk, bv, _i32(order))
        return split, split

    def _convert_due_rows(self):
        """Rows whose append reached their start convert: their target encoding is stored
        already, so they leave the plain batch and raise their reuse floor."""
        due = self.pending.due(self.offsets[self.bf16_rows])
        if not due.any():
            return
        floors = self.target.row_minimum_reusable_offsets.copy()
        leaving = self.bf16_rows[due]
        floors[leaving] = np.maximum(floors[leaving], self.pending.floor(self.offsets[leaving]))
        self.target.row_minimum_reusable_offsets = floors
        self._keep_bf16(~due)

    def _keep_bf16(self, stay: np.ndarray):
        """Keep the plain rows ``stay`` (a mask over ``bf16_rows``)."""
        if not stay.any():
            self.bf16, self.bf16_rows = None, self.bf16_rows[:0]
            return
        if not stay.all():
            self.bf16.filter_rows(np.nonzero(stay)[0])
            self.bf16_rows = self.bf16_rows[stay]

    # -- contract ---------------------------------------------------------------------------
    @property
    def state(self):
        return self.target.state, None if self.bf16 is None else self.bf16.state

    def size(self) -> int:
        return self.target.size()

    def empty(self) -> bool:
        return self.target.empty()

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (0 if self.bf16 is None else self.bf16.nbytes)

    def bytes_per_token(self) -> int:
        return self.target.bytes_per_token()

    def keys_and_values(self):
        return self.target.keys_and_values()

    def projected_bytes(self, rows=(), tokens: int = 0) -> int:
        """The target's projection plus the plain columns of every row (of these and of
        ``rows`` joining) that is still short of its start after ``tokens`` more."""
        total = self.target.projected_bytes(rows, tokens)
        per_column = self._bf16_column_bytes()
        if per_column is None:
            return total + self.nbytes - self.target.nbytes
        offsets = np.concatenate([self.offsets, np.asarray(rows, dtype=np.int64)]) + tokens
        short = offsets[~self.pending.due(offsets)]
        width = round_up(int(short.max(initial=0)) + 1, self.target.step)
        return total + len(short) * width * per_column

    def _bf16_column_bytes(self) -> int | None:
        """Bytes of one plain column of one row (None before the geometry is known)."""
        if self.bf16 is not None and self.bf16.key_arrays is not None:
            return self.bf16._column_bytes()
        t = self.target
        if t.key_arrays is None:
            return None
        H, d = t.key_arrays[0].shape[1], t.fmt.storage.head_dim(t.key_arrays)
        return 2 * H * d * (t.dtype or mx.bfloat16).size

    def is_trimmable(self) -> bool:
        return self.target.is_trimmable()

    def trim(self, n: int) -> int:
        n = self.target.trim(n)
        if self.bf16 is not None and n:
            self.bf16.trim(n)
        return n

    def trim_rows(self, counts) -> np.ndarray:
        counts = self.target.trim_rows(counts)  # checks every row first: nothing changes on a refusal
        if self.bf16 is not None and counts.any():
            self.bf16.trim_rows(counts[self.bf16_rows])
        return counts

    def dense_window(self):
        """Every row's stored columns decoded, the unconverted rows' bf16 ones in place."""
        stored = self.target.dense_window()
        own = None if self.bf16 is None else self.bf16.dense_window()
        if stored is None or own is None:
            return stored
        sel = _i32(self.bf16_rows)
        return _overlaid(stored[0], sel, own[0]), _overlaid(stored[1], sel, own[1])

    def read_block(self, keys: mx.array, values: mx.array):
        return block_read(self.target.cols, self.dense_window(), keys, values)

    # -- row surgery ------------------------------------------------------------------------
    def _parts(self, other):
        """(target, bf16, bf16_rows) of a batch joining this one: a bf16-first batch, or
        a batch of the target's layout (rows that are all in the target's storage)."""
        if isinstance(other, Bf16FirstBatch):
            mine, theirs = self.pending, other.pending
            if (mine.scheme, mine.start) != (theirs.scheme, theirs.start):
                raise CacheConfigError(
                    f"{self.kind}: rows converting to {theirs.scheme} at {theirs.start} cannot join rows "
                    f"converting to {mine.scheme} at {mine.start}"
                )
            return other.target, other.bf16, other.bf16_rows
        return other, None, np.zeros(0, dtype=np.int64)

    def extend_rows(self, other):
        """Join ``other``'s rows after ours (in place)."""
        target, bf16, rows = self._parts(other)
        if self.bf16 is not None and bf16 is not None:
            self.bf16._compatible(bf16)  # refuses before anything changes
        B = self.batch_size
        self.target.extend_rows(target)
        if bf16 is not None:
            if self.bf16 is None:
                self.bf16 = copy.deepcopy(bf16)  # owned: appends write the plain batch in place
                self.bf16.masks = self.target.masks
            else:
                self.bf16.extend_rows(bf16)
            self.bf16_rows = np.concatenate([self.bf16_rows, rows + B])
        return self

    def filter_rows(self, keep):
        """Keep rows ``keep`` (in that order), in both batches."""
        B = self.batch_size
        keep = np.array([check_row(int(i), B) for i in np.asarray(keep).reshape(-1)], dtype=np.int64)
        where = {int(r): j for j, r in enumerate(self.bf16_rows)}
        survivors = [(new, where[int(r)]) for new, r in enumerate(keep) if int(r) in where]
        self.target.filter_rows(keep)
        if survivors:
            self.bf16.filter_rows([j for _, j in survivors])
            self.bf16_rows = np.array([new for new, _ in survivors], dtype=np.int64)
        else:
            self.bf16, self.bf16_rows = None, self.bf16_rows[:0]
        return self

    def extract_row(self, i: int) -> Bf16FirstCache:
        """Row ``i`` as the ``Bf16FirstCache`` its serial twin is: holding its plain cache
        while short of its start, else its target storage."""
        i = check_row(i, self.batch_size)
        hit = np.nonzero(self.bf16_rows == i)[0]
        row = self.bf16.extract_row(int(hit[0])) if len(hit) else self.target.extract_row(i)
        row.minimum_reusable_offset = int(self.row_minimum_reusable_offsets[i])
        return Bf16FirstCache(self.pending, row)

    def __repr__(self):
        return f"Bf16FirstBatch(kind={self.kind!r}, rows={self.batch_size}, bf16 rows={self.bf16_rows.tolist()})"


def _overlaid(window: mx.array, rows: mx.array, own: mx.array) -> mx.array:
    """A dense window ``[B, H, W, D]`` with ``rows`` replaced on its last columns by ``own``
    ``[len(rows), H, W', D]``."""
    width = own.shape[2]
    window[rows, :, window.shape[2] - width :, :] = own.astype(window.dtype)
    return window
