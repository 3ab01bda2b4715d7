"""``TOVAKVCache`` (``kv:tova:<budget>:<nSink>``): memoryless current-step eviction.

After every appended token, if more than ``budget`` rows are stored, the incoming key is the
proxy query: ``softmax(K_stored_and_new . k / sqrt(D))`` in float32 over every stored row and
itself; the first ``n_sink`` rows are protected and the row with the lowest weight is dropped
(ties to the lowest index). No score survives a step. This runs per (batch, head) and token
by token inside a prefill block exactly as in decode; the tokens of a block that fit under
the budget are appended in one op, and only tokens that trigger an eviction enter the loop.
"""

import mlx.core as mx

from ..errors import CacheConfigError
from ..families import Scheme
from ..math.tova import tova_evict
from . import names
from .eviction import EvictionKVCache, check_budget


class TOVAKVCache(EvictionKVCache):
    """TOVA-adapted (key-as-query proxy): at most ``budget`` rows after every step, the first
    ``n_sink`` rows never evicted. Memoryless: the cache holds no score."""

    kind_prefix = names.TOVA_KIND_PREFIX

    def __init__(self, budget: int = 512, n_sink: int = 4):
        check_budget(budget, n_sink, "TOVA")
        if n_sink >= budget:
            raise CacheConfigError(
                f"TOVA: n_sink={n_sink} must be below budget={budget}, or no row could ever be evicted"
            )
        super().__init__(budget, n_sink)

    @property
    def kind(self) -> str:
        return f"{self.kind_prefix}{self.budget}:{self.n_sink}"

    def _admit(self, keys, values, positions, n_new: int):
        self.keys, self.values, self.positions = tova_evict(keys, values, positions, self.budget, self.n_sink)

    def adopt(self, keys: mx.array, values: mx.array, positions: mx.array, offset: int) -> "TOVAKVCache":
        """Restore kept rows exactly (position-exact: no slack)."""
        if keys.shape[2] > self.budget:
            raise CacheConfigError(f"{self.kind}: {keys.shape[2]} rows exceed the budget {self.budget}")
        self._adopt_rows(keys, values, positions, offset)
        return self

    def __repr__(self):
        return f"TOVAKVCache(kind={self.kind!r}, offset={self.offset}, rows={self.rows})"


def tova_scheme(m, options):
    """``tova-b<budget>-s<nSink>``: every full-attention layer gets a TOVA cache."""
    budget, n_sink = int(m["budget"]), int(m["sink"])
    TOVAKVCache(budget, n_sink)  # validate now, not at the first layer
    return Scheme(f"tova-b{budget}-s{n_sink}", lambda i, o: TOVAKVCache(budget, n_sink), False)
