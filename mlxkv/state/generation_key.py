"""mlx-bun's request key of a resumable generation (``generationCheckpointKey``).

mlx-bun names an in-flight generation by the sha256 hex of ``JSON.stringify(canonical(policy))``
where ``canonical`` sorts the keys of every object with ``String.prototype.localeCompare`` and
keeps arrays in order, and ``policy`` is an object of the request's prompt, namespace and
sampling settings (docs/sessions.md lists the fields mlxkv fills). This module computes the
same string from a Python dict, so a policy mlxkv and mlx-bun describe alike gets one key:

- key order: ``localeCompare`` under ICU's root collation orders ASCII letters and digits
  case-insensitively (digits first), then, at the first position where only the case
  differs, lowercase first (``"ab" < "aB" < "Ab" < "b"``). Keys are restricted to ASCII
  letters and digits, where that rule is exact; anything else is refused rather than
  guessed. ``JSON.stringify`` then emits integer-like keys (``"0"``, ``"17"``: array
  indices) first, in ascending numeric order, before the others in their sorted order.
- numbers: JavaScript has one number type: ``1.0`` is written ``1``, ``1e-7`` ``1e-7``,
  ``1e21`` ``1e+21`` (``Number.prototype.toString``, the formatter of mlx-bun's header writer);
  non-finite numbers are refused (``JSON.stringify`` would write ``null``). ``None`` values
  are dropped, as ``JSON.stringify`` drops ``undefined``.
- strings: escaped as ``JSON.stringify`` does (``"``, ``\\``, control characters), non-ASCII as is.

Checked against Node's ``JSON.stringify``, ``localeCompare`` and sha256 in
tests/test_generation_key.py (vectors) and by the TypeScript reader (fixtures/ts), which
recomputes the key of every fixture checkpoint.
"""

import hashlib
import math
import re

from ..errors import CacheConfigError
from ..io.mlxbun import js_json

_KEY = re.compile(r"[A-Za-z0-9]+")
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _collation(key: str):
    """ICU root collation of an ASCII alphanumeric string: primary (case-folded, digits
    before letters), then tertiary (lowercase before uppercase, first difference wins)."""
    if not _KEY.fullmatch(key):
        raise CacheConfigError(f"policy field {key!r}: only ASCII letters and digits are ordered exactly")
    primary = tuple((0 if c.isdigit() else 1, c.lower()) for c in key)
    tertiary = tuple(c.isupper() for c in key)
    return primary, tertiary


def _is_index(key: str) -> bool:
    return bool(_INDEX.fullmatch(key)) and int(key) < 2**32 - 1


def canonical(value):
    """``canonical`` of mlx-bun: object keys sorted by ``localeCompare``, arrays in order,
    ``None`` members dropped; then ordered as ``JSON.stringify`` enumerates them."""
    if isinstance(value, dict):
        items = [(str(k), canonical(v)) for k, v in value.items() if v is not None]
        items.sort(key=lambda kv: _collation(kv[0]))
        indices = sorted((kv for kv in items if _is_index(kv[0])), key=lambda kv: int(kv[0]))
        return dict(indices + [kv for kv in items if not _is_index(kv[0])])
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise CacheConfigError(f"a generation key policy holds finite numbers only, got {value!r}")
    return value


def canonical_json(policy: dict) -> str:
    """``JSON.stringify(canonical(policy))``."""
    return js_json(canonical(policy))


def generation_key(policy: dict, prompt_ids, cache_ns: str) -> str:
    """The request key: sha256 hex of the canonical JSON of ``policy`` with ``promptIds`` and
    ``cacheNs`` added (``policy`` holds every other field of the request)."""
    doc = {**policy, "promptIds": [int(t) for t in prompt_ids], "cacheNs": cache_ns}
    return hashlib.sha256(canonical_json(doc).encode("utf-8")).hexdigest()
