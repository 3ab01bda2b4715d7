"""``QFiltersKVCache`` (``kv:qfilters:<budget>:<nSink>:<recent>``): projection eviction.

Every key is scored once, at insertion: ``sign * <key, filter>`` in float32 against a frozen
per-(batch, head) direction. When a block leaves more than ``budget`` rows stored, one top-k
keeps the ``budget`` highest scores with the first ``n_sink`` rows and the trailing
``recent`` rows forced in (ties to the lower index); survivors stay in temporal order.

Two filter sources:
- calibrated (``filters=``, from query SVD, see ``qfilters_calibration.py``): evicts from
  token 0; since scores never change and the forced rows only ever grow older, the kept set
  after any sequence of blocks equals one top-k over everything seen: prefill chunking does
  not change the kept rows, their scores or the offset.
- key-SVD fallback (no filters): nothing is evicted until ``calib_tokens`` keys were seen;
  then the filter is estimated from exactly the first ``calib_tokens`` keys (mean-centered,
  top right singular vector, oriented so the mean key projects non-negatively), frozen, and
  every stored row is scored. Estimating from exactly those keys (rather than from whatever
  block crossed the threshold) makes the fallback chunk-invariant as well.
"""

import hashlib

import mlx.core as mx
import numpy as np

from ..checks import is_int
from ..errors import CacheConfigError
from ..families import Scheme
from ..math.qfilters import freeze_due, key_svd_filter, projection_scores, qfilters_survivors, thaw_due
from ..math.selection import gather_rows
from . import names
from .base import row_bytes
from .eviction import EvictionKVCache, check_budget

DEFAULT_CALIB_TOKENS = 128


def _as_filter(filters, what: str) -> mx.array:
    f = mx.array(filters).astype(mx.float32)
    if f.ndim == 2:
        f = f[None]
    if f.ndim != 3 or f.shape[1] < 1 or f.shape[2] < 1:
        raise CacheConfigError(f"{what}: filters must be [H_kv, D] (or [B, H_kv, D]); got shape {list(f.shape)}")
    norms = mx.linalg.norm(f, axis=-1)
    if not bool(mx.all(mx.isfinite(f)).item()) or bool(mx.any(norms == 0).item()):
        raise CacheConfigError(f"{what}: filters must be finite, non-zero directions")
    return f


class QFiltersKVCache(EvictionKVCache):
    """Q-Filters-adapted projection eviction.

    ``filters``: calibrated per-head directions [H_kv, D] (from query SVD); None uses the
    key-SVD fallback, frozen after ``calib_tokens`` keys. ``sign`` (+1 or -1) multiplies every
    score. ``recent`` trailing rows and ``n_sink`` leading rows are never evicted.
    """

    kind_prefix = names.QFILTERS_KIND_PREFIX

    def __init__(
        self,
        budget: int = 512,
        n_sink: int = 4,
        recent: int = 0,
        sign: int = 1,
        calib_tokens: int = DEFAULT_CALIB_TOKENS,
        filters=None,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
    ):
        what = "Q-Filters"
        check_budget(budget, n_sink, what)
        if not is_int(recent) or recent < 0:
            raise CacheConfigError(f"{what}: recent must be an integer >= 0, got {recent!r}")
        if n_sink + recent >= budget:
            raise CacheConfigError(
                f"{what}: n_sink + recent = {n_sink + recent} must be below budget={budget}: "
                "no row would be left to rank by score"
            )
        if not is_int(sign) or sign not in (1, -1):
            raise CacheConfigError(f"{what}: sign must be +1 or -1, got {sign!r}")
        if not is_int(calib_tokens) or calib_tokens < 2:
            raise CacheConfigError(f"{what}: calib_tokens must be an integer >= 2, got {calib_tokens!r}")
        super().__init__(budget, n_sink)
        self.recent, self.sign, self.calib_tokens = recent, sign, calib_tokens
        self.scores = None
        self.filter = None if filters is None else _as_filter(filters, what)
        self.calibrated = filters is not None
        if self.filter is not None:
            for name, want, got in (
                ("kv heads", n_kv_heads, self.filter.shape[1]),
                ("head_dim", head_dim, self.filter.shape[2]),
            ):
                if want is not None and want != got:
                    raise CacheConfigError(f"{what}: the filters have {got} {name}, the layer has {want}")

    @property
    def kind(self) -> str:
        return f"{self.kind_prefix}{self.budget}:{self.n_sink}:{self.recent}"

    @property
    def frozen(self) -> bool:
        """A filter is in force (calibrated, or the fallback has frozen its estimate)."""
        return self.filter is not None

    def _check_incoming(self, keys, values):
        super()._check_incoming(keys, values)
        f = self.filter
        if f is not None and (
            f.shape[1] != keys.shape[1] or f.shape[2] != keys.shape[3] or f.shape[0] not in (1, keys.shape[0])
        ):
            raise CacheConfigError(
                f"{self.kind}: filters of shape {list(f.shape)} do not match this layer's keys "
                f"[B={keys.shape[0]}, H={keys.shape[1]}, D={keys.shape[3]}]: wrong model or layer"
            )

    def _admit(self, keys, values, positions, n_new: int):
        B, H, R, _ = keys.shape
        if self.filter is not None:
            new = projection_scores(keys[:, :, R - n_new :, :], self.filter, self.sign)
            scores = new if self.scores is None else mx.concatenate([self.scores, new], axis=2)
        else:
            scores = mx.zeros((B, H, R), mx.float32)
            if freeze_due(False, self.offset, self.calib_tokens):  # nothing evicted: rows == positions
                self.filter = key_svd_filter(keys[:, :, : self.calib_tokens, :])
                scores = projection_scores(keys, self.filter, self.sign)
        if self.filter is not None and self.budget < R:
            idx = qfilters_survivors(scores, self.budget, self.n_sink, self.recent)
            keys, values, positions, scores = (gather_rows(a, idx) for a in (keys, values, positions, scores))
        self.keys, self.values, self.positions, self.scores = keys, values, positions, scores

    def _trim_rows(self, keep: int):
        super()._trim_rows(keep)
        self.scores = None if keep == 0 else self.scores[..., :keep]

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if n and thaw_due(self.filter is not None, self.calibrated, self.offset, self.calib_tokens):
            self.filter = None
            if self.scores is not None:
                self.scores = mx.zeros_like(self.scores)
        return n

    @property
    def state(self):
        return () if self.keys is None else (self.keys, self.values, self.positions, self.scores)

    @state.setter
    def state(self, v):
        self.keys, self.values, self.positions, self.scores = v

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state) + (0 if self.filter is None else self.filter.nbytes)

    def bytes_per_token(self) -> int:
        """Bytes one stored row costs one batch row (keys, values, position, score)."""
        return 0 if self.keys is None else row_bytes(self.keys, self.values, self.positions, self.scores)

    def batch_filter(self) -> mx.array | None:
        """The filter in force as [B, H, D] (a calibrated [1, H, D] broadcast over B)."""
        if self.filter is None or self.keys is None:
            return self.filter
        return mx.broadcast_to(self.filter, (self.keys.shape[0], *self.filter.shape[1:]))

    def adopt(self, keys, values, positions, scores, offset: int, filter=None, calibrated: bool = False):
        """Restore exactly: kept rows, their insertion scores and the filter in force."""
        self._adopt_rows(keys, values, positions, offset)
        if scores.shape != keys.shape[:3]:
            raise CacheConfigError(f"{self.kind}: scores {list(scores.shape)} do not match keys {list(keys.shape)}")
        self.scores = scores.astype(mx.float32)
        self.filter = None if filter is None else filter.astype(mx.float32)
        self.calibrated = bool(calibrated) and filter is not None
        return self

    def __repr__(self):
        source = "calibrated" if self.calibrated else ("frozen" if self.frozen else "warming up")
        return f"QFiltersKVCache(kind={self.kind!r}, offset={self.offset}, rows={self.rows}, filter={source})"


