"""TurboQuant codec math: packing, constants, and bytes equal to the vLLM-Metal reference.

The reference (vllm-metal ``turbo_quant_encode``) is restated here in numpy, independently of
``mlxkv.math.turboquant``: the same float32 operations in the same order. Two details
of the reference matter for byte equality and are restated, not approximated:
- ``mean(x**2)``: MLX's ``power`` on the CPU backend is the C library's ``powf`` (not always
  the exactly rounded square), and the 32-element float32 sum runs left to right;
- the orthonormal Hadamard transform is the radix-2 butterfly with the 1/sqrt(D) scale applied
  once at the end.
"""

import ctypes
import ctypes.util
import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import CacheConfigError
from mlxkv.math import bitpack
from mlxkv.math import turboquant as tq

CONSTANTS = json.loads(tq.CONSTANTS_FILE.read_text())
F32 = np.float32
EPS = F32(1e-8)

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_libm.powf.restype = ctypes.c_float
_libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
_powf2 = np.frompyfunc(lambda v: _libm.powf(v, 2.0), 1, 1)


# -- the reference, restated in numpy -------------------------------------------------


def ref_signs(d):
    hx = CONSTANTS["fwht_signs_hex"][str(d)]
    bits = [(int(c, 16) >> (3 - j)) & 1 for c in hx for j in range(4)]
    return (1 - 2 * np.array(bits)).astype(F32)


def ref_fwht(x):
    x = x.astype(F32).copy()
    n, h = x.shape[-1], 1
    lead = x.shape[:-1]
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*lead, n)
        h *= 2
    return x * F32(1 / np.sqrt(n))


