"""Zig's std.hash.Wyhash (Bun.hash), seed 0: the test vectors of mlx-bun's notes, and the
streaming form against a direct transcription of the algorithm for every split."""

import os
import random
import struct

import pytest

from mlxkv.io.wyhash import SECRET, Wyhash, hex16, wyhash

# Bun.hash outputs recorded in the mlx-bun notes (section 5)
VECTORS = [
    (b"", "0409638ee2bde459"),
    (b"a", "28d2053309d28531"),
    (b"abc", "02a4f1d7cb516c72"),
    (b"hello world", "668d5e431c3b2573"),
    (bytes(range(64)), "ae9ac4f9962d6746"),
    (bytes(range(256)), "49b63d7cb2afe93a"),
    (struct.pack("<4I", 1, 2, 3, 4), "87d763039bb86e44"),
    (b"lora-a", "73153433c8ddcab2"),
]


@pytest.mark.parametrize(("data", "want"), VECTORS, ids=[repr(v[0][:12]) for v in VECTORS])
def test_bun_hash_vectors(data, want):
    assert hex16(wyhash(data)) == want
    assert Wyhash().update(data).hexdigest() == want


def _direct(x: bytes) -> int:
    """The algorithm as the notes state it, one buffer, no streaming."""
    m = (1 << 64) - 1

    def mix(a, b):
        p = a * b
        return (p & m) ^ (p >> 64)

    def r64(i):
        return struct.unpack_from("<Q", x, i)[0]

    def r32(i):
        return struct.unpack_from("<I", x, i)[0]

    n = len(x)
    lane = [mix(SECRET[0], SECRET[1])] * 3
    if n <= 16:
        if n >= 4:
            q = (n >> 3) << 2
            a, b = (r32(0) << 32) | r32(q), (r32(n - 4) << 32) | r32(n - 4 - q)
        elif n:
            a, b = (x[0] << 16) | (x[n >> 1] << 8) | x[n - 1], 0
        else:
            a = b = 0
    else:
        i = 0
        if n >= 48:
            while i + 48 < n:
                lane = [mix(r64(i + 16 * k) ^ SECRET[k + 1], r64(i + 16 * k + 8) ^ lane[k]) for k in range(3)]
                i += 48
            lane[0] ^= lane[1] ^ lane[2]
        while i + 16 < n:
            lane[0] = mix(r64(i) ^ SECRET[1], r64(i + 8) ^ lane[0])
            i += 16
        a, b = r64(n - 16), r64(n - 8)
    a ^= SECRET[1]
    b ^= lane[0]
    p = a * b
    return mix((p & m) ^ SECRET[0] ^ n, (p >> 64) ^ SECRET[1])


def test_every_length_around_the_block_edges_matches_the_direct_form():
    rng = random.Random(0)
    for n in list(range(200)) + [240, 287, 288, 289, 4096, 4097]:
        data = rng.randbytes(n)
        assert wyhash(data) == _direct(data), n


def test_a_multiple_of_48_bytes_runs_its_last_block_in_the_tail_loop():
    # Zig runs a round only while more than 48 bytes remain (the C reference does not)
    for n in (48, 96, 144):
        data = bytes(range(256))[:n] if n <= 256 else os.urandom(n)
        assert wyhash(data) == _direct(data)


def test_streaming_equals_one_shot_for_any_split():
    rng = random.Random(1)
    for n in (0, 1, 15, 16, 17, 47, 48, 49, 95, 96, 97, 1000, 65537):
        data = rng.randbytes(n)
        want = wyhash(data)
        for _ in range(8):
            h, i = Wyhash(), 0
            while i < n:
                k = rng.choice((1, 7, 16, 47, 48, 49, 100, 4096))
                h.update(data[i : i + k])
                i += k
            assert h.digest() == want, n


def test_hex16_is_zero_padded():
    assert hex16(0x1234) == "0000000000001234"
    assert len(hex16(wyhash(b"a"))) == 16
