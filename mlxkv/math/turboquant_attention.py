"""Attention straight from TurboQuant codes: no decoded window, no inverse transform per row.

Scores. A key group decodes as ``(idx + zero) * scale``, an affine code: ``scale * u + bias``
with ``u`` the unsigned code and ``bias = scale * zero`` (at 8 bits the signed code shifted
by 128: ``u = idx + 128``, ``bias = scale * (zero - 128)``). Packed TurboQuant keys at 2, 4
and 5 bits are exactly mlx's affine layout (a little-endian bitstream, read as uint32
words), so ``mx.quantized_matmul`` scores the queries against the codes directly, group by
group; 8-bit keys only flip their sign bit.

Values. The codes live in the rotated domain, and attention is linear in the values, so the
output is attended there and un-rotated once (the deferred rotation). Rotated values are
``centroid[idx] * scale`` per 32-group: the codebook is read a packed byte (or a 10- or 12-bit
chunk) at a time from a table of the centroids it encodes, scaled per group, and multiplied
by the probabilities; the inverse Hadamard runs on the ``[L, D]`` output, not on ``T`` rows.

Everything is float32. Against the exact read (decode to the input dtype, then SDPA) the
result differs by float summation order in float32 inputs and by the exact read's rounding of
the decoded window in bfloat16 inputs; docs/turboquant.md gives the measured tolerance.
"""

from functools import cache, partial

import mlx.core as mx
import numpy as np

from . import turboquant as tq

#: bits of stream read per table lookup, and codes per lookup
_CHUNK = {2: 8, 3: 12, 4: 8, 5: 10, 8: 8}


@cache
def centroid_table(v_bits: int) -> mx.array:
    """float32 ``[2**chunk, codes]``: the centroids one chunk of packed value codes encodes."""
    chunk = _CHUNK[v_bits]
    per = chunk // v_bits
    cents = np.asarray(tq.codebook().centroids[v_bits].tolist(), np.float32)
    fields = np.arange(1 << chunk)[:, None] >> (np.arange(per) * v_bits)
    return mx.array(cents[fields & ((1 << v_bits) - 1)])


@cache
def _chunk_fields(v_bits: int):
    """One fused kernel (``mx.compile``, shapeless: traced once for every window length) that
    cuts blocks of ``v_bits`` bytes (8 codes) given as byte columns ``[..., blocks, 1]`` into
    their chunks ``[..., blocks, 8*v_bits/chunk]`` (uint16)."""
    chunk = _CHUNK[v_bits]
    word = mx.uint64 if v_bits == 5 else mx.uint32
    mask = (1 << chunk) - 1

    @partial(mx.compile, shapeless=True)
    def fields(*columns):
        stream = columns[0].astype(word)
        for i, byte in enumerate(columns[1:], 1):
            stream = stream | (byte.astype(word) << (8 * i))
        return mx.concatenate(
            [((stream >> shift) & mask).astype(mx.uint16) for shift in range(0, 8 * v_bits, chunk)], axis=-1
        )

    return fields


