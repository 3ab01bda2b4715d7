"""A prompt store in place of mlx-lm's ``LRUPromptCache`` (``mlx_lm.server``).

mlx-lm's server calls ``fetch_nearest_cache(model_key, tokens) -> (cache, rest)`` before a
request, ``insert_cache(model_key, tokens, cache, cache_type=...)`` after it (and at segment
ends), ``trim_to(n_bytes=...)`` to make room for the active batch, and reads ``len()``,
``nbytes`` and ``stats_by_type()`` for its log. :class:`StorePromptCache` answers all of them
from a :class:`PromptStore`:

- a fetch is a ``take``: the store's longest usable prefix, lent, with at least one token
  left to forward (mlx-lm's own cache returns an exact match with nothing left);
- an insert is a ``put`` under the tokens the caches really cover (mlx-lm passes the
  generated tokens too; the caches may cover one fewer), never failing the request: an
  insert the store refuses is dropped and counted in ``refused``;
- the model key's adapter path is the store namespace.
"""

from collections.abc import Sequence

from ..errors import MLXKVError


class StorePromptCache:
    def __init__(self, store, ns_of=None):
        """``ns_of(model_key) -> str``: the namespace of a model key (default: its adapter
        path, the second element of mlx-lm's ``(model, adapter, draft)`` key, or "")."""
        self.store = store
        self._ns_of = ns_of or _adapter_ns
        self._types: dict[tuple, str] = {}
        self.refused = 0

    # -- mlx-lm's interface -----------------------------------------------------------------

    def fetch_nearest_cache(self, model, tokens: Sequence[int]):
        hit = self.store.take(tokens, ns=self._ns_of(model))
        if hit is None:
            return None, list(tokens)
        return hit.caches, list(tokens[hit.prefix_len :])

    def insert_cache(self, model, tokens: Sequence[int], prompt_cache: list, *, cache_type: str = "assistant"):
        ns = self._ns_of(model)
        tokens = [int(t) for t in tokens]
        try:
            offset = prompt_cache[0].offset
            if offset < len(tokens):
                tokens = tokens[:offset]
            elif offset > len(tokens):
                if not all(c.is_trimmable() for c in prompt_cache):
                    raise MLXKVError("the caches cover tokens the server did not pass")
                for c in prompt_cache:
                    c.trim(offset - len(tokens))
            self.store.put(tokens, prompt_cache, ns=ns)
        except MLXKVError:  # not cacheable (refused, unknown kind, too large): the request stands
            self.refused += 1
            return
        self._types[(ns, tuple(tokens))] = cache_type

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None):
        self.store.shrink(n_bytes=n_bytes, n_entries=n_sequences)

    def __len__(self):
        return len(self.store)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def max_bytes(self) -> int:
        return self.store.cap

    def stats_by_type(self) -> dict:
        held = {(ns, tuple(tokens)): nbytes for ns, tokens, nbytes, _ in self.store.entries()}
        self._types = {k: t for k, t in self._types.items() if k in held}
        out = {t: {"n_sequences": 0, "n_bytes": 0} for t in ("assistant", "user", "system")}
        for key, nbytes in held.items():
            stats = out.setdefault(self._types.get(key, "assistant"), {"n_sequences": 0, "n_bytes": 0})
            stats["n_sequences"] += 1
            stats["n_bytes"] += nbytes
        return out


def _adapter_ns(model_key) -> str:
    if isinstance(model_key, tuple) and len(model_key) > 1 and model_key[1]:
        return str(model_key[1])
    return ""
