"""TurboQuant encode and decode: bit-compatible with the vLLM-Metal reference (docs/turboquant.md).

Pure array math, no cache and no file. Group size 32 along head_dim; inputs of any float
dtype are computed in float32.

Keys (no rotation), per 32-group min/max affine:

- kBits 8, signed int8: ``scale = (max-min)/254``, ``zero = round((max+min)/(2(scale+1e-8)))``,
  ``idx = clip(round(x/(scale+1e-8) - zero), -127, 127)``;
- kBits < 8, unsigned: ``scale = (max-min)/(2^b-1)``, ``zero = round(min/(scale+1e-8))``,
  ``idx = clip(round(x/(scale+1e-8) - zero), 0, 2^b-1)``, bit-packed;
- scale and zero are stored as float16 (the codes use the float32 scale); decode is
  ``(idx + zero) * scale`` in float32.

A key group whose ``|min| / (scale + 1e-8)`` exceeds float16's largest finite value (65504)
stores an infinite zero point and decodes to NaN: every constant group ``c`` with
``|c| > 65504e-8`` does (scale 0, ``zero = round(c/1e-8)``). The reference does this and
parity keeps those bytes.

Values: times the fixed sign vector, orthonormal Hadamard transform (MLX's
``hadamard_transform``), per 32-group RMS scale ``sqrt(mean(y**2))`` (float16 stored),
``index = number of Lloyd-Max boundaries strictly below y/(scale+1e-8)``, bit-packed.
Decode: ``centroid[index] * scale`` (the *rotated* domain), then the inverse transform
(Hadamard, then the signs). ``y**2`` is MLX's ``power``, as in the reference; on the CPU
backend that is the C library's ``powf``, which is not always the exactly rounded square.

The Lloyd-Max tables and sign vectors are the embedded ``turboquant_constants.json``
(exact float32, checked against the sha256 prefixes it lists when loaded).
"""

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from ..checks import is_int
from ..errors import CacheConfigError, MLXKVError
from . import bitpack

GROUP = 32
EPS = 1e-8
K_BITS = (2, 4, 5, 8)
V_BITS = (2, 3, 4, 5, 8)
HEAD_DIMS = (64, 128, 256, 512)
CONSTANTS_FILE = Path(__file__).with_name("turboquant_constants.json")


# -- configuration ------------------------------------------------------------------------


def check_bits(k_bits, v_bits) -> None:
    if not is_int(k_bits) or k_bits not in K_BITS:
        raise CacheConfigError(f"TurboQuant kBits must be one of {K_BITS}, got {k_bits!r}")
    if not is_int(v_bits) or v_bits not in V_BITS:
        raise CacheConfigError(f"TurboQuant vBits must be one of {V_BITS}, got {v_bits!r}")


def check_head_dim(head_dim) -> None:
    if not is_int(head_dim) or head_dim not in HEAD_DIMS:
        raise CacheConfigError(
            f"TurboQuant supports head_dim in {HEAD_DIMS} (the FWHT sign tables), got {head_dim!r}: "
            "use an affine scheme whose group divides the head dim (kv4-g32, kv8-g32) or bf16 for this model"
        )


def key_width(head_dim: int, k_bits: int) -> int:
    """Bytes (int8 elements at 8 bits) one head's key codes take."""
    return head_dim if k_bits == 8 else head_dim * k_bits // 8


def value_width(head_dim: int, v_bits: int) -> int:
    return head_dim * v_bits // 8


