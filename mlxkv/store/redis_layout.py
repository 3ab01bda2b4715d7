"""Where the shared tier's keys live: their names on one Redis server, and on a Redis Cluster.

Both layouts name the same four things (docs/store.md, "The Redis layout"): an entry's
manifest, its pieces and its upload lease, and the block sets that file entry ids under the
chained hash of their first ``i`` blocks. A cluster hashes every key to one of 16,384 slots
and refuses a multi-key command (``MGET``, a script's keys) whose keys are in several, so
:class:`ClusterLayout` puts hash tags (the part of a name between ``{`` and ``}`` is all
that is hashed) in the names:

- an entry's manifest, pieces and lease carry ``{eid}``: they share a slot, so the upload's
  last step (one script giving every key of it the full time to live) and the
  read of a tensor's pieces (one ``MGET``) are legal, and one entry lives on one node;
  different entries spread over the cluster by their ids;
- the block sets of one chain carry ``{h[1]}``, the hash of its first block: a lookup's
  chain (one ``SCARD`` a block, pipelined) asks one node, not every node, and prompts that
  begin differently spread over the nodes.

The block sets are never in a multi-key command with an entry's keys: an upload adds the id
to them (each with the full time to live at once) in a separate pipeline, and a reader
that finds an id without a manifest removes it.
"""

from collections.abc import Sequence

HASH_BYTES = 16  # block hashes in key names: the first 16 bytes, hex


class KeyLayout:
    """Key names on one server (``P:space:...``); the layout of mlxkv's first shared tier,
    unchanged."""

    cluster = False

    def __init__(self, prefix: str = "mlxkv"):
        self.prefix = prefix

    def _tag(self, text: str) -> str:
        return text

    def _k(self, seed: bytes, *parts) -> str:
        return ":".join([self.prefix, seed[:16].hex(), *map(str, parts)])

    def manifest(self, seed: bytes, eid: str) -> str:
        return self._k(seed, "m", self._tag(eid))

    def piece(self, seed: bytes, eid: str, upload: str, i: int) -> str:
        return self._k(seed, "p", self._tag(eid), upload, i)

    def lease(self, seed: bytes, eid: str) -> str:
        return self._k(seed, "lease", self._tag(eid))

    def blocks(self, seed: bytes, chain: Sequence[bytes]) -> list[str]:
        """The block set of each depth of ``chain`` (``h[1] .. h[k]``)."""
        return [self._k(seed, "b", h[:HASH_BYTES].hex()) for h in chain]


class ClusterLayout(KeyLayout):
    """Key names on a Redis Cluster: ``P:space:m:{eid}``, ``P:space:p:{eid}:upload:i``,
    ``P:space:lease:{eid}``, ``P:space:b:{hex(h[1])}:hex(h[i])`` (the module docstring says
    why)."""

    cluster = True

    def _tag(self, text: str) -> str:
        return "{" + text + "}"

    def blocks(self, seed: bytes, chain: Sequence[bytes]) -> list[str]:
        if not chain:
            return []
        root = self._tag(chain[0][:HASH_BYTES].hex())
        return [self._k(seed, "b", root, h[:HASH_BYTES].hex()) for h in chain]