def _layer_filters(options: dict, layer: int):
    """The calibrated filter of ``layer`` from ``qfilters_calibration=`` or ``filters=``."""
    cal = options.get("qfilters_calibration")
    filters = cal.filters if cal is not None else options.get("filters")
    if filters is None:
        return None
    if isinstance(filters, mx.array) and filters.ndim == 2:  # one filter for every layer
        return filters
    if layer >= len(filters) or filters[layer] is None:
        raise CacheConfigError(
            f"Q-Filters: the calibration has no filter for layer {layer} ({len(filters)} layers "
            "given): it was made for another model; recalibrate or load it with model=..."
        )
    return filters[layer]


#: the make_cache options a Q-Filters scheme reads
OPTIONS = ("qfilters_calibration", "filters", "sign", "calib_tokens")


def qfilters_scheme(m, options):
    """``qfilters-b<budget>-s<nSink>-r<recent>``; options ``qfilters_calibration=`` (a
    ``QFiltersCalibration``) or ``filters=`` (per-layer [H_kv, D]), ``sign=``, ``calib_tokens=``."""
    budget, n_sink, recent = int(m["budget"]), int(m["sink"]), int(m["recent"])
    sign = options.get("sign", 1)
    calib = options.get("calib_tokens", DEFAULT_CALIB_TOKENS)
    QFiltersKVCache(budget, n_sink, recent, sign, calib)  # validate now, not at the first layer

    def build(i, o):
        return QFiltersKVCache(
            budget,
            n_sink,
            recent,
            sign,
            calib,
            filters=_layer_filters(o, i),
            n_kv_heads=o.get("n_kv_heads"),
            head_dim=o.get("head_dim"),
        )

    return Scheme(
        f"qfilters-b{budget}-s{n_sink}-r{recent}", build, False, held=_held(options, sign, calib), options=OPTIONS
    )


def _held(options: dict, sign, calib) -> dict:
    """What the options decide of the kept rows: the sign, and the calibrated filters (by a
    digest of their values) or, without them, the keys the fallback estimates from."""
    cal = options.get("qfilters_calibration")
    filters = cal.filters if cal is not None else options.get("filters")
    if filters is None:
        return {"calib_tokens": calib, "sign": sign}
    digest = hashlib.sha256()
    for f in [filters] if isinstance(filters, mx.array) else filters:
        a = None if f is None else np.array(mx.array(f).astype(mx.float32))
        digest.update(b"-" if a is None else repr(a.shape).encode() + a.tobytes())
    return {"filters": digest.hexdigest()[:16], "sign": sign}
