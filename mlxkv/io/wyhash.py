"""Zig's ``std.hash.Wyhash`` with seed 0: the 64-bit hash Bun exposes as ``Bun.hash``.

mlx-bun's cache files (docs/mlx-bun.md) carry it as the header hash and as every tensor's
hash. It is wyhash "final4" as Zig implements it, which differs from the C reference (and
from the PyPI ``wyhash`` binding) in where the 48-byte rounds stop: Zig runs a round only
while *more than* 48 bytes remain, so an input of exactly 48 bytes is hashed by the 16-byte
tail loop. All reads are little-endian.

``wyhash(data)`` hashes one buffer; :class:`Wyhash` is the same function fed in pieces
(``update`` any number of times, then ``digest``), so a tensor can be hashed chunk by chunk
while it is read or written. ``hex16`` formats a value the way mlx-bun writes tensor hashes.

This is pure Python (measured in docs/mlx-bun.md: tens of MB/s): no package on PyPI
reproduces Zig's variant, so there is nothing faster to defer to.
"""

import struct

SECRET = (0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3)
_MASK = (1 << 64) - 1
_BLOCK = 48
_ROUNDS = struct.Struct("<6Q")
_PAIR = struct.Struct("<2Q")
_U32 = struct.Struct("<I")


def _mix(a: int, b: int) -> int:
    p = a * b
    return (p & _MASK) ^ (p >> 64)


def _initial(seed: int) -> int:
    return seed ^ _mix(seed ^ SECRET[0], SECRET[1])


def _small(data: bytes) -> tuple:
    """(a, b) of an input of at most 16 bytes."""
    n = len(data)
    if n >= 4:
        q = (n >> 3) << 2
        w = [_U32.unpack_from(data, i)[0] for i in (0, q, n - 4, n - 4 - q)]
        return (w[0] << 32) | w[1], (w[2] << 32) | w[3]
    if n > 0:
        return (data[0] << 16) | (data[n >> 1] << 8) | data[n - 1], 0
    return 0, 0


def _final(a: int, b: int, lane0: int, n: int) -> int:
    p = (a ^ SECRET[1]) * (b ^ lane0)
    lo, hi = p & _MASK, p >> 64
    return _mix(lo ^ SECRET[0] ^ (n & _MASK), hi ^ SECRET[1])


class Wyhash:
    """Streaming Zig wyhash (seed 0 unless given): ``update(bytes)``..., ``digest() -> int``.

    Bytes are buffered until more than 48 are pending, then whole rounds run on all but the
    last pending byte(s), so the final step always sees the input's last 1..48 bytes, as the
    one-shot function does.
    """

    __slots__ = ("_lanes", "_last16", "_pending", "_total")

    def __init__(self, seed: int = 0):
        s = _initial(seed & _MASK)
        self._lanes = (s, s, s)
        self._pending = bytearray()
        self._total = 0
        self._last16 = b""  # the last 16 bytes already consumed by rounds

    def update(self, data) -> "Wyhash":
        data = memoryview(data).cast("B")
        self._total += len(data)
        pending = self._pending
        if len(pending) + len(data) <= _BLOCK:
            pending += data
            return self
        # complete the pending block first, keep at least one byte back
        if pending:
            take = _BLOCK - len(pending)
            pending += data[:take]
            data = data[take:]
            self._rounds(pending)
            self._last16 = bytes(pending[-16:])
            pending.clear()
        k = (len(data) - 1) // _BLOCK  # full rounds that leave 1..48 bytes pending
        if k:
            self._rounds(data[: k * _BLOCK])
            self._last16 = bytes(data[k * _BLOCK - 16 : k * _BLOCK])
        pending += data[k * _BLOCK :]
        return self

    def _rounds(self, blocks) -> None:
        s1, s2, s3 = SECRET[1], SECRET[2], SECRET[3]
        m = _MASK
        l0, l1, l2 = self._lanes
        for a0, b0, a1, b1, a2, b2 in _ROUNDS.iter_unpack(blocks):
            p = (a0 ^ s1) * (b0 ^ l0)
            l0 = (p & m) ^ (p >> 64)
            p = (a1 ^ s2) * (b1 ^ l1)
            l1 = (p & m) ^ (p >> 64)
            p = (a2 ^ s3) * (b2 ^ l2)
            l2 = (p & m) ^ (p >> 64)
        self._lanes = (l0, l1, l2)

    def digest(self) -> int:
        n, rest = self._total, bytes(self._pending)
        l0, l1, l2 = self._lanes
        if n <= 16:
            a, b = _small(rest)
            return _final(a, b, l0, n)
        if n > _BLOCK:  # Zig folds the lanes once it ran (or could have run) rounds
            l0 ^= l1 ^ l2
        j = 0
        while j + 16 < len(rest):
            a, b = _PAIR.unpack_from(rest, j)
            l0 = _mix(a ^ SECRET[1], b ^ l0)
            j += 16
        tail = (self._last16 + rest)[-16:]
        a, b = _PAIR.unpack(tail)
        return _final(a, b, l0, n)

    def hexdigest(self) -> str:
        return hex16(self.digest())


def wyhash(data, seed: int = 0) -> int:
    """Zig ``std.hash.Wyhash.hash(seed, data)``; ``Bun.hash(data)`` for seed 0."""
    return Wyhash(seed).update(data).digest()


def hex16(value: int) -> str:
    """A hash as mlx-bun writes tensor hashes: 16 lowercase hex digits, zero-padded."""
    return f"{value & _MASK:016x}"
