"""The shared tier: entries in Redis (or Valkey), for several serving processes or machines.

An entry is stored as pieces (its tensors' bytes, cut into pieces of at most ``piece_bytes``,
each with its CRC-32) and one small manifest encoded with msgpack (the mlxkv header, the
piece table). Each whole block of its tokens files its id under the chained block hash
(``keys.block_chain``, seeded with the identity), which is how another process finds it.
One process uploads a given prefix: the upload holds a lease (a Redis lock with a timeout)
and skips an entry whose manifest is already there. Every piece is verified on read; a
piece Redis evicted or expired, or one whose checksum differs, makes the entry a miss and
its manifest is deleted (only if it is still the one read), never a wrong cache.

Key names and encodings are normative for other implementations (docs/store.md, "Redis
layout"). Every key has a time to live, refreshed when an entry is read.
"""

import contextlib
import json
import secrets
from collections.abc import Sequence

import mlx.core as mx
import msgpack
import numpy as np
import redis

from ..errors import MLXKVError, SnapshotError
from ..io.safetensors import DTYPES, SafetensorsHeader, TensorInfo, array_buffer, crc32, crc32_hex, dtype_name
from ..state.reuse import prefix_for, probe
from ..state.snapshot import META_CRC_KEY, META_KEY, parse_header
from .entry import Entry
from .keys import block_chain

MANIFEST_VERSION = 1
HASH_BYTES = 16  # block hashes in key names: the first 16 bytes, hex
BATCH = 16  # manifests read per round trip of a lookup
MAX_CANDIDATES = 64  # manifests read per lookup depth at most
#: what a damaged or foreign manifest raises in ``parse``
MANIFEST_ERRORS = (MLXKVError, ValueError, KeyError, TypeError, msgpack.UnpackException)

