"""Q-Filters' math: filters from an SVD, projection scores and the top-k keep rule, and the
rules of when the key-SVD fallback freezes and thaws.

A score is ``sign * <key, filter>`` in float32, computed once per key. When over budget the
``budget`` highest scores are kept with the first ``n_sink`` and the trailing ``recent`` rows
forced in (ties to the lower index), survivors in temporal order.
"""

import mlx.core as mx
import numpy as np

from .selection import drop_one


def top_right_singular_vectors(x: mx.array) -> mx.array:
    """v1 of every matrix [..., N, D] -> [..., D] (float32, unit norm, sign as LAPACK gives).

    A tall matrix is first reduced by QR (X = QR, X and R share their right singular
    vectors) so the SVD never builds an N x N U."""
    x = x.astype(mx.float32)
    if x.shape[-2] > x.shape[-1]:
        _, x = mx.linalg.qr(x, stream=mx.cpu)
    _, _, vt = mx.linalg.svd(x, stream=mx.cpu)
    return vt[..., 0, :]


def key_svd_filter(keys: mx.array) -> mx.array:
    """The fallback filter of keys [B, H, C, D] -> float32 [B, H, D], unit norm.

    Mean-centered on purpose (the documented fallback, not the paper's estimator): it finds
    the axis of largest key variance, whose sign a key alone cannot tell; we orient it so the
    mean key has a non-negative projection (largest-magnitude component positive on a tie),
    and ``sign=-1`` is the ablation of that choice."""
    k = keys.astype(mx.float32)
    mean = mx.mean(k, axis=2)
    v = top_right_singular_vectors(k - mean[:, :, None, :])
    proj = mx.sum(mean * v, axis=-1, keepdims=True)
    biggest = mx.take_along_axis(v, mx.argmax(mx.abs(v), axis=-1, keepdims=True), axis=-1)
    flip = mx.where(proj != 0, mx.sign(proj), mx.where(biggest < 0, -1.0, 1.0))
    return v * flip


def projection_scores(keys: mx.array, filt: mx.array, sign: int) -> mx.array:
    """``sign * <key, filter>`` in float32: keys [B, H, N, D], filter [B or 1, H, D] -> [B, H, N].

    An elementwise product summed over D (not a matmul), so a row's score does not depend on
    how many rows were scored with it: chunked and one-shot prefill store the same bits."""
    return sign * mx.sum(keys.astype(mx.float32) * filt[:, :, None, :], axis=-1)


def descending_order_key(scores: mx.array) -> mx.array:
    """int64 keys sorting rows by descending score, then ascending index: all distinct, so any
    sort or partition gives the one documented order (ties to the lower index)."""
    R = scores.shape[-1]
    bits = (scores + 0.0).view(mx.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)  # monotone in the float
    return (-ordered) * (1 << 31) + mx.arange(R, dtype=mx.int64)  # rows < 2**31


def qfilters_survivors(scores: mx.array, budget: int, n_sink: int, recent: int) -> mx.array:
    """Kept row indices, ascending, int32 [B, H, budget], of rows scored [B, H, R > budget]."""
    R = scores.shape[-1]
    rows = mx.arange(R)
    forced = (rows < n_sink) | (rows >= R - recent)
    priority = mx.where(forced, mx.inf, scores)
    if budget + 1 == R:  # a decode step: the lowest priority goes, the highest index on a tie
        return drop_one(priority, lowest_index=False)
    key = descending_order_key(priority)
    best = mx.argpartition(key, kth=budget - 1, axis=-1)[..., :budget]
    return mx.sort(best.astype(mx.int32), axis=-1)


def freeze_due(frozen, offset, calib_tokens):
    """The key-SVD fallback freezes its filter once ``calib_tokens`` keys were seen (nothing
    is evicted before, so those keys are positions ``0 .. calib_tokens - 1``). Scalars or
    per-row numpy arrays."""
    return np.logical_and(np.logical_not(frozen), np.asarray(offset) >= calib_tokens)


def thaw_due(frozen, calibrated, offset, calib_tokens):
    """A fallback filter whose keys were trimmed away unfreezes, as if never seen; a
    calibrated filter never does. Scalars or per-row numpy arrays."""
    return np.logical_and(np.logical_and(frozen, np.logical_not(calibrated)), np.asarray(offset) < calib_tokens)
