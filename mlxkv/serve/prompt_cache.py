"""The server's prompt cache: the object ``mlx_lm.server`` asks for the nearest cached
prefix of a prompt and gives finished rows to.

``mlx_lm.server`` calls five members of it (its ``LRUPromptCache``'s interface):

- ``fetch_nearest_cache(model_key, tokens) -> (caches or None, tokens still to forward)``;
  the caches are the server's to modify (a copy of what is stored);
- ``insert_cache(model_key, tokens, caches, *, cache_type="assistant")``: ``caches`` encode
  exactly ``tokens``; the server does not use them afterwards;
- ``trim_to(n_sequences=None, n_bytes=None)``, ``len()``, ``nbytes``, ``stats_by_type()``.

Any object with these members can serve (``build_prompt_cache`` is where another store is
chosen). :class:`PromptCache` is mlx-lm's in-memory LRU with mlxkv's reuse rule
(``mlxkv.state.reuse``): a stored entry serves a prompt from ``p = min(common prefix,
len(prompt) - 1)`` only if ``p`` is not below any cache's ``minimum_reusable_offset`` and, when
``p`` is short of the entry, every cache can trim. So a bf16-first cache is never cut below
the position it converted at, and at least one prompt token is always left to forward (an
exact hit is served one token short instead of handing mlx-lm's batch engine an empty
prompt, which it refuses).
"""

import copy

from mlx_lm.models.cache import LRUPromptCache

from ..state.reuse import usable_prefix


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
    """The prompt cache ``mlxkv serve`` runs with (``--prompt-cache-size`` entries in memory)."""
    return PromptCache(max_size=args.prompt_cache_size)
