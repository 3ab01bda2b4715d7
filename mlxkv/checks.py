"""Field checks shared by every layer: one function per rule.

JSON and Python both let ``True`` pass for ``1``; a count, a bit width or a token id never
is a bool, so these refuse it.
"""

from typing import Any

from .errors import CacheConfigError


def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    """An integer >= 0 that is not a bool."""
    return is_int(value) and value >= 0


#: the largest count, position, size or token id a snapshot holds (MLX shapes are int32)
INT32_MAX = 2**31 - 1


def is_count32(value: Any) -> bool:
    """An integer in 0 .. INT32_MAX that is not a bool."""
    return is_int(value) and 0 <= value <= INT32_MAX


def is_count32_list(value: Any) -> bool:
    """A list whose every element passes :func:`is_count32` (a snapshot's tokens): exact
    ints are checked at C speed (their types, then the smallest and largest), anything
    else element by element."""
    if type(value) is not list:
        return False
    if set(map(type, value)) <= {int}:
        return not value or (min(value) >= 0 and max(value) <= INT32_MAX)
    return all(is_count32(v) for v in value)


def is_int_list(value: Any) -> bool:
    """A list whose every element is an integer (not a bool)."""
    return isinstance(value, list) and all(is_int(v) for v in value)


def check_ring_size(max_size, keep) -> None:
    """A ring of ``max_size`` positions keeping its first ``keep``: ``max_size > 0`` and
    ``0 <= keep < max_size`` (mlx-lm's ``RotatingKVCache`` and mlxkv's rings alike)."""
    if max_size <= 0 or not 0 <= keep < max_size:
        raise CacheConfigError(
            f"a ring needs max_size > 0 and 0 <= keep < max_size; got max_size={max_size}, keep={keep}"
        )
