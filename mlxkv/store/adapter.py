"""A prompt store in place of mlx-lm's ``LRUPromptCache`` (``mlx_lm.server``): the one object
a server builds from its store options, opens when the model loads, and reads its counters
from.

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

A server gives it :class:`StoreOptions` (checked when made, before any model loads) and
calls ``bind(model, tokenizer)`` once the model is loaded (the entries are keyed by the
model's fingerprint and tokenizer), ``close()`` when it stops; ``open_report`` and
``counters()`` are what its banner and metrics show. Until ``bind`` it holds nothing: a
fetch misses, an insert is dropped.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import MLXKVError
from .disk import check_directory
from .keys import scheme_identity
from .store import PromptStore
from .trust import Keys


@dataclass
class StoreOptions:
    """How a server's prompt store opens: RAM ``cap`` (bytes), the ``directory`` of the disk
    tier and its ``disk_cap``, the ``redis`` URL of the shared tier and the deployment's
    ``secret`` its entries are authenticated with, the cache ``scheme`` and
    ``cache_options`` (part of the entries' identity). Every value is checked when the
    options are made, so a server refuses a bad flag before it loads a model."""

    cap: int
    directory: str | None = None
    redis: str | None = None
    secret: str | bytes | None = None
    scheme: str = ""
    cache_options: dict | None = None
    disk_cap: int | None = None

    def __post_init__(self):
        if not isinstance(self.cap, int) or self.cap < 0:
            raise MLXKVError(f"the prompt store's byte cap must be >= 0, got {self.cap!r}")
        if self.disk_cap is not None and (not isinstance(self.disk_cap, int) or self.disk_cap < 0):
            raise MLXKVError(f"the store directory's byte cap must be >= 0, got {self.disk_cap!r}")
        scheme_identity(self.scheme, self.cache_options)  # a scheme make_cache cannot build: now
        if self.directory is not None:
            check_directory(self.directory)
        if self.redis is not None:
            from .redis_client import check_url

            check_url(self.redis)  # the URL's form only (one server's or a cluster's): nothing is sent
            if not Keys(self.secret):
                raise MLXKVError(
                    "--redis needs the deployment's secret, shared by every server of it (at least 16 bytes; "
                    "MLXKV_STORE_SECRET): shared entries are authenticated with it (docs/store.md, Trust)"
                )

    def open(self, model, tokenizer) -> PromptStore:
        return PromptStore(
            model,
            tokenizer,
            cap=self.cap,
            directory=self.directory,
            redis=self.redis,
            secret=self.secret if self.redis is not None else None,
            scheme=self.scheme,
            cache_options=self.cache_options,
            disk_cap=self.disk_cap,
        )


class StorePromptCache:
    def __init__(self, store: PromptStore | None = None, *, options: StoreOptions | None = None, ns_of=None):
        """Over an open ``store``, or one opened from ``options`` at each ``bind``.
        ``ns_of(model_key) -> str``: the namespace of a model key (default: its adapter
        path, the second element of mlx-lm's ``(model, adapter, draft)`` key, or "")."""
        self.store = store
        self.options = options
        self._ns_of = ns_of or _adapter_ns
        self._types: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.refused = 0

    # -- the server's life -----------------------------------------------------------------

    def bind(self, model, tokenizer) -> None:
        """Open the store of the model just loaded (closing the previous model's)."""
        if self.options is None:
            raise MLXKVError("this StorePromptCache was made over an open store: it has no options to open another")
        store = self.options.open(model, tokenizer)
        with self._lock:
            old, self.store = self.store, store
        if old is not None:
            old.close()

    def close(self, timeout: float | None = None):
        """Write what is queued (to the directory and Redis; at most ``timeout`` seconds) and
        release the store; returns its last ``FlushReport`` (None when none was open)."""
        with self._lock:
            store, self.store = self.store, None
        return None if store is None else store.close(timeout)

    @property
    def open_report(self) -> list:
        """Which tiers opened, where, with how many entries (``PromptStore.open_report``)."""
        store = self.store
        return [] if store is None else store.open_report

    def counters(self) -> dict:
        """``PromptStore.counters()`` and ``refused_inserts`` (empty before ``bind``)."""
        store = self.store
        return {} if store is None else {**store.counters(), "refused_inserts": self.refused}

    # -- mlx-lm's interface -----------------------------------------------------------------

    def fetch_nearest_cache(self, model, tokens: Sequence[int]):
        store = self.store
        if store is None:
            return None, list(tokens)
        hit = store.take(tokens, ns=self._ns_of(model))
        if hit is None:
            return None, list(tokens)
        return hit.caches, list(tokens[hit.prefix_len :])

    def insert_cache(self, model, tokens: Sequence[int], prompt_cache: list, *, cache_type: str = "assistant"):
        store = self.store
        if store is None:
            return
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
            store.put(tokens, prompt_cache, ns=ns)
        except MLXKVError:  # not cacheable (refused, unknown kind, too large): the request stands
            self.refused += 1
            return
        self._types[(ns, tuple(tokens))] = cache_type

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None):
        store = self.store
        if store is not None:
            store.shrink(n_bytes=n_bytes, n_entries=n_sequences)

    def __len__(self):
        store = self.store
        return 0 if store is None else len(store)

    @property
    def nbytes(self) -> int:
        store = self.store
        return 0 if store is None else store.nbytes

    @property
    def max_bytes(self) -> int:
        store = self.store
        return 0 if store is None else store.cap

    def stats_by_type(self) -> dict:
        store = self.store
        if store is None:
            return {}
        held = {(ns, tuple(tokens)): nbytes for ns, tokens, nbytes, _ in store.entries()}
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
