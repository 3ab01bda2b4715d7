"""The server's prompt cache: the object ``mlx_lm.server`` asks for the nearest cached
prefix of a prompt and gives finished rows to.

``mlx_lm.server`` calls five members of it (its ``LRUPromptCache``'s interface):

- ``fetch_nearest_cache(model_key, tokens) -> (caches or None, tokens still to forward)``;
  the caches are the server's to modify (a copy of what is stored);
- ``insert_cache(model_key, tokens, caches, *, cache_type="assistant")``: ``caches`` encode
  exactly ``tokens``; the server does not use them afterwards;
- ``trim_to(n_sequences=None, n_bytes=None)``, ``len()``, ``nbytes``, ``stats_by_type()``.

Any object with these members can serve; ``build_prompt_cache`` chooses. With ``--store DIR``
or ``--redis URL`` it is :class:`mlxkv.store.StorePromptCache`: a :class:`~mlxkv.PromptStore`
(RAM, then the directory's snapshot files, which survive restarts, then Redis, shared by
several servers, its entries authenticated with the secret in ``MLXKV_STORE_SECRET``),
opened when the model loads, since its entries are keyed by the model's fingerprint,
tokenizer, scheme and cache options. Otherwise :class:`PromptCache`: mlx-lm's in-memory LRU
with mlxkv's reuse rule (``mlxkv.state.reuse``): a stored entry serves a prompt from
``p = min(common prefix, len(prompt) - 1)`` only if ``p`` is not below any cache's
``minimum_reusable_offset`` and, when ``p`` is short of the entry, every cache can trim. So
a bf16-first cache is never cut below the position it converted at, and at least one prompt
token is always left to forward (an exact hit is served one token short instead of handing
mlx-lm's batch engine an empty prompt, which it refuses).
"""

import copy
import os

from mlx_lm.models.cache import LRUPromptCache

from ..state.reuse import usable_prefix
from ..store import StoreOptions, StorePromptCache
from .options import cache_options

#: the RAM the store may hold when ``--prompt-cache-bytes`` is not given
DEFAULT_STORE_BYTES = 1 << 30


class PromptCache(LRUPromptCache):
    def fetch_nearest_cache(self, model, tokens):
        found = self._trie.search(model, tokens)
        best = None
        for key in (found.exact, found.longer, found.shorter):
            if key is None:
                continue
            entry = self._trie.get(model, key)
            p = usable_prefix(key, entry.prompt_cache, tokens)
            if p is not None and (best is None or p > best[0]):
                best = (p, key, entry)
        if best is None:
            return None, tokens
        p, key, entry = best
        caches = copy.deepcopy(entry.prompt_cache)
        drop = len(key) - p
        if drop:
            for c in caches:
                c.trim(drop)
        return caches, tokens[p:]


def build_prompt_cache(args):
    """The prompt cache ``mlxkv serve`` runs with: a :class:`StorePromptCache` with ``--store``
    or ``--redis`` (its options checked now, before the model loads), else
    :class:`PromptCache` (``--prompt-cache-size`` entries in memory)."""
    if args.store is None and args.redis is None:
        return PromptCache(max_size=args.prompt_cache_size)
    options = StoreOptions(
        cap=args.prompt_cache_bytes if args.prompt_cache_bytes is not None else DEFAULT_STORE_BYTES,
        directory=args.store,
        redis=args.redis,
        secret=os.environ.get("MLXKV_STORE_SECRET"),
        scheme=args.scheme,  # the store keys on their canonical form (canonical_scheme)
        cache_options=cache_options(args),
        disk_cap=args.store_disk_bytes,
    )
    return StorePromptCache(options=options)
