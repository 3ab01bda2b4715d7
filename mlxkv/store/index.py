"""Candidate lookup for a prompt: which entries may share its longest prefix.

Each entry is filed under the chained hashes of its whole blocks (``keys.block_chain``) and
under its first token. For a prompt, the entries filed under its deepest chain hash share at
least that many whole blocks with it; an entry first met at depth ``d`` shares fewer than
``(d + 1) * block`` tokens. Candidates come out deepest first with that upper bound, so a
caller computing exact prefixes stops as soon as no candidate left can beat its best. A
prompt sharing less than one block with every entry falls back to the entries that start
with its first token. Nothing here is exact: the caller compares tokens.
"""

from collections import defaultdict
from collections.abc import Iterator, Sequence


class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self._by_hash: dict[bytes, set] = defaultdict(set)
        self._by_first: dict[tuple, set] = defaultdict(set)
        self._filed: dict = {}  # key -> (hashes, first-token key, length)

    def __len__(self):
        return len(self._filed)

    def __contains__(self, key):
        return key in self._filed

    def add(self, key, space: str, tokens: Sequence[int], chain: Sequence[bytes]) -> None:
        self.remove(key)
        first = (space, tokens[0]) if tokens else None
        for h in chain:
            self._by_hash[h].add(key)
        if first is not None:
            self._by_first[first].add(key)
        self._filed[key] = (list(chain), first, len(tokens))

    def remove(self, key) -> None:
        filed = self._filed.pop(key, None)
        if filed is None:
            return
        chain, first, _ = filed
        for h in chain:
            self._drop(self._by_hash, h, key)
        if first is not None:
            self._drop(self._by_first, first, key)

    @staticmethod
    def _drop(table, k, key):
        s = table.get(k)
        if s is not None:
            s.discard(key)
            if not s:
                del table[k]

    def candidates(self, space: str, prompt: Sequence[int], chain: Sequence[bytes]) -> Iterator[tuple]:
        """(key, depth, bound), bounds falling: the entry shares at least ``depth * block``
        tokens with the prompt (by hash) and at most ``bound``. (An entry filed at depth d
        holds at least d whole blocks, so its bound is at least ``d * block``, above every
        bound of depth d - 1.)"""
        if not prompt:
            return
        depth = 0
        while depth < len(chain) and chain[depth] in self._by_hash:
            depth += 1
        seen = set()
        for d in range(depth, -1, -1):
            keys = self._by_hash[chain[d - 1]] if d else self._by_first.get((space, prompt[0]), ())
            group = []
            for key in keys:
                if key not in seen:
                    seen.add(key)
                    group.append((key, d, min((d + 1) * self.block - 1, self._filed[key][2])))
            group.sort(key=lambda c: (-c[2], c[0]))  # by key on ties: the same in every process
            yield from group


def best_prefix(index: PrefixIndex, space: str, prompt: Sequence[int], chain: Sequence[bytes], usable) -> tuple:
    """(key, p) of the longest usable prefix, or (None, 0). ``usable(key, start)`` gives the
    exact usable prefix of one entry (None if unusable); ties go to the first found."""
    best_key, best = None, 0
    limit = len(prompt) - 1
    for key, depth, bound in index.candidates(space, prompt, chain):
        if min(bound, limit) <= best:  # bounds only fall from here on
            break
        p = usable(key, depth * index.block)
        if p is not None and p > best:
            best_key, best = key, p
    return best_key, best
