"""Names derived from tokens: the identity seed, chained block hashes and entry ids.

Every tier of a prompt store finds candidate entries by the chained hashes of fixed blocks
of ``block`` tokens, seeded with the identity, so entries of another model, tokenizer,
scheme, namespace or block size share no hash with a prompt:

- ``seed = sha256(b"mlxkv-store-1\\n" + canonical JSON of {"block", "configFingerprint",
  "kvScheme", "ns", "tokenizerHash"})`` (keys sorted, separators ``,`` ``:``, ASCII);
- ``h[0] = seed``, ``h[i] = sha256(h[i-1] + tokens[(i-1)*block : i*block] as uint32 LE)``;
  ``h[i]`` names the first ``i`` blocks, so two token lists share ``h[i]`` exactly when their
  first ``i * block`` tokens agree (up to a sha256 collision);
- an entry's id is ``sha256(seed + all its tokens as uint32 LE)``, first 16 bytes in hex: the
  same prefix of the same identity has the same id in every process (files and Redis keys
  are named by it).

docs/store.md gives the byte layout; another language computes the same names from it.
"""

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from ..caches.schemes import canonical_scheme
from ..errors import MLXKVError
from ..state.identity import Identity

SEED_TAG = b"mlxkv-store-1\n"
ID_BYTES = 16


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as uint32 little-endian; each must be an integer in [0, 2**32)."""
    a = np.asarray(tokens, dtype=np.int64) if len(tokens) else np.zeros(0, np.int64)
    if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() >= 2**32)):
        raise MLXKVError("tokens must be a flat list of integers in [0, 2**32)")
    return a.astype("<u4").tobytes()


def identity_seed(identity: Identity, ns: str, block: int) -> bytes:
    """The 32-byte seed of one identity (``configFingerprint``, ``tokenizerHash``,
    ``kvScheme``: ``Identity.key_fields``), namespace and block size."""
    doc = {"block": int(block), **identity.key_fields(ns)}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(SEED_TAG + text.encode()).digest()


def block_chain(seed: bytes, tokens: Sequence[int], block: int, limit: int | None = None) -> list[bytes]:
    """``h[1] .. h[k]`` for the ``k`` whole blocks of ``tokens`` (at most ``limit``)."""
    k = len(tokens) // block if limit is None else min(limit, len(tokens) // block)
    raw = token_bytes(tokens[: k * block])
    out, h, step = [], seed, 4 * block
    for i in range(k):
        h = hashlib.sha256(h + raw[i * step : (i + 1) * step]).digest()
        out.append(h)
    return out


def entry_id(seed: bytes, tokens: Sequence[int]) -> str:
    return hashlib.sha256(seed + token_bytes(tokens)).digest()[:ID_BYTES].hex()


def scheme_identity(scheme: str, options: dict | None = None) -> str:
    """The cache scheme as a store's identity names it (header field ``kvScheme``): the
    canonical form of what ``make_cache(model, scheme, **options)`` builds
    (``mlxkv.caches.schemes.canonical_scheme``, the one rule a server and a library user
    share: aliases resolved, every option that changes what a cache holds, none that only
    changes how it is read), e.g. ``"kv4-g64"`` for ``kv4``, ``"bf16+max_kv_size=4096"``.
    ``""`` (no scheme): the store does not know what its caches are; options need one."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if not scheme:
        if options:
            raise MLXKVError(f"cache_options {sorted(options)} need the scheme they belong to: pass scheme= too")
        return ""
    return canonical_scheme(scheme, **options)
