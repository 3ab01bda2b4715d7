"""The shared tier: entries in Redis (or Valkey), for several serving processes or machines.

An entry is stored as pieces (its tensors' bytes, cut into pieces of at most ``piece_bytes``,
each with its CRC-32) and one small manifest encoded with msgpack (the mlxkv header, the
piece table, the entry's HMAC: ``trust.py``). Each whole block of its tokens files its id
under the chained block hash (``keys.block_chain``, seeded with the identity), which is how
another process finds it. One process uploads a given prefix: the upload holds a lease
(a Redis lock with a timeout, renewed per tensor) and skips an entry whose manifest is
already there; an upload's keys live only ``lease_seconds`` until its last step gives them
all the full time to live at once, so an uploader killed half way leaves nothing that
outlives its lease.

A read trusts nothing it fetches: a manifest larger than ``MAX_MANIFEST`` is not fetched, an
entry larger than what the store may hold (``limit``) is not downloaded, every piece is
checked (length, CRC-32), every tensor's joined bytes against the header's CRC-32, and the
whole entry against its HMAC. A missing or damaged piece makes the entry a miss and its
manifest is deleted (only if it is still the one read); an entry that does not
authenticate is a miss and is left alone. Never a wrong cache.

Every call goes through the tier's breaker (``health.Breaker``): a lookup waits at most
``budget`` seconds for Redis, and none at all while Redis is failing.

One server and a Redis Cluster are the same tier with another client and key layout
(``redis_client.Connection``, ``redis_layout``): every multi-key command here (the pieces
of one tensor, the upload's last step) is on the keys of one entry, which a cluster's
layout puts in one slot; the rest are single-key commands and pipelines, which redis-py
splits by node.

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
from ..formats.mlxkv_header import META_CRC_KEY, META_KEY, check_header
from ..io.safetensors import DTYPES, SafetensorsHeader, TensorInfo, array_buffer, crc32, crc32_hex, dtype_name
from ..state.identity import Identity
from ..state.reuse import prefix_for, probe
from .entry import Entry
from .health import Breaker
from .keys import block_chain, entry_id
from .redis_client import Connection
from .tier import Found, Opened, Query, Tier, Written
from .trust import EntryMac, Keys

MANIFEST_VERSION = 2
BATCH = 16  # manifests read per round trip of a lookup
MAX_CANDIDATES = 64  # manifests read per lookup depth at most
MAX_MANIFEST = 4 << 20  # bytes of one manifest a reader fetches at most
#: what a damaged or foreign manifest raises in ``parse``
MANIFEST_ERRORS = (MLXKVError, ValueError, KeyError, TypeError, msgpack.UnpackException)

# delete a key only while it still holds the value read (another process may have replaced it)
_DELETE_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
#: an upload's last step: every key of one entry (one slot on a cluster) gets the time to live
#: at once. A script, not ``MULTI``/``EXEC``: a script is one command, which redis-py follows
#: through ``ASK`` while its slot migrates; its cluster transactions cannot be (they fail there).
_EXPIRE_ALL = "for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ARGV[1]) end return #KEYS"


class RedisTier(Tier):
    name = "redis"
    local = False

    def __init__(
        self,
        url_or_client,
        identity: Identity,
        block: int,
        keys: Keys,
        seed_of,
        *,
        limit: int,
        prefix: str = "mlxkv",
        ttl: int = 24 * 3600,
        piece_bytes: int = 1 << 20,
        lease_seconds: float = 30.0,
        timeout: float = 2.0,
        budget: float = 0.5,
    ):
        """``limit``: the largest entry a read downloads (the store's cap); ``timeout``: of
        every socket operation (a hung server frees the tier's threads after it);
        ``budget``: what a lookup waits for Redis at most; ``seed_of(space)``: the identity
        seed of a space (``keys.identity_seed``)."""
        self.connection = Connection(url_or_client, timeout, prefix)
        self.layout = self.connection.layout
        self.identity, self.block, self.keys, self._seed_of = identity, block, keys, seed_of
        self.limit = int(limit)
        self.ttl = int(ttl)
        self.piece_bytes, self.lease_seconds = int(piece_bytes), float(lease_seconds)
        where = self.connection.where
        self.health = Breaker("redis", where, self.connection.probe, budget=budget)
        self.opened = Opened("redis", where, None)
        if not self.connection.made:  # a cluster's client learns the slot table: not on a lookup's budget
            self.health.start(lambda: self.connection.client)

    @property
    def client(self):
        return self.connection.client

    def close(self) -> None:
        self.health.close()

    # -- the tier interface ---------------------------------------------------------------

    def find(self, query: Query, better_than: int) -> Found | None:
        if not query.chain or self.keys.key(query.space) is None:
            return None
        found = self.health.call(self._find, query, better_than)
        return None if found is None else Found(found[2], found)

    def read(self, found: Found) -> Entry | None:
        manifest, raw, _, seed, eid = found.record
        data = self.health.call(self._fetch, seed, eid, manifest, raw)
        if data is None:
            return None
        # the arrays are made here, on the caller's thread: the breaker's thread only talks
        # to Redis and checks bytes (it never evaluates MLX arrays beside the model's thread)
        header, buffers = manifest["headerDoc"], data
        arrays = {}
        for cache in header["caches"]:
            for t in cache["tensors"]:
                a = mx.array(buffers.pop(t["name"]))
                arrays[t["name"]] = a.view(mx.bfloat16) if t["dtype"] == "BF16" else a
        mx.eval(list(arrays.values()))
        nbytes = sum(a.nbytes for a in arrays.values())
        self.health.count("bytes_read", nbytes)
        return Entry(eid, header.get("ns", ""), list(header["tokens"]), manifest["reuse"], nbytes, header, arrays)

    def write(self, entry: Entry) -> Written:
        seed = self._seed_of(entry.space)
        return self.health.run(self._upload, entry, seed, block_chain(seed, entry.tokens, self.block))

    def remove(self, key: str) -> None:
        pass  # shared entries expire; one process does not delete what others may use

    # -- writing (the tier's writer thread) -----------------------------------------------

    def _upload(self, entry: Entry, seed: bytes, chain: Sequence[bytes]) -> Written:
        """Upload ``entry`` unless it is there; while another process uploads it (holds its
        lease), a ``Written`` that asks to be retried when the lease ends."""
        key = self.keys.require(entry.space)
        r = self.client
        layout = self.layout
        mkey = layout.manifest(seed, entry.key)
        if r.expire(mkey, self.ttl):
            self._refresh_present(seed, entry.key, chain)
            return Written(present=True)
        lease_ms = int(self.lease_seconds * 1000)
        lease = layout.lease(seed, entry.key)
        lock = r.lock(lease, timeout=self.lease_seconds, blocking=False)
        if not lock.acquire(blocking=False):
            left = r.pttl(lease)
            return Written(retry_in=max(0.05, (left if left and left > 0 else lease_ms) / 1000))
        try:
            if r.exists(mkey):
                return Written(present=True)
            upload = secrets.token_hex(8)
            header = json.loads(json.dumps(entry.header))
            buffers = {}
            for cache in header["caches"]:  # the header first: the HMAC covers it before the pieces
                for t in cache["tensors"]:
                    a = entry.arrays[t["name"]]
                    buf = buffers[t["name"]] = memoryview(array_buffer(a)).cast("B")
                    t["dtype"], t["shape"], t["crc32"] = dtype_name(a), list(a.shape), crc32_hex(buf)
            text = json.dumps(header, separators=(",", ":"), ensure_ascii=True)
            mac = EntryMac(key, seed[:16].hex(), entry.key, upload, text)
            table, written, i = [], [], 0
            for cache in header["caches"]:
                for t in cache["tensors"]:
                    buf = buffers[t["name"]]
                    pipe = r.pipeline(transaction=False)
                    for start in range(0, max(len(buf), 1), self.piece_bytes):
                        piece = bytes(buf[start : start + self.piece_bytes])
                        pkey = layout.piece(seed, entry.key, upload, i)
                        pipe.set(pkey, piece, px=lease_ms)  # the full time to live once complete
                        table.append([t["name"], len(piece), crc32(piece) & 0xFFFFFFFF])
                        mac.piece(t["name"], piece)
                        written.append(pkey)
                        i += 1
                    pipe.execute()  # one tensor's pieces at a time
                    lock.extend(self.lease_seconds, replace_ttl=True)
            del buffers
            manifest = {
                "v": MANIFEST_VERSION,
                "header": text,
                "headerCrc32": crc32_hex(text.encode()),
                "upload": upload,
                "pieceBytes": self.piece_bytes,
                "pieces": table,
                "mac": mac.hexdigest(),
            }
            r.set(mkey, msgpack.packb(manifest), px=lease_ms)  # after its pieces: never ahead of them
            # then the block sets (on a cluster, other nodes: a pipeline across nodes keeps no
            # order, and an id a reader finds before its manifest is removed from the set)
            pipe = r.pipeline(transaction=False)
            for b in layout.blocks(seed, chain):
                pipe.sadd(b, entry.key)
                pipe.expire(b, self.ttl)
            pipe.execute()
            r.register_script(_EXPIRE_ALL)(keys=[*written, mkey], args=[self.ttl])  # the upload is complete
            nbytes = sum(n for _, n, _ in table)
            self.health.count("writes")
            self.health.count("bytes_written", nbytes)
            return Written(nbytes=nbytes)
        finally:
            with contextlib.suppress(redis.exceptions.LockError, redis.exceptions.RedisError):
                lock.release()

    def _refresh_present(self, seed, eid, chain):
        """An entry found present lives another time to live: its pieces and block sets with
        its manifest, or the pieces would expire under a live manifest (a miss later)."""
        keys = self.layout.blocks(seed, chain)
        raw = self.client.get(self.layout.manifest(seed, eid))
        if raw is not None:
            with contextlib.suppress(*MANIFEST_ERRORS):  # damaged: the next read drops it
                m = self.parse(raw)
                keys += [self.layout.piece(seed, eid, m["upload"], i) for i in range(len(m["pieces"]))]
        self._expire(keys)

    def _expire(self, keys):
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.expire(k, self.ttl)
        pipe.execute()

    # -- reading --------------------------------------------------------------------------

    def _find(self, query: Query, better_than: int):
        """(manifest, raw manifest, p, seed, eid) of the longest usable prefix longer than
        ``better_than`` among the entries sharing a whole block with the prompt, or None.
        Reads manifests only, each at most MAX_MANIFEST bytes, at most MAX_CANDIDATES a
        depth."""
        seed, prompt, chain = query.seed, query.prompt, query.chain
        blocks = self.layout.blocks(seed, chain)  # on a cluster, all in one slot
        pipe = self.client.pipeline(transaction=False)
        for b in blocks:
            pipe.scard(b)
        cards = pipe.execute()
        best, best_p = None, better_than
        limit = len(prompt) - 1
        seen = set()
        for depth in range(len(cards), 0, -1):
            if not cards[depth - 1]:
                continue
            bound = min(limit, (depth + 1) * self.block - 1)  # for every entry first met here
            if bound <= best_p:
                break
            bkey = blocks[depth - 1]
            if cards[depth - 1] > MAX_CANDIDATES:  # a popular prefix, or a flooded set: a sample
                members = self.client.srandmember(bkey, MAX_CANDIDATES)
            else:
                members = self.client.smembers(bkey)
            ids = sorted(i for i in (m.decode(errors="replace") for m in members) if i not in seen)[:MAX_CANDIDATES]
            seen.update(ids)
            for start in range(0, len(ids), BATCH):
                batch = ids[start : start + BATCH]
                mkeys = [self.layout.manifest(seed, i) for i in batch]
                pipe = self.client.pipeline(transaction=False)
                for k in mkeys:
                    pipe.strlen(k)
                sizes = pipe.execute()
                gone = [i for i, n in zip(batch, sizes) if not n]
                if gone:  # expired or evicted: forget them here too
                    self.client.srem(bkey, *gone)
                fetch = [(i, k) for i, k, n in zip(batch, mkeys, sizes) if 0 < n <= MAX_MANIFEST]
                if len(fetch) < len(batch) - len(gone):
                    self.health.count("refused", len(batch) - len(gone) - len(fetch))
                pipe = self.client.pipeline(transaction=False)  # on a cluster, each on its own slot
                for _, k in fetch:
                    pipe.get(k)
                raws = pipe.execute() if fetch else []
                for (eid, _), raw in zip(fetch, raws):
                    if raw is None:
                        continue
                    try:
                        manifest = self.parse(raw, query.space)
                    except MANIFEST_ERRORS as e:
                        self.health.refuse(f"a shared manifest was refused: {type(e).__name__}: {e}")
                        continue
                    tokens = manifest["headerDoc"]["tokens"]
                    if entry_id(seed, tokens) != eid or manifest["nbytes"] > self.limit:
                        self.health.count("refused")  # filed under another id, or larger than the store
                        continue
                    p = prefix_for(tokens, manifest["reuse"], prompt, 0)
                    if p is not None and p > best_p:
                        best, best_p = (manifest, raw, p, seed, eid), p
                if best_p >= bound:
                    break
        return best

    def parse(self, raw: bytes, space: str | None = None) -> dict:
        """A manifest, checked: its version, header checksum, header (every check of a
        snapshot header), identity, namespace and piece table."""
        m = msgpack.unpackb(raw, raw=False)
        if not isinstance(m, dict) or m.get("v") != MANIFEST_VERSION:
            raise SnapshotError(f"not a version {MANIFEST_VERSION} mlxkv manifest")
        text = m["header"]
        if not isinstance(text, str) or not isinstance(m["mac"], str) or not isinstance(m["upload"], str):
            raise SnapshotError("a malformed manifest")
        tensors = {}
        doc = json.loads(text)
        for cache in doc.get("caches", []):
            for t in cache.get("tensors", []):
                tensors[t["name"]] = TensorInfo(t["name"], t["dtype"], list(t["shape"]), 0, 0)
        st = SafetensorsHeader("redis manifest", {META_KEY: text, META_CRC_KEY: m["headerCrc32"]}, tensors, 0, 0)
        header = check_header(st)
        if not self.identity.serves(header):
            raise SnapshotError("a manifest of another identity")
        if space is not None and header.get("ns", "") != space:
            raise SnapshotError("a manifest of another namespace")
        sizes = {}
        for name, n, c in m["pieces"]:
            if name not in tensors or not isinstance(n, int) or not isinstance(c, int) or n < 0:
                raise SnapshotError("a malformed piece table")
            sizes[name] = sizes.get(name, 0) + n
        total = 0
        for name, info in tensors.items():
            want = int(np.prod(info.shape, dtype=np.int64)) * np.dtype(DTYPES[info.dtype][1]).itemsize
            if sizes.get(name, 0) != want:
                raise SnapshotError(f"the pieces of {name} hold {sizes.get(name, 0)} bytes, not {want}")
            total += want
        m["headerDoc"] = header
        m["reuse"] = probe(header)
        m["nbytes"] = total
        return m

    def _fetch(self, seed: bytes, eid: str, manifest: dict, raw: bytes) -> dict | None:
        """The entry's tensors as numpy arrays by name, every piece, tensor and the HMAC
        verified; None (and the manifest deleted when a piece is missing or damaged)
        otherwise. One tensor's pieces are fetched at a time."""
        header = manifest["headerDoc"]
        upload = manifest["upload"]
        ns_key = self.keys.key(header.get("ns", ""))
        if ns_key is None:
            return None
        by_tensor: dict[str, list] = {}
        for i, (name, size, c) in enumerate(manifest["pieces"]):
            by_tensor.setdefault(name, []).append((i, size, c))
        mac = EntryMac(ns_key, seed[:16].hex(), eid, upload, manifest["header"])
        arrays, damaged = {}, None
        for cache in header["caches"]:
            for t in cache["tensors"]:
                table = by_tensor.get(t["name"], [])
                keys = [self.layout.piece(seed, eid, upload, i) for i, _, _ in table]
                got = self.client.mget(keys) if keys else []  # one slot on a cluster
                running = 0
                for p, (_, size, c) in zip(got, table):
                    if p is None or len(p) != size or (crc32(p) & 0xFFFFFFFF) != c:
                        damaged = "a piece is missing or damaged"
                        break
                    running = crc32(p, running)
                    mac.piece(t["name"], p)
                if damaged is None and f"{running & 0xFFFFFFFF:08x}" != t["crc32"]:
                    damaged = f"the bytes of {t['name']} do not match the header's crc32"
                if damaged is not None:
                    break
                np_dtype = DTYPES[t["dtype"]][1]
                arrays[t["name"]] = np.frombuffer(b"".join(got), dtype=np_dtype).reshape(t["shape"])
                del got
            if damaged is not None:
                break
        if damaged is not None:
            self.health.refuse(f"a shared entry was damaged or partly evicted ({damaged}): a miss")
            self.client.register_script(_DELETE_IF_SAME)(keys=[self.layout.manifest(seed, eid)], args=[raw])
            return None
        if not mac.matches(manifest["mac"]):
            self.health.refuse("a shared entry failed authentication (written without this deployment's secret)")
            return None
        keys = [self.layout.piece(seed, eid, upload, i) for i in range(len(manifest["pieces"]))]
        blocks = self.layout.blocks(seed, block_chain(seed, header["tokens"], self.block))
        self._expire([self.layout.manifest(seed, eid), *keys, *blocks])  # read: another time to live
        return arrays
