"""Little-endian bitstream packing of small unsigned codes along the last axis.

Element ``i`` of a row occupies bits ``[i*b, i*b + b)`` of the row's bitstream, and bit
``k`` of the stream is bit ``k % 8`` of byte ``k // 8`` (docs/format.md, TurboQuant). Examples:
2-bit ``[0, 1, 2, 3] -> [0xE4]``; 3-bit ``[1..7, 0] -> [209, 88, 31]``;
5-bit ``[1..8] -> [65, 12, 82, 204, 65]``.

Every 8 codes fill exactly ``b`` bytes, so a row is cut into blocks of 8 codes; each block is
summed into one integer word (the bit fields are disjoint, so the sum is their OR) and the
word is split into its ``b`` bytes. Everything is array arithmetic: no Python loop over rows,
tokens, heads or blocks. At 8 bits the codes are the bytes.
"""

import mlx.core as mx

from ..errors import CacheConfigError

PACK_BITS = (2, 3, 4, 5, 8)
CODES_PER_BLOCK = 8  # 8 codes of b bits are exactly b bytes


def _check(bits: int, n: int) -> None:
    if bits not in PACK_BITS:
        raise CacheConfigError(f"bit packing supports bits in {PACK_BITS}, got {bits}")
    if n % CODES_PER_BLOCK:
        raise CacheConfigError(f"bit packing needs a multiple of {CODES_PER_BLOCK} codes per row, got {n}")


def packed_width(n: int, bits: int) -> int:
    """Bytes one row of ``n`` codes of ``bits`` bits packs into."""
    _check(bits, n)
    return n * bits // 8


def _word(bits: int):
    # 8 codes of b bits: 16, 24 or 32 bits fit a uint32; 40 bits (b = 5) need a uint64.
    return mx.uint32 if bits <= 4 else mx.uint64


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack ``codes`` (unsigned, each below ``2**bits``) ``[..., n]`` into uint8 ``[..., n*bits/8]``."""
    *lead, n = codes.shape
    _check(bits, n)
    if bits == 8:
        return codes.astype(mx.uint8)
    word = _word(bits)
    blocks = codes.astype(word).reshape(*lead, n // CODES_PER_BLOCK, CODES_PER_BLOCK)
    blocks = blocks & ((1 << bits) - 1)
    field_shift = mx.arange(CODES_PER_BLOCK, dtype=word) * bits
    stream = (blocks << field_shift).sum(axis=-1)  # disjoint fields: sum == bitwise or
    byte_shift = mx.arange(bits, dtype=word) * 8
    out = (stream[..., None] >> byte_shift) & 0xFF
    return out.astype(mx.uint8).reshape(*lead, n * bits // 8)


def unpack(packed: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of :func:`pack`: uint8 ``[..., n*bits/8]`` -> uint8 codes ``[..., n]``."""
    _check(bits, n)
    *lead, width = packed.shape
    if width != n * bits // 8:
        raise CacheConfigError(f"a row of {n} codes at {bits} bits packs into {n * bits // 8} bytes, got {width}")
    if bits == 8:
        return packed.astype(mx.uint8)
    word = _word(bits)
    blocks = packed.astype(word).reshape(*lead, n // CODES_PER_BLOCK, bits)
    byte_shift = mx.arange(bits, dtype=word) * 8
    stream = (blocks << byte_shift).sum(axis=-1)
    field_shift = mx.arange(CODES_PER_BLOCK, dtype=word) * bits
    codes = (stream[..., None] >> field_shift) & ((1 << bits) - 1)
    return codes.astype(mx.uint8).reshape(*lead, n)
