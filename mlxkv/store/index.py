"""The prefix index of a tier in this process: which entry shares the longest prefix with a
prompt, in time that grows with the prompt, not with the number of entries.

Each entry is filed at every depth ``d`` from 0 to its number of whole blocks: at depth 0
under its space, at depth ``d >= 1`` under the chained hash of its first ``d`` blocks
(``keys.block_chain``). Within such a node, entries are kept sorted by their next block of
tokens (``tokens[d*B:(d+1)*B]`` as big-endian uint32 bytes, so byte order is token order).

For a prompt, the deepest node its own chain reaches holds exactly the entries sharing the
most whole blocks with it (``D``); among them, the one sharing the longest part of the next
block sits next to where the prompt's next block would be inserted, and walking outward from
there (both sides, longest shared part first) visits the others in falling order of shared
prefix. Each step knows the exact shared prefix (``D*B`` plus the shared part of the block),
so the walk stops as soon as no entry left can do better than the best usable one: a lookup
costs the prompt's chain, one binary search and a few steps. Only when no entry of the
deepest node is usable (a recurrent cache that cannot trim to the shared prefix) does it go
on, and then one node up (the entries sharing one block fewer), and so on.
"""

import bisect
from collections.abc import Callable, Sequence

import numpy as np


def block_key(tokens: Sequence[int]) -> bytes:
    """Tokens as big-endian uint32 bytes: their byte order is their token order."""
    return np.asarray(tokens, dtype=">u4").tobytes() if len(tokens) else b""


def shared_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two block keys share."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return (n - (x.bit_length() + 7) // 8) // 4


class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self._nodes: dict[object, list[tuple[bytes, str]]] = {}
        self._filed: dict[str, tuple[list, int]] = {}  # key -> ([(node, block key)], length)

    def __len__(self):
        return len(self._filed)

    def __contains__(self, key):
        return key in self._filed

    def add(self, key: str, space: str, tokens: Sequence[int], chain: Sequence[bytes]) -> None:
        self.remove(key)
        raw = block_key(tokens)
        step = 4 * self.block
        filed = []
        for d, node in enumerate([("space", space), *chain]):
            item = (raw[d * step : (d + 1) * step], key)
            bisect.insort(self._nodes.setdefault(node, []), item)
            filed.append((node, item[0]))
        self._filed[key] = (filed, len(tokens))

    def remove(self, key: str) -> None:
        filed = self._filed.pop(key, None)
        if filed is None:
            return
        for node, bkey in filed[0]:
            items = self._nodes[node]
            i = bisect.bisect_left(items, (bkey, key))
            del items[i]
            if not items:
                del self._nodes[node]

    def length(self, key: str) -> int:
        return self._filed[key][1]

    def prefixes(self, space: str, tokens: Sequence[int], chain: Sequence[bytes]) -> list[str]:
        """Keys of the entries whose tokens are a prefix of ``tokens`` (of any length up to
        all of them): at each node along ``tokens``' chain, the entries whose next block is
        exactly a head of ``tokens``' next block and that end there. At most ``block``
        binary searches a node: what a put costs to find the entries it covers."""
        raw = block_key(tokens)
        step = 4 * self.block
        out = []
        for d, node in enumerate([("space", space), *chain]):
            items = self._nodes.get(node)
            if not items:
                break  # an entry filed deeper is filed here too
            q = raw[d * step : (d + 1) * step]
            for j in range(1 if d == 0 else 0, min(len(q) // 4, self.block - 1) + 1):
                head = q[: 4 * j]  # an entry ending after exactly d*B + j tokens has this next block
                i = bisect.bisect_left(items, (head,))
                while i < len(items) and items[i][0] == head:
                    if self._filed[items[i][1]][1] == d * self.block + j:
                        out.append(items[i][1])
                    i += 1
        return out

    def best(
        self, space: str, prompt: Sequence[int], chain: Sequence[bytes], usable: Callable[[str, int], bool], better=0
    ) -> tuple[str | None, int]:
        """(key, p) of the longest usable prefix longer than ``better``, or (None, 0).
        ``usable(key, p)``: may the entry serve its first ``p`` positions (``p`` is already
        at most ``len(prompt) - 1`` and the shared prefix)? Ties go to the entry first met."""
        limit = len(prompt) - 1
        if limit < 1:
            return None, 0
        nodes = [("space", space), *chain]
        depth = 0
        while depth + 1 < len(nodes) and nodes[depth + 1] in self._nodes:
            depth += 1
        raw = block_key(prompt)
        step = 4 * self.block
        best_key, best = None, better
        for d in range(depth, -1, -1):
            if min(limit, (d + 1) * self.block - 1) <= best:  # nothing found here can do better
                break
            items = self._nodes.get(nodes[d])
            if not items:
                continue
            q = raw[d * step : (d + 1) * step]
            deeper = d < depth  # entries sharing this node's next block were seen one node down
            for key, shared in _outward(items, q):
                if deeper and shared == self.block:
                    continue
                p = min(limit, d * self.block + shared, self._filed[key][1])
                if p <= best:
                    break  # the walk only falls from here
                if usable(key, p):
                    best_key, best = key, p
                    break
        return best_key, (best if best_key is not None else 0)


def _outward(items: list[tuple[bytes, str]], q: bytes):
    """(key, shared tokens) of a node's entries in falling order of what they share with
    ``q``, walking out from where ``q`` would be inserted."""
    right = bisect.bisect_left(items, (q,))
    left = right - 1
    sl = shared_tokens(items[left][0], q) if left >= 0 else -1
    sr = shared_tokens(items[right][0], q) if right < len(items) else -1
    while sl >= 0 or sr >= 0:
        if sr >= sl:
            yield items[right][1], sr
            right += 1
            sr = shared_tokens(items[right][0], q) if right < len(items) else -1
        else:
            yield items[left][1], sl
            left -= 1
            sl = shared_tokens(items[left][0], q) if left >= 0 else -1