def _chunks(packed: mx.array, v_bits: int) -> mx.array:
    """Packed value codes ``[..., D*b/8]`` -> table indices ``[..., D/per]``."""
    if _CHUNK[v_bits] == 8:
        return packed
    *lead, width = packed.shape
    blocks = packed.reshape(*lead, width // v_bits, v_bits)  # 8 codes per block
    columns = (blocks[..., i : i + 1] for i in range(v_bits))
    fields = _chunk_fields(v_bits)(*columns)  # [..., blocks, chunks per block]
    return fields.reshape(*lead, fields.shape[-2] * fields.shape[-1])  # no -1: a window may be empty


def rotated_values(v_packed: mx.array, v_scales: mx.array, v_bits: int) -> mx.array:
    """float32 ``[..., T, D]``: ``centroid[idx] * scale``, the values in the rotated domain."""
    *lead, width = v_packed.shape
    groups = v_scales.shape[-1]
    c = mx.take(centroid_table(v_bits), _chunks(v_packed, v_bits), axis=0)
    c = c.reshape(*lead, groups, tq.GROUP) * v_scales.astype(mx.float32)[..., None]
    return c.reshape(*lead, groups * tq.GROUP)


#: bytes one block of value rows may take in float32 temporaries (weighted_values)
_BLOCK_BYTES = 4 << 20
_BLOCK_MIN_ROWS = 64


def _group_product(p: mx.array, v_packed: mx.array, v_scales: mx.array, v_bits: int) -> mx.array:
    """``p @ rotated_values(...)`` over one block of rows, as ``[B, H, G, M, 32]``."""
    B, H, T, width = v_packed.shape
    G = v_scales.shape[-1]
    by_group = v_packed.reshape(B, H, T, G, width // G).transpose(0, 1, 3, 2, 4)
    c = mx.take(centroid_table(v_bits), _chunks(by_group, v_bits), axis=0).reshape(B, H, G, T, tq.GROUP)
    weights = p[:, :, None] * v_scales.astype(mx.float32).transpose(0, 1, 3, 2)[:, :, :, None, :]
    return weights @ c


def weighted_values(p: mx.array, v_packed: mx.array, v_scales: mx.array, v_bits: int) -> mx.array:
    """``p @ rotated_values(...)`` without a pass over the scaled window: ``p`` ``[B, H, M, T]``
    is weighted by each group's scale (``[B, H, G, M, T]``, small) and multiplied by the
    group's centroids ``[B, H, G, T, 32]``, read from the codes in group-major order.

    The rows are taken in blocks whose centroids and weights fill at most ``_BLOCK_BYTES``,
    the partial products summed: one temporary for the whole window (64 MiB of centroids at
    8 heads and 16k rows) is above malloc's mmap threshold (32 MiB at most), comes fresh from
    the kernel on every step and pays a page fault per 4 KiB (a quarter of the step there,
    docs/turboquant.md); a small block's memory is reused, warm."""
    B, H, T, width = v_packed.shape
    G, M = v_scales.shape[-1], p.shape[2]
    rows = max(_BLOCK_MIN_ROWS, _BLOCK_BYTES // max(1, B * H * G * (tq.GROUP + M) * 4))  # B=0: no rows
    out = None
    for a in range(0, max(T, 1), rows):  # an empty window: one empty block
        part = _group_product(p[..., a : a + rows], v_packed[:, :, a : a + rows], v_scales[:, :, a : a + rows], v_bits)
        out = part if out is None else out + part
    return out.transpose(0, 1, 3, 2, 4).reshape(B, H, p.shape[2], G * tq.GROUP)


def key_scores(queries: mx.array, k_idx, k_scales, k_zeros, k_bits: int) -> mx.array:
    """``queries @ keys^T`` from the key codes: queries ``[..., L, D]`` (float32) against
    stored keys ``[..., T, width]`` -> ``[..., L, T]``."""
    scales = k_scales.astype(mx.float32)
    zeros = k_zeros.astype(mx.float32)
    if k_bits == 8:
        codes = mx.view(k_idx, mx.uint8) ^ 0x80  # signed -> offset binary
        zeros = zeros - 128.0
    else:
        codes = k_idx
    w = mx.view(codes, mx.uint32)
    return mx.quantized_matmul(queries, w, scales, scales * zeros, transpose=True, group_size=tq.GROUP, bits=k_bits)


def _apply_mask(scores: mx.array, mask) -> mx.array:
    """mlx-lm's mask forms on scores ``[B, H, R, L, T]``: None, ``"causal"`` (bottom right),
    a boolean or additive array ``[..., L, T]`` (a 4-d one per kv head or broadcast)."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        L, T = scores.shape[-2:]
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask.ndim == 4:  # [B, H_kv or 1, L, T] -> the repeat axis
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask.astype(scores.dtype)


def attend(queries: mx.array, stored, k_bits: int, v_bits: int, scale: float, mask=None) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, L, D]`` over the five stored arrays ``[B, Hkv, T, *]``
    (``Hq`` a multiple of ``Hkv``), in float32; returns ``[B, Hq, L, D]`` in the queries' dtype.
    The query heads sharing a kv head are rows of one product (``M = Hq/Hkv * L``), so each
    kv head's codes are read once."""
    k_idx, k_scales, k_zeros, v_packed, v_scales = stored
    B, Hq, L, D = queries.shape
    H = k_idx.shape[1]
    M = Hq // H * L
    q = (queries.astype(mx.float32) * scale).reshape(B, H, M, D)
    scores = key_scores(q, k_idx, k_scales, k_zeros, k_bits)
    T = scores.shape[-1]
    scores = _apply_mask(scores.reshape(B, H, Hq // H, L, T), mask).reshape(B, H, M, T)
    p = mx.softmax(scores, axis=-1, precise=True)
    out = weighted_values(p, v_packed, v_scales, v_bits)
    return tq.unrotate(out.reshape(B, Hq, L, D)).astype(queries.dtype)