def ref_pack(codes, bits):
    if bits == 8:
        return codes.astype(np.uint8)
    *lead, n = codes.shape
    stream = (codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1
    stream = stream.reshape(*lead, n * bits // 8, 8)
    return (stream << np.arange(8, dtype=np.uint32)).sum(-1).astype(np.uint8)


def ref_keys(x, bits):
    *lead, d = x.shape
    g = x.astype(F32).reshape(*lead, d // 32, 32)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    with np.errstate(over="ignore"):
        if bits == 8:
            scale = (hi - lo) / F32(254)
            zero = np.rint((hi + lo) / (F32(2) * (scale + EPS)))
            idx = np.clip(np.rint(g / (scale + EPS) - zero), -127, 127).astype(np.int8)
        else:
            top = (1 << bits) - 1
            scale = (hi - lo) / F32(top)
            zero = np.rint(lo / (scale + EPS))
            idx = np.clip(np.rint(g / (scale + EPS) - zero), 0, top).astype(np.uint8)
        sc, zr = scale[..., 0].astype(np.float16), zero[..., 0].astype(np.float16)
    idx = idx.reshape(*lead, d)
    return (idx if bits == 8 else ref_pack(idx, bits)), sc, zr


def ref_values(x, bits):
    *lead, d = x.shape
    y = ref_fwht(x.astype(F32) * ref_signs(d))
    g = y.reshape(*lead, d // 32, 32)
    sq = _powf2(g).astype(F32)
    total = np.zeros(g.shape[:-1], F32)
    for i in range(32):  # left to right, float32
        total = total + sq[..., i]
    scale = np.sqrt(total / F32(32))[..., None]
    bounds = np.asarray(CONSTANTS["lloyd_max"][str(bits)]["boundaries"], F32)
    idx = ((g / (scale + EPS))[..., None] > bounds).sum(-1).astype(np.uint8).reshape(*lead, d)
    return ref_pack(idx, bits), scale[..., 0].astype(np.float16)


def ref_encode(k, v, kb, vb):
    return (*ref_keys(k, kb), *ref_values(v, vb))


def sample(shape, seed):
    """Keys/values with per-group offsets and scales, some exact ties and a zero group."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(F32)
    *lead, d = shape
    x = x.reshape(*lead, d // 32, 32)
    x = x * rng.uniform(0.05, 4, (*lead, d // 32, 1)).astype(F32) + rng.normal(0, 2, (*lead, d // 32, 1)).astype(F32)
    x[..., 0, :8] = np.array([0.5, 1.5, -2.5, 3.0, -1.0, 0.25, 2.0, -0.5], F32)  # ties after scaling
    x = x.reshape(shape)
    x[0, 0, 0, :32] = 0.0  # an all-zero group: zero scale, decodes to 0
    return x


# -- packing ------------------------------------------------------------------------


def test_packing_examples_of_the_design():
    assert bitpack.pack(mx.array([0, 1, 2, 3, 0, 0, 0, 0], mx.uint8), 2).tolist()[0] == 0xE4
    assert bitpack.pack(mx.array([1, 2, 3, 4, 5, 6, 7, 0], mx.uint8), 3).tolist() == [209, 88, 31]
    assert bitpack.pack(mx.array(list(range(1, 9)), mx.uint8), 5).tolist() == [65, 12, 82, 204, 65]


@pytest.mark.parametrize("bits", bitpack.PACK_BITS)
def test_packing_is_the_little_endian_bitstream_and_round_trips(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (2, 3, 5, 128)).astype(np.uint8)
    packed = bitpack.pack(mx.array(codes), bits)
    assert packed.dtype == mx.uint8 and packed.shape == (2, 3, 5, 128 * bits // 8)
    assert np.array_equal(np.array(packed), ref_pack(codes, bits))
    assert np.array_equal(np.array(bitpack.unpack(packed, bits, 128)), codes)


def test_packing_refuses_what_it_cannot_pack():
    with pytest.raises(CacheConfigError, match="bits in"):
        bitpack.pack(mx.zeros((8,), mx.uint8), 6)
    with pytest.raises(CacheConfigError, match="multiple of 8"):
        bitpack.pack(mx.zeros((12,), mx.uint8), 4)
    with pytest.raises(CacheConfigError, match="packs into"):
        bitpack.unpack(mx.zeros((5,), mx.uint8), 4, 8)


# -- constants ------------------------------------------------------------------------


def test_constants_are_the_reference_tables():
    book = tq.codebook()
    for bits in tq.V_BITS:
        for name, table in (("centroids", book.centroids), ("boundaries", book.boundaries)):
            got = np.array(table[bits])
            assert got.dtype == np.float32 and got.size == (1 << bits) - (name == "boundaries")
            digest = hashlib.sha256(got.astype("<f4").tobytes()).hexdigest()
            assert digest.startswith(CONSTANTS["lloyd_max_sha256_prefix_f32le"][str(bits)][name])
        assert np.all(np.diff(np.array(book.boundaries[bits])) > 0)


@pytest.mark.parametrize("d", tq.HEAD_DIMS)
def test_sign_vectors_are_mlx_randint_with_key_42(d):
    bits01 = mx.random.randint(0, 2, (d,), key=mx.random.key(42))
    assert mx.array_equal(tq.codebook().signs[d], (1 - 2 * bits01).astype(mx.float32))
    assert np.array_equal(ref_signs(d), np.array(tq.codebook().signs[d]))


def test_damaged_constants_are_refused(tmp_path, monkeypatch):
    raw = json.loads(tq.CONSTANTS_FILE.read_text())
    raw["lloyd_max"]["3"]["centroids"][0] += 1e-6
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps(raw))
    monkeypatch.setattr(tq, "CONSTANTS_FILE", bad)
    tq.codebook.cache_clear()
    try:
        with pytest.raises(tq.MLXKVError, match="sha256"):
            tq.codebook()
    finally:
        monkeypatch.undo()
        tq.codebook.cache_clear()


# -- bytes equal the reference ----------------------------------------------------------


@pytest.mark.parametrize("d", tq.HEAD_DIMS)
def test_encode_bytes_equal_the_reference_for_every_configuration(d):
    shape = (1, 2, 3, d)
    k, v = sample(shape, d), sample(shape, d + 1)
    for kb in tq.K_BITS:
        for vb in tq.V_BITS:
            got = tq.encode(mx.array(k), mx.array(v), kb, vb)
            want = ref_encode(k, v, kb, vb)
            dtypes = (mx.int8 if kb == 8 else mx.uint8, mx.float16, mx.float16, mx.uint8, mx.float16)
            for name, g, w, dt in zip(("kIdx", "kScales", "kZeros", "vPacked", "vScales"), got, want, dtypes):
                assert g.dtype == dt, (kb, vb, name)
                assert g.shape == w.shape, (kb, vb, name)
                assert np.array(g).tobytes() == w.tobytes(), (d, kb, vb, name)


def test_count_below_counts_like_the_reference_comparison():
    rng = np.random.default_rng(0)
    for bits in tq.V_BITS:
        b = tq.codebook().boundaries[bits]
        y = np.concatenate([rng.normal(0, 2, 4000), np.array(b), [np.nan, np.inf, -np.inf]]).astype(F32)
        want = (y[:, None] > np.array(b)).sum(-1)
        assert np.array_equal(np.array(tq.count_below(mx.array(y), b)), want)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_inputs_of_any_float_dtype_are_computed_in_float32(dtype):
    x = mx.array(sample((1, 2, 4, 128), 5)).astype(dtype)
    a = tq.encode(x, x, 4, 3)
    b = tq.encode(x.astype(mx.float32), x.astype(mx.float32), 4, 3)
    assert all(mx.array_equal(p, q) for p, q in zip(a, b))
    assert np.array(a[3]).tobytes() == ref_values(np.array(x.astype(mx.float32)), 3)[0].tobytes()


def test_decode_inverts_the_encode_within_the_quantization_error():
    k = mx.array(sample((1, 2, 6, 128), 9))
    for kb in tq.K_BITS:
        stored = tq.encode(k, k, kb, 8)
        dk, dv = tq.decode(stored, kb, 8)
        step = mx.repeat(stored[1].astype(mx.float32), 32, axis=-1)
        assert mx.all(mx.abs(dk - k) <= step * 0.5 + 1e-2 * mx.abs(k) + 1e-3).item(), kb
        assert mx.allclose(dv, k, atol=0.05 * mx.abs(k).max().item()).item()  # 8-bit values
    # deferred decode un-rotated equals the eager decode
    stored = tq.encode(k, k, 4, 3)
    _, rot = tq.decode(stored, 4, 3, rotated=True)
    _, eager = tq.decode(stored, 4, 3)
    assert mx.allclose(tq.unrotate(rot), eager, atol=1e-5).item()


# -- the NaN property -------------------------------------------------------------------


@pytest.mark.parametrize("kb", tq.K_BITS)
def test_a_constant_key_group_stores_an_infinite_zero_and_decodes_to_nan(kb):
    x = np.array(sample((1, 1, 2, 64), 3))
    x[0, 0, 0, :32] = 0.75  # constant group: scale 0, zero = round(0.75 / 1e-8) overflows float16
    x[0, 0, 1, 32:] = -0.75
    x[0, 0, 1, :32] = 0.0  # constant 0 stays finite
    idx, scales, zeros = tq.encode_keys(mx.array(x), kb)
    ref = ref_keys(x, kb)
    assert np.array(scales).tobytes() == ref[1].tobytes() and np.array(zeros).tobytes() == ref[2].tobytes()
    zeros_bits = np.array(zeros).view(np.uint16)
    assert zeros_bits[0, 0, 0, 0] == 0x7C00 and zeros_bits[0, 0, 1, 1] == 0xFC00  # +inf, -inf
    assert np.array(scales)[0, 0, 0, 0] == 0 and np.all(np.array(idx)[0, 0, 0, :32] == 0)
    dec = np.array(tq.decode_keys(idx, scales, zeros))
    assert np.all(np.isnan(dec[0, 0, 0, :32])) and np.all(np.isnan(dec[0, 0, 1, 32:]))
    assert np.all(dec[0, 0, 1, :32] == 0) and np.all(np.isfinite(dec[0, 0, 0, 32:]))


# -- errors -----------------------------------------------------------------------------


def test_unsupported_configurations_name_the_supported_values():
    k = mx.zeros((1, 1, 1, 64))
    with pytest.raises(CacheConfigError, match=r"kBits must be one of \(2, 4, 5, 8\)"):
        tq.encode(k, k, 3, 3)
    with pytest.raises(CacheConfigError, match=r"vBits must be one of \(2, 3, 4, 5, 8\)"):
        tq.encode(k, k, 8, 6)
    with pytest.raises(CacheConfigError, match=r"head_dim in \(64, 128, 256, 512\)"):
        tq.encode(mx.zeros((1, 1, 1, 96)), mx.zeros((1, 1, 1, 96)), 8, 3)
