"""``kv:batched-tova:<budget>:<nSink>``: batched rows of TOVA caches."""

from dataclasses import dataclass

from ..caches.tova import TOVAKVCache
from ..math.tova import tova_evict
from .eviction import BatchedEvictionCache, EvictionRows


@dataclass(frozen=True)
class TOVARows(EvictionRows):
    def empty(self):
        return TOVAKVCache(self.budget, self.n_sink)

    @staticmethod
    def batch_class():
        return BatchedTOVACache

    def read(self, row):
        if row.keys is None:
            return None, None, 0, {}
        return (row.keys, row.positions[..., None]), (row.values,), row.keys.shape[2], {}

    def restore(self, keys, values, offset, count, dtype, extras):
        row = self.empty()
        return row if keys is None else row.adopt(keys[0], values[0], keys[1][..., 0], offset)


def tova_rows(row) -> TOVARows:
    return TOVARows(row.budget, row.n_sink)


class BatchedTOVACache(BatchedEvictionCache):
    def _evicting(self):
        return self.cols.counts > self.fmt.budget

    def _kept(self, rows, R):
        (k, pos), (v,) = self._stored(rows, R)
        k, v, pos = tova_evict(k, v, pos[..., 0], self.fmt.budget, self.fmt.n_sink)
        return (k, pos[..., None]), (v,)
