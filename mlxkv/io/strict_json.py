"""JSON as a snapshot reader accepts it: RFC 8259 within the I-JSON limits of RFC 7493.

Python's ``json`` takes more than the standard (``NaN``, ``Infinity``, numbers that overflow
to infinity, the last of two equal keys, lone UTF-16 surrogates in strings, integers no
double holds) and recurses as deep as the input nests. A reader must refuse what another
implementation would read differently, so :func:`loads` refuses all of it, and nesting
deeper than :data:`MAX_DEPTH`, with :class:`~mlxkv.errors.CorruptSnapshotError`. Every rule
is in docs/format.md, section 8.
"""

import json
import math

from ..errors import CorruptSnapshotError

#: objects and arrays nest at most this deep (a snapshot header needs 6)
MAX_DEPTH = 64
#: integers beyond this magnitude have no exact double (RFC 7493, section 2.2)
MAX_SAFE_INTEGER = 2**53 - 1


class _Refused(ValueError):
    pass


def _no_constants(name):
    raise _Refused(f"{name} is not JSON")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} does not fit a double")
    return value


def _unique(pairs):
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the key {key[:80]!r} appears twice in one object")
    return obj


def _check_int(value: int) -> None:
    if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        raise _Refused(f"the integer {str(value)[:40]} is beyond +-(2**53-1)")


def _check_tree(value) -> None:
    """Depth at most MAX_DEPTH; every string (keys included) encodable as UTF-8; every
    integer within +-(2**53-1)."""
    top = type(value)
    stack = [(value, 1)] if top is dict or top is list else []
    strings = [value] if top is str else []
    if top is int:
        _check_int(value)
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Refused(f"objects and arrays nest deeper than {MAX_DEPTH}")
        if type(v) is dict:
            strings.extend(v)
            v = list(v.values())
        if v and set(map(type, v)) == {int}:  # a list of ints (token ids): checked at C speed
            _check_int(min(v))
            _check_int(max(v))
            continue
        for x in v:
            t = type(x)
            if t is str:
                strings.append(x)
            elif t is dict or t is list:
                stack.append((x, depth + 1))
            elif t is int:
                _check_int(x)
    for s in strings:
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refused("a string holds a lone UTF-16 surrogate") from None


def loads(data: bytes | str, what: str):
    """Parse ``data`` (UTF-8 bytes or text) strictly; ``what`` names it in the error."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        value = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constants, parse_float=_finite)
        _check_tree(value)
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"{what}: damaged: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise CorruptSnapshotError(f"{what}: damaged: objects and arrays nest deeper than {MAX_DEPTH}") from None
    except _Refused as e:
        raise CorruptSnapshotError(f"{what}: damaged: {e}") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise CorruptSnapshotError(f"{what}: damaged: not valid JSON ({str(e)[:200]})") from None
    return value