# delete a key only while it still holds the value read (another process may have replaced it)
_DELETE_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class RedisTier:
    def __init__(
        self,
        url_or_client,
        identity: Identity,
        block: int,
        *,
        prefix: str = "mlxkv",
        ttl: int = 24 * 3600,
        piece_bytes: int = 1 << 20,
        lease_seconds: float = 60.0,
        timeout: float = 10.0,
    ):
        if isinstance(url_or_client, str):  # a hung server must not hang a put: time out
            self.client = redis.Redis.from_url(url_or_client, socket_timeout=timeout, socket_connect_timeout=timeout)
        else:
            self.client = url_or_client
        self.identity, self.block = identity, block
        self.prefix, self.ttl = prefix, int(ttl)
        self.piece_bytes, self.lease_seconds = int(piece_bytes), lease_seconds
        self._delete_if_same = self.client.register_script(_DELETE_IF_SAME)

    # -- key names ----------------------------------------------------------------------

    def _k(self, seed: bytes, *parts) -> str:
        return ":".join([self.prefix, seed[:16].hex(), *map(str, parts)])

    def manifest_key(self, seed: bytes, eid: str) -> str:
        return self._k(seed, "m", eid)

    def piece_key(self, seed: bytes, eid: str, upload: str, i: int) -> str:
        return self._k(seed, "p", eid, upload, i)

    def block_key(self, seed: bytes, h: bytes) -> str:
        return self._k(seed, "b", h[:HASH_BYTES].hex())

    def lease_key(self, seed: bytes, eid: str) -> str:
        return self._k(seed, "lease", eid)

    # -- writing (the store's writer thread) ---------------------------------------------

    def upload(self, entry: Entry, seed: bytes, chain: Sequence[bytes]) -> str:
        """Upload ``entry`` unless it is there or another process is uploading it; returns
        "uploaded", "present" or "leased"."""
        r = self.client
        mkey = self.manifest_key(seed, entry.key)
        if r.expire(mkey, self.ttl):
            self._refresh_present(seed, entry.key, chain)
            return "present"
        lock = r.lock(self.lease_key(seed, entry.key), timeout=self.lease_seconds, blocking=False)
        if not lock.acquire(blocking=False):
            return "leased"
        try:
            if r.exists(mkey):
                return "present"
            upload = secrets.token_hex(8)
            header = json.loads(json.dumps(entry.header))
            pieces, i = [], 0
            for cache in header["caches"]:
                for t in cache["tensors"]:
                    a = entry.arrays[t["name"]]
                    buf = array_buffer(a)
                    t["dtype"], t["shape"], t["crc32"] = dtype_name(a), list(a.shape), crc32_hex(buf)
                    pipe = r.pipeline(transaction=False)
                    for start in range(0, max(len(buf), 1), self.piece_bytes):
                        piece = bytes(buf[start : start + self.piece_bytes])
                        pipe.set(self.piece_key(seed, entry.key, upload, i), piece, ex=self.ttl)
                        pieces.append([t["name"], len(piece), crc32(piece) & 0xFFFFFFFF])
                        i += 1
                    pipe.execute()  # one tensor's pieces at a time: bounded transient memory
                    del buf
            text = json.dumps(header, separators=(",", ":"), ensure_ascii=True)
            manifest = {
                "v": MANIFEST_VERSION,
                "header": text,
                "headerCrc32": crc32_hex(text.encode()),
                "upload": upload,
                "pieceBytes": self.piece_bytes,
                "pieces": pieces,
            }
            pipe = r.pipeline(transaction=False)
            pipe.set(mkey, msgpack.packb(manifest), ex=self.ttl)  # after its pieces: never ahead of them
            for h in chain:
                pipe.sadd(self.block_key(seed, h), entry.key)
                pipe.expire(self.block_key(seed, h), self.ttl)
            pipe.execute()
            return "uploaded"
        finally:
            with contextlib.suppress(redis.exceptions.LockError):  # the lease timed out meanwhile
                lock.release()

    def _refresh_present(self, seed, eid, chain):
        """An entry found present lives another time to live: its pieces and block sets with
        its manifest, or the pieces would expire under a live manifest (a miss later)."""
        keys = [self.block_key(seed, h) for h in chain]
        raw = self.client.get(self.manifest_key(seed, eid))
        if raw is not None:
            with contextlib.suppress(*MANIFEST_ERRORS):  # damaged: the next read drops it
                m = self.parse(raw)
                keys += [self.piece_key(seed, eid, m["upload"], i) for i in range(len(m["pieces"]))]
        self._expire(keys)

    def _expire(self, keys):
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.expire(k, self.ttl)
        pipe.execute()

    # -- reading --------------------------------------------------------------------------

    def find(self, seed: bytes, prompt: Sequence[int], chain: Sequence[bytes], better_than: int) -> tuple:
        """(manifest, raw manifest, p) of the longest usable prefix longer than
        ``better_than`` among the entries sharing a whole block with ``prompt``, or
        (None, None, 0). Reads manifests only."""
        if not chain:
            return None, None, 0
        pipe = self.client.pipeline(transaction=False)
        for h in chain:
            pipe.smembers(self.block_key(seed, h))
        members = pipe.execute()
        best, best_raw, best_p, seen = None, None, better_than, set()
        limit = len(prompt) - 1
        for depth in range(len(members), 0, -1):
            ids = [i for i in (m.decode() for m in members[depth - 1]) if i not in seen]
            if not ids:
                continue
            bound = min(limit, (depth + 1) * self.block - 1)  # for every entry first met here
            if bound <= best_p:
                break
            seen.update(ids)
            # a popular prefix (a system prompt) files many entries: read their manifests a
            # batch at a time, stop at the depth's bound, and at most MAX_CANDIDATES of them
            for start in range(0, min(len(ids), MAX_CANDIDATES), BATCH):
                batch = ids[start : start + BATCH]
                raws = self.client.mget([self.manifest_key(seed, i) for i in batch])
                gone = [i for i, raw in zip(batch, raws) if raw is None]
                if gone:  # expired or evicted: forget them here too
                    self.client.srem(self.block_key(seed, chain[depth - 1]), *gone)
                for raw in raws:
                    if raw is None:
                        continue
                    try:
                        manifest = self.parse(raw)
                    except MANIFEST_ERRORS:
                        continue
                    p = prefix_for(manifest["headerDoc"]["tokens"], manifest["reuse"], prompt, 0)
                    if p is not None and p > best_p:
                        best, best_raw, best_p = manifest, raw, p
                if best_p >= bound:
                    break
        return (best, best_raw, best_p) if best is not None else (None, None, 0)

    def parse(self, raw: bytes) -> dict:
        """A manifest, checked: its version, header checksum, header (every check of a
        snapshot header), identity and piece table."""
        m = msgpack.unpackb(raw, raw=False)
        if not isinstance(m, dict) or m.get("v") != MANIFEST_VERSION:
            raise SnapshotError(f"not a version {MANIFEST_VERSION} mlxkv manifest")
        text = m["header"]
        tensors = {}
        doc = json.loads(text)
        for cache in doc.get("caches", []):
            for t in cache.get("tensors", []):
                tensors[t["name"]] = TensorInfo(t["name"], t["dtype"], list(t["shape"]), 0, 0)
        st = SafetensorsHeader("redis manifest", {META_KEY: text, META_CRC_KEY: m["headerCrc32"]}, tensors, 0, 0)
        header = check_header(st)
        if not self.identity.serves(header):
            raise SnapshotError("a manifest of another identity")
        sizes = {}
        for name, n, c in m["pieces"]:
            if name not in tensors or not isinstance(n, int) or not isinstance(c, int):
                raise SnapshotError("a malformed piece table")
            sizes[name] = sizes.get(name, 0) + n
        for name, info in tensors.items():
            want = int(np.prod(info.shape, dtype=np.int64)) * np.dtype(DTYPES[info.dtype][1]).itemsize
            if sizes.get(name, 0) != want:
                raise SnapshotError(f"the pieces of {name} hold {sizes.get(name, 0)} bytes, not {want}")
        m["headerDoc"] = header
        m["reuse"] = probe(header)
        return m

    def fetch(self, seed: bytes, eid: str, manifest: dict, raw: bytes) -> Entry | None:
        """The entry with its arrays, every piece verified; None (and the manifest deleted)
        when a piece is missing or damaged."""
        n = len(manifest["pieces"])
        keys = [self.piece_key(seed, eid, manifest["upload"], i) for i in range(n)]
        pieces = self.client.mget(keys) if keys else []
        ok = all(
            p is not None and len(p) == size and (crc32(p) & 0xFFFFFFFF) == c
            for p, (_, size, c) in zip(pieces, manifest["pieces"])
        )
        if not ok:
            self._delete_if_same(keys=[self.manifest_key(seed, eid)], args=[raw])
            return None
        header = manifest["headerDoc"]
        blocks = [self.block_key(seed, h) for h in block_chain(seed, header["tokens"], self.block)]
        self._expire([self.manifest_key(seed, eid), *keys, *blocks])  # read: another time to live
        joined: dict[str, list[bytes]] = {}
        for p, (name, _, _) in zip(pieces, manifest["pieces"]):
            joined.setdefault(name, []).append(p)
        arrays = {}
        for cache in header["caches"]:
            for t in cache["tensors"]:
                mx_dtype, np_dtype = DTYPES[t["dtype"]]
                data = np.frombuffer(b"".join(joined.get(t["name"], [])), dtype=np_dtype).reshape(t["shape"])
                a = mx.array(data)
                arrays[t["name"]] = a.view(mx.bfloat16) if t["dtype"] == "BF16" else a
        mx.eval(list(arrays.values()))
        nbytes = sum(a.nbytes for a in arrays.values())
        return Entry(eid, header.get("ns", ""), list(header["tokens"]), manifest["reuse"], nbytes, header, arrays)
