"""Q-Filters calibration: per-head filters from the SVD of query activations (paper Eq. 1).

1. ``collect_query_activations(model, token_batches)`` runs the model (no cache, so every
   batch sits at positions 0..L-1) and records, per layer, the queries exactly as attention
   sees them: after the projection, any query norm and RoPE -> float32 [H_q, N, D] (None for
   layers without attention). Post-RoPE is deliberate: the cache stores post-RoPE keys, and
   ``<q, k>`` after RoPE is the attention logit the filter must predict.
2. ``compute_qfilters(acts)`` per query head: deterministic subsample, *uncentered* SVD, the
   top right singular vector v1, signed by the sum of the first left singular vector
   (``sgn(1^T u1)``, computed as ``sgn(sum(X v1))`` since ``u1 = X v1 / s1``).
3. ``average_gqa_filters(filters, n_kv_heads)`` averages each group of query heads onto its
   kv head (mlx-lm's grouping: query head h reads kv head h // (H_q / H_kv)) and renormalizes.

``calibrate(model, token_batches, model_id=...)`` runs the three steps for every layer and
returns a :class:`QFiltersCalibration`; ``mlxkv.formats.qfilters_artifact`` saves and loads it.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..errors import CacheConfigError, MLXKVError
from ..math.qfilters import top_right_singular_vectors

CALIBRATION_VERSION = 1
DEFAULT_MAX_SAMPLES = 3000  # paper section 4.2: 3k SVD samples per head


@dataclass
class QFiltersCalibration:
    """Per-layer filters ([H_kv, D] float32, None for layers without attention)."""

    filters: list[mx.array | None]
    model_id: str
    n_samples: int
    dataset: str = ""
    version: int = CALIBRATION_VERSION
    meta: dict = field(default_factory=dict)


class _QueryTap(nn.Module):
    """Stands in for an attention module's ``rope``: mlx-lm attention rotates the queries,
    then the keys, through the same module; the tap keeps the first call of each pair."""

    def __init__(self, rope, n_heads: int | None):
        super().__init__()
        self.inner = rope
        self.n_heads = n_heads
        self.calls = 0
        object.__setattr__(self, "queries", [])  # a plain list, not a child of the module tree

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        if self.calls % 2 == 0:
            if self.n_heads is not None and x.shape[1] != self.n_heads:
                raise MLXKVError(
                    f"query tap: expected queries with {self.n_heads} heads, got shape {list(x.shape)}; "
                    "this attention does not rotate queries before keys"
                )
            B, H, L, D = out.shape
            self.queries.append(out.astype(mx.float32).transpose(1, 0, 2, 3).reshape(H, B * L, D))
        self.calls += 1
        return out


def _attention_of(layer):
    attn = getattr(layer, "self_attn", None)
    return attn if attn is not None and hasattr(attn, "rope") else None


def collect_query_activations(model, token_batches: Iterable) -> list[mx.array | None]:
    """Post-RoPE queries per layer, float32 [H_q, N, D] (N = all tokens of all batches);
    None for layers without attention (recurrent/convolution layers)."""
    layers = model.layers
    attns = [_attention_of(layer) for layer in layers]
    if not any(a is not None for a in attns):
        raise MLXKVError("collect_query_activations: the model has no attention layer with a `rope` to tap")
    taps = {}
    try:
        for i, a in enumerate(attns):
            if a is not None:
                taps[i] = _QueryTap(a.rope, getattr(a, "n_heads", None))
                a.rope = taps[i]
        for batch in token_batches:
            tokens = batch if isinstance(batch, mx.array) else mx.array(batch)
            if tokens.ndim == 1:
                tokens = tokens[None]
            model(tokens)
            for tap in taps.values():
                mx.eval(tap.queries)
    finally:
        for i, tap in taps.items():
            attns[i].rope = tap.inner
    out: list[mx.array | None] = []
    for i in range(len(layers)):
        tap = taps.get(i)
        out.append(None if tap is None or not tap.queries else mx.concatenate(tap.queries, axis=1))
    return out


def compute_qfilters(acts: mx.array, max_samples: int = DEFAULT_MAX_SAMPLES, seed: int = 0) -> mx.array:
    """Filters [H, D] (float32, unit norm) from query activations [H, N, D].

    Uncentered on purpose: the signal is the query cloud's drift away from the origin, which
    centering would subtract. With N > ``max_samples`` the same ``max_samples`` rows (chosen
    by ``seed``, in their original order) are used for every head."""
    if acts.ndim != 3 or acts.shape[1] < 1:
        raise CacheConfigError(f"compute_qfilters: activations must be [H, N, D] with N >= 1, got {list(acts.shape)}")
    x = acts.astype(mx.float32)
    N = x.shape[1]
    if max_samples is not None and max_samples < N:
        pick = mx.sort(mx.random.permutation(N, key=mx.random.key(seed))[:max_samples])
        x = mx.take(x, pick, axis=1)
    v1 = top_right_singular_vectors(x)  # [H, D]
    drift = mx.sum(x @ v1[..., None], axis=(1, 2))  # sum(X v1) = s1 * sum(u1)
    return v1 * mx.where(drift < 0, -1.0, 1.0)[:, None]


def average_gqa_filters(filters: mx.array, n_kv_heads: int) -> mx.array:
    """[H_q, D] -> [H_kv, D]: each kv head gets the renormalized mean of its query heads."""
    H, D = filters.shape
    if n_kv_heads < 1 or H % n_kv_heads:
        raise CacheConfigError(f"average_gqa_filters: {H} query heads do not split into {n_kv_heads} kv heads")
    mean = mx.mean(filters.astype(mx.float32).reshape(n_kv_heads, H // n_kv_heads, D), axis=1)
    norm = mx.linalg.norm(mean, axis=-1, keepdims=True)
    if bool(mx.any(norm == 0).item()):
        raise CacheConfigError("average_gqa_filters: a group of query filters cancels out to zero")
    return mean / norm


def _kv_heads(model, layer_idx: int, fallback: int) -> int:
    attn = _attention_of(model.layers[layer_idx])
    return getattr(attn, "n_kv_heads", None) or fallback


def calibrate(
    model,
    token_batches: Iterable,
    *,
    model_id: str,
    dataset: str = "",
    max_samples: int = DEFAULT_MAX_SAMPLES,
    seed: int = 0,
) -> QFiltersCalibration:
    """Collect, compute and GQA-average the filters of every attention layer."""
    acts = collect_query_activations(model, token_batches)
    filters, n = [], 0
    for i, a in enumerate(acts):
        if a is None:
            filters.append(None)
            continue
        n = max(n, min(a.shape[1], max_samples or a.shape[1]))
        q = compute_qfilters(a, max_samples=max_samples, seed=seed)
        filters.append(average_gqa_filters(q, _kv_heads(model, i, q.shape[0])))
    mx.eval([f for f in filters if f is not None])
    return QFiltersCalibration(filters, model_id=model_id, n_samples=n, dataset=dataset)