def bytes_per_head(head_dim: int, k_bits: int, v_bits: int) -> int:
    """Stored bytes per token and kv head: codes plus three float16 per 32-group."""
    return key_width(head_dim, k_bits) + value_width(head_dim, v_bits) + 3 * (head_dim // GROUP) * 2


# -- constants ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Codebook:
    centroids: dict[int, mx.array]  # bits -> float32 [2^bits]
    boundaries: dict[int, mx.array]  # bits -> float32 [2^bits - 1], strictly increasing
    boundary_values: dict[int, tuple[float, ...]]  # the same, as exact Python floats
    signs: dict[int, mx.array]  # head_dim -> float32 [head_dim] of +1/-1


def _f32_digest(values) -> str:
    import numpy as np  # the codebook's checks only: decoding a header needs no numpy

    return hashlib.sha256(np.asarray(values, dtype="<f4").tobytes()).hexdigest()


def sign_bits(hex_digits: str):
    """Sign bits from the constants' hex (4 elements per digit, most significant bit first),
    a numpy int32 array."""
    import numpy as np

    return np.array([(int(c, 16) >> s) & 1 for c in hex_digits for s in (3, 2, 1, 0)], np.int32)


@lru_cache(maxsize=1)
def codebook() -> Codebook:
    """The embedded constants, verified against the sha256 prefixes the file lists."""
    import numpy as np

    raw = json.loads(CONSTANTS_FILE.read_text())
    cents, bounds, signs = {}, {}, {}
    for bits in V_BITS:
        table = raw["lloyd_max"][str(bits)]
        for name, out in (("centroids", cents), ("boundaries", bounds)):
            want = raw["lloyd_max_sha256_prefix_f32le"][str(bits)][name]
            if not _f32_digest(table[name]).startswith(want):
                raise MLXKVError(
                    f"{CONSTANTS_FILE}: the {bits}-bit Lloyd-Max {name} do not match their "
                    "sha256 prefix: the installed constants are damaged; reinstall mlxkv"
                )
            out[bits] = mx.array(np.asarray(table[name], np.float32))
    for dim in HEAD_DIMS:
        bits01 = sign_bits(raw["fwht_signs_hex"][str(dim)])
        if bits01.size != dim:
            raise MLXKVError(f"{CONSTANTS_FILE}: the sign vector for head_dim {dim} has {bits01.size} bits")
        signs[dim] = mx.array((1 - 2 * bits01).astype(np.float32))
    values = {bits: tuple(b.tolist()) for bits, b in bounds.items()}
    return Codebook(cents, bounds, values, signs)


# -- keys -------------------------------------------------------------------------------


def _groups(x: mx.array) -> mx.array:
    """``x`` as groups of ``GROUP`` along its head dim, which every encode and decode goes
    through: a head dim without sign tables is refused here, for serial caches and batched
    rows alike, before anything is reshaped or stored."""
    *lead, d = x.shape
    check_head_dim(d)
    return x.astype(mx.float32).reshape(*lead, d // GROUP, GROUP)


def encode_keys(keys: mx.array, k_bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Per-element key codes (int8 at 8 bits, else uint8), float16 scales and zero points."""
    shape = keys.shape
    x = _groups(keys)
    lo = mx.min(x, axis=-1, keepdims=True)
    hi = mx.max(x, axis=-1, keepdims=True)
    if k_bits == 8:
        scale = (hi - lo) / 254.0
        zero = mx.round((hi + lo) / (2.0 * (scale + EPS)))
        idx = mx.clip(mx.round(x / (scale + EPS) - zero), -127, 127).astype(mx.int8)
    else:
        top = (1 << k_bits) - 1
        scale = (hi - lo) / float(top)
        zero = mx.round(lo / (scale + EPS))
        idx = mx.clip(mx.round(x / (scale + EPS) - zero), 0, top).astype(mx.uint8)
    return (
        idx.reshape(shape),
        scale.squeeze(-1).astype(mx.float16),
        zero.squeeze(-1).astype(mx.float16),
    )


def decode_keys(idx: mx.array, scales: mx.array, zeros: mx.array) -> mx.array:
    """``(idx + zero) * scale`` in float32, from per-element codes."""
    shape = idx.shape
    q = _groups(idx)
    return ((q + zeros[..., None]) * scales[..., None]).reshape(shape)


def pack_keys(idx: mx.array, k_bits: int) -> mx.array:
    return idx if k_bits == 8 else bitpack.pack(idx, k_bits)


def unpack_keys(stored: mx.array, k_bits: int, head_dim: int) -> mx.array:
    return stored if k_bits == 8 else bitpack.unpack(stored, k_bits, head_dim)


# -- values -----------------------------------------------------------------------------


def rotate(x: mx.array) -> mx.array:
    """Into the value domain the codes live in: signs, then the orthonormal Hadamard."""
    x = x.astype(mx.float32)
    return mx.hadamard_transform(x * codebook().signs[x.shape[-1]])


def unrotate(y: mx.array) -> mx.array:
    """Inverse of :func:`rotate` (float32): Hadamard, then the signs."""
    y = y.astype(mx.float32)
    return mx.hadamard_transform(y) * codebook().signs[y.shape[-1]]


def count_below(y: mx.array, boundaries) -> mx.array:
    """Number of ``boundaries`` (an array or a sequence of float32 values) strictly below
    ``y``, as uint8; NaN counts 0, as in the reference's ``(y[..., None] > b).sum(-1)``.

    One comparison per boundary against its exact float32 value, accumulated: no gather and
    no ``[..., 2^b - 1]`` intermediate.
    """
    values = boundaries.tolist() if isinstance(boundaries, mx.array) else boundaries
    count = (y > values[0]).astype(mx.uint8)
    for b in values[1:]:
        count = count + (y > b)
    return count


def count_below_stacked(y: mx.array, boundaries: mx.array) -> mx.array:
    """:func:`count_below` as one comparison against all boundaries and a sum, through a
    ``[..., 2^b - 1]`` intermediate: the same counts. Meant for a few positions inside a
    compiled graph, where the accumulated form would fuse into one kernel of ``2^b - 1``
    comparisons that takes the CPU backend's compiler minutes to build at 8 bits."""
    return mx.sum(y[..., None] > boundaries, axis=-1).astype(mx.uint8)


def encode_values_rotated(y: mx.array, v_bits: int, stacked: bool = False) -> tuple[mx.array, mx.array]:
    """Codes (uint8 per element) and float16 RMS scales of already rotated values."""
    shape = y.shape
    g = _groups(y)
    scale = mx.sqrt(mx.mean(g**2, axis=-1, keepdims=True))
    if stacked:
        idx = count_below_stacked(g / (scale + EPS), codebook().boundaries[v_bits])
    else:
        idx = count_below(g / (scale + EPS), codebook().boundary_values[v_bits])
    return idx.reshape(shape), scale.squeeze(-1).astype(mx.float16)


def encode_values(values: mx.array, v_bits: int, stacked: bool = False) -> tuple[mx.array, mx.array]:
    return encode_values_rotated(rotate(values), v_bits, stacked)


def decode_values_rotated(idx: mx.array, scales: mx.array, v_bits: int) -> mx.array:
    """``centroid[idx] * scale`` (float32), still in the rotated domain."""
    *lead, d = shape = idx.shape
    c = mx.take(codebook().centroids[v_bits], idx.astype(mx.int32)).reshape(*lead, d // GROUP, GROUP)
    return (c * scales[..., None]).reshape(shape)


def decode_values(idx: mx.array, scales: mx.array, v_bits: int) -> mx.array:
    return unrotate(decode_values_rotated(idx, scales, v_bits))


# -- the five stored arrays ---------------------------------------------------------------


def encode_codes(keys: mx.array, values: mx.array, k_bits: int, v_bits: int, stacked: bool = False):
    """Unpacked codes ``(kIdx, kScales, kZeros, vIdx, vScales)``: what a step computes
    (``stacked``: count boundaries with :func:`count_below_stacked`; the same codes)."""
    return (*encode_keys(keys, k_bits), *encode_values(values, v_bits, stacked))


def pack_codes(codes, k_bits: int, v_bits: int):
    """Unpacked codes -> the five stored arrays ``(kIdx, kScales, kZeros, vPacked, vScales)``."""
    k_idx, k_scales, k_zeros, v_idx, v_scales = codes
    return pack_keys(k_idx, k_bits), k_scales, k_zeros, bitpack.pack(v_idx, v_bits), v_scales


def encode(keys: mx.array, values: mx.array, k_bits: int, v_bits: int):
    """``[..., D]`` keys and values -> ``(kIdx, kScales, kZeros, vPacked, vScales)``."""
    check_bits(k_bits, v_bits)
    check_head_dim(keys.shape[-1])
    check_head_dim(values.shape[-1])
    return pack_codes(encode_codes(keys, values, k_bits, v_bits), k_bits, v_bits)


def decode_codes(codes, v_bits: int, rotated: bool = False):
    """Unpacked codes -> float32 (keys, values); values stay rotated when ``rotated``."""
    k_idx, k_scales, k_zeros, v_idx, v_scales = codes
    dec = decode_values_rotated if rotated else decode_values
    return decode_keys(k_idx, k_scales, k_zeros), dec(v_idx, v_scales, v_bits)


def unpack_stored(stored, k_bits: int, v_bits: int):
    """The five stored arrays -> unpacked codes."""
    k_idx, k_scales, k_zeros, v_packed, v_scales = stored
    d = k_scales.shape[-1] * GROUP
    return (
        unpack_keys(k_idx, k_bits, d),
        k_scales,
        k_zeros,
        bitpack.unpack(v_packed, v_bits, d),
        v_scales,
    )


def decode(stored, k_bits: int, v_bits: int, rotated: bool = False):
    """The five stored arrays -> float32 (keys, values)."""
    return decode_codes(unpack_stored(stored, k_bits, v_bits), v_bits, rotated)
