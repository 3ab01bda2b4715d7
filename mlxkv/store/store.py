"""``PromptStore``: saved prefixes reused across requests, sessions and machines.

Tiers, fastest first, each below RAM optional: RAM (entries with their arrays, a byte cap
that holds, eviction by a retention policy, pinned entries), disk (one snapshot file per
entry, durable after ``flush``), Redis (entries shared by several processes). They share
one interface (``tier.py``): ``take`` asks each in turn for a strictly longer prefix than it
has and lends copies trimmed to the best; ``put`` keeps the entry in RAM, replacing an exact
duplicate and dropping entries it covers, and queues it to each lower tier's own writer.
docs/store.md has the rules.
"""

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..errors import MLXKVError, StoreCapacityError, StoreTrustError
from ..state.checkpoint import read_checkpoint
from ..state.identity import Identity, model_identity
from ..state.reuse import common_prefix, covers
from .disk import DiskTier, OpenReport, check_directory
from .entry import Entry, freeze
from .health import TierUnavailable
from .keys import block_chain, entry_id, identity_seed, scheme_identity
from .queue import Job, WriteQueue
from .ram import RamTier
from .retention import retention_policy
from .tier import Found, Opened, Query, Tier
from .trust import Keys
from .writelog import FlushReport, Outcome, WriteLog

CHECKPOINT_SPACE = "\0checkpoint:"
#: how many candidates of one local tier a take reads before giving up on it (a damaged
#: file is forgotten and the next asked for)
READS_PER_TIER = 4
#: how often a write waits out another process's upload lease before it is reported failed
LEASE_TRIES = 8


@dataclass
class Hit:
    """A prefix found for a prompt: ``caches`` (lent: yours to append to) hold its first
    ``prefix_len`` tokens; forward ``prompt[prefix_len:]``. ``tier``: ram, disk or redis;
    ``attachments``: what was put with the entry (only ever lent with the whole entry)."""

    caches: list
    prefix_len: int
    tier: str = "ram"
    attachments: dict | None = None  # the entry's method companion state (lent whole only)


def checkpoint_space(key: str, cache_ns: str) -> str:
    """The space a generation's checkpoints are filed under: its request key and namespace
    (mlx-bun files them under ``__generation_checkpoint__:<key>`` and checks ``cacheNs``)."""
    return f"{CHECKPOINT_SPACE}{key}:{cache_ns}"


def _checkpoint_space(header: dict) -> str:
    cp = read_checkpoint(header)
    return checkpoint_space(cp.key, cp.cache_ns)


class PromptStore:
    """Saved prefixes of one model (its config fingerprint), tokenizer and cache scheme.

    ``cap``: bytes of RAM the store may hold, entries and writes in flight together (an
    upload to the shared tier may hold one entry more while it runs). ``directory``: the
    disk tier; ``redis``: a Redis or Valkey URL (``redis://host:port/0``,
    ``unix:///path/redis.sock``, a cluster's ``redis+cluster://host:port,host:port``) or a
    ``redis.Redis`` or ``redis.RedisCluster`` client, for the shared tier, whose
    entries are authenticated with ``secret`` (every namespace) or ``namespace_keys``
    (``{ns: key}``, those namespaces only; ``trust.namespace_key``). ``scheme`` and
    ``cache_options`` (``make_cache``'s, e.g. ``max_kv_size``): what the caches are built
    with; the identity names their canonical form (``canonical_scheme``: ``kv4`` and
    ``kv4-g64`` are one scheme), so entries of another never match. ``block_tokens``: the block of the prefix index
    (the shared tier finds entries sharing at least one whole block with a prompt).
    ``disk_cap``: bytes of files the disk tier may keep (least recently used go first);
    None: no limit. ``retention``: which RAM entry goes first, ``"lru"`` or
    ``"cost-size"`` (``retention.py``). ``redis_timeout``: of every Redis socket operation;
    ``redis_budget``: what a take waits for Redis at most; ``redis_lease``: how long an
    upload's lease (and the keys of an unfinished upload) live. ``log_limit``: entries the write
    log lists between flushes (more are counted). ``close_timeout``: what ``close`` waits
    for the writers at most.
    """

    def __init__(
        self,
        model=None,
        tokenizer=None,
        *,
        cap: int,
        directory: str | None = None,
        redis=None,
        scheme: str = "",
        cache_options: dict | None = None,
        block_tokens: int = 64,
        disk_cap: int | None = None,
        redis_prefix: str = "mlxkv",
        redis_ttl: int = 24 * 3600,
        piece_bytes: int = 1 << 20,
        identity: dict | Identity | None = None,
        verify: bool = True,
        retention: str = "lru",
        secret=None,
        namespace_keys: dict | None = None,
        redis_timeout: float = 2.0,
        redis_budget: float = 0.5,
        redis_lease: float = 30.0,
        log_limit: int = 1024,
        close_timeout: float = 30.0,
    ):
        if not isinstance(cap, int) or cap < 0:
            raise MLXKVError(f"cap must be a number of bytes >= 0, got {cap!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise MLXKVError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        keys = Keys(secret, namespace_keys)
        if redis is not None and not keys:
            raise StoreTrustError(
                "the shared tier needs the deployment's secret (secret=, or namespace_keys=): without it any "
                "client of the Redis server could decide what this store serves (docs/store.md, Trust)"
            )
        if directory is not None:
            check_directory(directory)
        self.model = model
        self._codes = (cache_options or {}).get("codes")  # make_cache's read option, for restores
        self._policy = retention_policy(retention)
        self._cap = cap
        self.block = block_tokens
        self.verify = verify
        self.identity = self._identity(model, tokenizer, scheme_identity(scheme, cache_options), identity)
        self._cond = threading.Condition(threading.RLock())
        self._serial = itertools.count(1)
        self._seeds: dict[str, bytes] = {}
        self._ram = RamTier(block_tokens)
        self._disk = None
        self._redis = None
        self.opened = OpenReport()  # what opening the directory found
        self.disk_cap = disk_cap
        self.close_timeout = close_timeout
        if directory is not None:
            sid = identity_seed(self.identity, "", 0)[:8].hex()
            os.makedirs(directory, mode=0o700, exist_ok=True)
            disk = DiskTier(os.path.join(directory, sid), self.identity, block_tokens, self._locate, self._cond)
            disk.model, disk.verify = model, verify
            self.opened = disk.open()
            self._disk = disk
        if redis is not None:
            from .redis_tier import RedisTier

            self._redis = RedisTier(
                redis,
                self.identity,
                block_tokens,
                keys,
                self._seed,
                limit=cap,
                prefix=redis_prefix,
                ttl=redis_ttl,
                piece_bytes=piece_bytes,
                timeout=redis_timeout,
                budget=redis_budget,
                lease_seconds=redis_lease,
            )
        self._lower: list[Tier] = [t for t in (self._disk, self._redis) if t is not None]
        self._tiers: list[Tier] = [self._ram, *self._lower]
        self._queues = {t.name: WriteQueue(t.name, self._cond, self._runner(t), self._recorder(t)) for t in self._lower}
        self._jobs: dict[tuple[str, str], Job] = {}  # (tier, entry key) -> its latest write
        self._log = WriteLog({t.name: t.durable for t in self._lower}, log_limit)
        self._failed: dict[tuple[str, str], int] = {}  # (tier, key) -> serial of the put whose write failed
        self._removed: set[Job] = set()  # running disk writes of removed entries
        self._counts = {"puts": 0, "misses": 0, "reused_tokens": 0}
        self._closed = False

    @staticmethod
    def _identity(model, tokenizer, scheme, given) -> Identity:
        if given is not None:
            given = given if isinstance(given, Identity) else Identity(**given)
        elif model is None:
            raise MLXKVError("a PromptStore needs the model (or identity=...) its entries belong to")
        else:
            given = model_identity(model, tokenizer)
        return given.replace(ns="", kv_scheme=scheme)

    # -- names ----------------------------------------------------------------------------

    def _seed(self, space: str) -> bytes:
        seed = self._seeds.get(space)
        if seed is None:
            seed = self._seeds[space] = identity_seed(self.identity, space, self.block)
        return seed

    def _locate(self, header: dict):
        """(key, space, chain) a checked header's entry is filed under."""
        space = _checkpoint_space(header) if header.get("generationCheckpoint") else header.get("ns", "")
        seed = self._seed(space)
        tokens = header["tokens"]
        chain = [] if space.startswith(CHECKPOINT_SPACE) else block_chain(seed, tokens, self.block)
        return entry_id(seed, tokens), space, chain

    @staticmethod
    def _tokens(tokens) -> list[int]:
        if isinstance(tokens, mx.array):
            tokens = tokens.tolist()
        return [int(t) for t in tokens]

    @staticmethod
    def _check_ns(ns) -> str:
        if not isinstance(ns, str) or ns.startswith("\0"):
            raise MLXKVError(f"ns must be a string (an adapter namespace, '' for the base model), got {ns!r}")
        return ns

    # -- size ------------------------------------------------------------------------------

    @property
    def cap(self) -> int:
        return self._cap

    @cap.setter
    def cap(self, value: int):
        """A new cap applies at once: entries are evicted (oldest use first) to fit it."""
        if not isinstance(value, int) or value < 0:
            raise MLXKVError(f"cap must be a number of bytes >= 0, got {value!r}")
        with self._cond:
            self._cap = value
            if self._redis is not None:
                self._redis.limit = value
            self._make_room(0, wait=True, strict=False)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: its RAM entries and the entries only its writes still hold."""
        with self._cond:
            return self._held()

    def __len__(self):
        return len(self._ram)

    def entries(self) -> list[tuple]:
        """(ns, tokens, nbytes, pinned) of every entry in RAM, least recently used first
        (checkpoints included)."""
        with self._cond:
            return [(e.ns, list(e.tokens), e.nbytes, e.pinned) for e in self._ram.oldest_first()]

    def shrink(self, *, n_bytes: int | None = None, n_entries: int | None = None) -> None:
        """Evict least recently used entries now (never pinned ones, never one still being
        written to disk) until at most ``n_bytes`` are held and ``n_entries`` are in RAM:
        room an engine makes for its active caches. The cap is unchanged."""
        with self._cond:
            while (n_bytes is not None and self._held() > max(0, n_bytes)) or (
                n_entries is not None and len(self._ram) > max(0, n_entries)
            ):
                victim = self._victim()
                if victim is None:
                    break
                self._evict(victim)

    def _held_by_writes(self, durable_only: bool = False) -> int:
        """Bytes of entries that only a write still holds (RAM let them go)."""
        seen, n = set(), 0
        for name, q in self._queues.items():
            if durable_only and not self._tier(name).durable:
                continue
            for j in q.pending():
                e = j.entry
                if id(e) not in seen and self._ram.get(e.key) is not e:
                    seen.add(id(e))
                    n += e.nbytes
        return n

    def _held(self) -> int:
        return self._ram.nbytes + self._held_by_writes()

    def _tier(self, name: str) -> Tier:
        return next(t for t in self._tiers if t.name == name)

    def _writing_durably(self, entry: Entry) -> bool:
        """Is a durable tier (the disk) still to write this entry? RAM keeps it until then."""
        for t in self._lower:
            job = self._jobs.get((t.name, entry.key))
            if t.durable and job is not None and job.entry is entry and job.state in ("queued", "running"):
                return True
        return False

    def _victim(self) -> Entry | None:
        """The entry the retention policy lets go first (never pinned, never one the disk
        has still to write)."""
        return self._policy.victim([e for e in self._ram.entries() if not e.pinned and not self._writing_durably(e)])

    def _evict(self, entry: Entry) -> None:
        self._policy.on_evict(entry)
        self._drop(entry, "evicted")

    def _make_room(self, n: int, wait: bool, strict: bool = True) -> bool:
        """Evict (by the retention policy; never pinned, never an entry the disk has still
        to write) until ``n`` more bytes fit under the cap. Waits for the disk's writer when
        only its unwritten entries are left (``wait``), never for the shared tier's: an
        upload in flight may hold one entry beyond the cap. False if no room can be made."""
        while self._held() + n > self._cap:
            victim = self._victim()
            if victim is not None:
                self._evict(victim)
                continue
            if self._ram.nbytes + self._held_by_writes(durable_only=True) + n <= self._cap:
                return True  # the rest is held by a running upload: it ends by itself
            durable = [q for name, q in self._queues.items() if self._tier(name).durable]
            if wait and any(not q.idle for q in durable):
                self._cond.wait()
                continue
            if strict:
                pinned = sum(e.nbytes for e in self._ram.entries() if e.pinned)
                raise StoreCapacityError(
                    f"no room for {n} bytes under the cap of {self._cap}: pinned entries hold {pinned} "
                    "bytes; unpin some or raise the cap"
                )
            return False
        return True

    # -- putting ---------------------------------------------------------------------------

    def put(self, tokens, caches: Sequence, *, ns: str = "", pin: bool = False, attachments: dict | None = None):
        """Store ``caches`` under the ``tokens`` they encode (their offset must equal the
        number of tokens). The caches stay yours: the store keeps their current state.

        An exact duplicate (same ns and tokens) is replaced; entries this one covers (a
        shorter prefix it can serve at least as well: it can trim, and its reuse floor is no
        higher) are dropped; then entries are evicted until it fits. A pinned entry is never
        evicted nor dropped. Raises :class:`StoreCapacityError` when the entry is larger
        than the cap or pinned entries leave no room for it, :class:`StoreTrustError` when
        the store has a shared tier but no key of ``ns``."""
        self._check_open()
        ns, tokens = self._check_ns(ns), self._tokens(tokens)
        if not tokens:
            raise MLXKVError("put needs the tokens the caches encode; got none")
        if self._redis is not None:
            self._redis.keys.require(ns)
        seed = self._seed(ns)
        entry = freeze(entry_id(seed, tokens), ns, caches, tokens, self.identity, ns, attachments=attachments)
        if entry.nbytes > self._cap:
            raise StoreCapacityError(
                f"an entry of {entry.nbytes} bytes ({len(tokens)} tokens) is larger than the store's cap of "
                f"{self._cap} bytes: raise cap= or store a shorter prefix"
            )
        with self._cond:
            self._admit(entry, block_chain(seed, tokens, self.block), pin)
            self._counts["puts"] += 1

    def put_checkpoint(self, session) -> None:
        """Store a generation checkpoint of ``session`` (its caches, tokens and sampling
        state), filed under its request key and namespace. A longer checkpoint of the same
        request replaces shorter ones; on disk only once its own file is in place."""
        self._check_open()
        ns = self._check_ns(session.ns)
        cp = session.checkpoint()
        tokens = session.tokens
        space = checkpoint_space(cp.key, cp.cache_ns)
        key = entry_id(self._seed(space), tokens)
        entry = freeze(key, space, session.caches, tokens, self.identity, ns, checkpoint=cp.to_header())
        if entry.nbytes > self._cap:
            raise StoreCapacityError(f"a checkpoint of {entry.nbytes} bytes is larger than the cap of {self._cap}")
        with self._cond:
            self._admit(entry, [], False)

    def _admit(self, entry: Entry, chain, pin: bool) -> None:
        old = self._ram.get(entry.key)
        if old is not None:
            pin = pin or old.pinned
            self._drop(old, "replaced")
        for e in self._covered(entry, self._shorter(self._ram, entry, chain)):
            if not e.pinned:
                self._drop(e, "superseded")
        self._make_room(entry.nbytes, wait=True)
        entry.pinned = pin
        entry.serial = next(self._serial)
        self._ram.add(entry, chain)
        self._policy.on_put(entry)
        tiers = [t for t in self._lower if t.durable or entry.checkpoint is None]  # checkpoints stay local
        if not tiers:
            return
        self._log.start(entry.key, entry.ns, entry.tokens, entry.serial, [t.name for t in tiers])
        for t in tiers:
            self._submit(t, entry)

    def _submit(self, tier: Tier, entry: Entry) -> None:
        if not tier.durable and not tier.health.healthy:  # failing: not queued behind it
            tier.health.skipped()
            tier.health.probe_if_due()
            self._log.set(entry.key, entry.serial, tier.name, Outcome.FAILED, self._failure(tier, "is failing"))
            self._failed[(tier.name, entry.key)] = entry.serial
            return
        self._jobs[(tier.name, entry.key)] = self._queues[tier.name].submit(Job(entry))

    @staticmethod
    def _failure(tier: Tier, what) -> str:
        text = what if isinstance(what, str) else f"{type(what).__name__}: {what}"
        return text if tier.durable else f"shared tier: {text}"

    @staticmethod
    def _shorter(tier, entry: Entry, chain) -> list[Entry]:
        """The entries of a local tier that ``entry`` may cover: those whose tokens are a
        prefix of its own, from the index (a put costs its prompt, not the entries); for a
        checkpoint, the tier's checkpoints (they are not indexed)."""
        if entry.checkpoint is not None:
            return [e for e in tier.entries() if e.checkpoint is not None]
        return tier.prefixes(entry, chain)

    @staticmethod
    def _covered(new: Entry, entries) -> list[Entry]:
        """The entries ``new`` makes redundant: prompt entries it covers (``reuse.covers``);
        for a checkpoint, the shorter checkpoints of the same generation and seed."""
        out = []
        n = len(new.tokens)
        for e in entries:
            if e is new or e.space != new.space or len(e.tokens) >= n:
                continue
            if new.checkpoint is not None:
                if common_prefix(new.tokens, e.tokens) == len(e.tokens):
                    out.append(e)
            elif covers(new.tokens, new.reuse, e.tokens, e.reuse):
                out.append(e)
        return out

    def _drop(self, entry: Entry, why: str) -> None:
        """Take ``entry`` out of RAM; its writes that have not started are cancelled (an
        evicted entry's upload: the disk keeps its entries in RAM until written)."""
        self._ram.remove(entry.key)
        for t in self._lower:
            if self._failed.get((t.name, entry.key)) == entry.serial:
                del self._failed[(t.name, entry.key)]  # a failed write is retried only from RAM
            job = self._jobs.get((t.name, entry.key))
            if job is not None and job.entry is entry and self._queues[t.name].cancel(job):
                del self._jobs[(t.name, entry.key)]
                if why == "evicted":
                    message = self._failure(t, "evicted from RAM before it could be written (the tier is slow)")
                    self._log.set(entry.key, entry.serial, t.name, Outcome.FAILED, message)
                else:
                    self._log.set(entry.key, entry.serial, t.name, Outcome.SUPERSEDED)
        self._cond.notify_all()

    def pin(self, tokens, *, ns: str = "") -> None:
        """Never evict the entry of exactly these tokens (it must be in RAM)."""
        self._set_pin(tokens, ns, True)

    def unpin(self, tokens, *, ns: str = "") -> None:
        self._set_pin(tokens, ns, False)

    def _set_pin(self, tokens, ns, value):
        key = entry_id(self._seed(self._check_ns(ns)), self._tokens(tokens))
        with self._cond:
            entry = self._ram.get(key)
            if entry is None:
                raise MLXKVError("no entry of exactly these tokens is in RAM: put it first")
            entry.pinned = value

    def remove(self, tokens, *, ns: str = "") -> bool:
        """Forget the entry of exactly these tokens, in RAM and on disk."""
        key = entry_id(self._seed(self._check_ns(ns)), self._tokens(tokens))
        with self._cond:
            found = False
            entry = self._ram.get(key)
            if entry is not None:
                self._drop(entry, "removed")
                found = True
            if self._disk is not None:
                job = self._jobs.get(("disk", key))
                if job is not None and job.state == "running":
                    self._removed.add(job)  # its file goes as soon as it lands
                if self._disk.remove(key) is not None:
                    found = True
            return found

    # -- taking ----------------------------------------------------------------------------

    def take(self, prompt, *, ns: str = "") -> Hit | None:
        """The longest usable prefix of ``prompt`` over every tier, lent: the caches are new
        and yours; the stored entry stays whole. At least one prompt token is always left
        to forward. None when no entry can serve the prompt. A lower tier is asked only for
        a strictly longer prefix than the tiers above it offer; a tier that is failing is
        skipped (never waited on beyond its budget)."""
        self._check_open()
        ns, prompt = self._check_ns(ns), self._tokens(prompt)
        if len(prompt) < 2:
            return None
        seed = self._seed(ns)
        query = Query(ns, prompt, block_chain(seed, prompt, self.block), seed)
        best, p = None, 0
        for tier in self._tiers:
            if p >= len(prompt) - 1:
                break
            found = self._read(tier, query, p)
            if found is not None:
                best, p = found, found[1]
        if best is None:
            with self._cond:
                self._counts["misses"] += 1
            return None
        entry, p, tier = best
        with self._cond:
            if tier is not self._ram:
                self._promote(entry, block_chain(seed, entry.tokens, self.block))
            if self._ram.get(entry.key) is entry:  # in RAM (or promoted): this lending counts
                self._policy.on_lend(entry, p)
            self._counts["reused_tokens"] += p
        tier.health.count("hits")
        return Hit(self._lent(entry, p), p, tier.name, entry.header.get("attachments"))

    def _lent(self, entry: Entry, p: int) -> list:
        """``entry``'s first ``p`` positions as caches read as the store's model reads them
        (``fit_reads``: a snapshot does not record the read)."""
        caches = entry.lend(p)
        if self.model is None:
            return caches
        from ..caches.schemes import fit_reads

        return fit_reads(self.model, caches, self._codes)

    def _read(self, tier: Tier, query: Query, better: int):
        """(entry, p, tier) of ``tier``'s best prefix longer than ``better``, or None. A
        local tier's damaged candidate is forgotten and the next one asked for; a shared
        tier's failure (down, hung, past its budget) is a miss."""
        for _ in range(READS_PER_TIER if tier.local else 1):
            try:
                if tier.local:
                    with self._cond:
                        found = tier.find(query, better)
                else:
                    found = tier.find(query, better)
                if found is None or found.prefix_len <= better:
                    return None
                entry = tier.read(found)
            except TierUnavailable:
                return None
            except Exception:
                if tier.local:
                    raise
                return None  # counted and logged by the tier's breaker
            if entry is not None:
                return entry, found.prefix_len, tier
        return None

    def _promote(self, entry: Entry, chain) -> None:
        """Keep an entry read from a lower tier in RAM, if it fits without waiting."""
        with self._cond:
            if entry.key in self._ram or entry.nbytes > self._cap:
                return
            if self._make_room(entry.nbytes, wait=False, strict=False):
                self._ram.add(entry, chain)
                self._policy.on_put(entry)

    # -- checkpoints -----------------------------------------------------------------------

    def find_checkpoint(self, prompt_tokens, key: str, *, ns: str = "", **resume):
        """The longest checkpoint of the request ``key`` (``Session.request_key``, or
        ``mlxkv.request_key(prompt, sampler, ...)``) for ``prompt_tokens`` in namespace ``ns``,
        restored as a ``Session`` over lent caches (resuming never changes the stored
        checkpoint), or None. mlx-bun's ``findGenerationCheckpoint`` rule: the key and
        namespace match, the checkpoint's prompt is as long as ``prompt_tokens``, and its
        tokens strictly extend them. ``resume``: ``Session.resume``'s sampler options, for a
        checkpoint that records no sampling state."""
        from ..session import Session

        self._check_open()
        ns, prompt = self._check_ns(ns), self._tokens(prompt_tokens)
        space = checkpoint_space(key, ns)

        def matches(e: Entry):
            return (
                e.checkpoint is not None
                and e.space == space
                and len(e.tokens) > len(prompt)
                and e.tokens[: len(prompt)] == prompt
                and read_checkpoint(e.header).original_prompt_tokens == len(prompt)
            )

        with self._cond:
            found = [e for e in self._ram.entries() if matches(e)]
            if self._disk is not None:
                found += [e for e in self._disk.entries() if matches(e)]
        found.sort(key=lambda e: -len(e.tokens))  # stable: RAM before disk on ties
        for e in found:
            source = e if e.arrays is not None else self._disk.read(Found(len(e.tokens), e))
            if source is None:
                continue
            if e.arrays is None:
                self._promote(source, [])
            caches = self._lent(source, len(source.tokens))
            return Session.resume(self.model, caches, source.header, where="prompt store", **resume)
        return None

    # -- the writers -----------------------------------------------------------------------

    def _runner(self, tier: Tier):
        def run(job: Job):
            """Write one entry to ``tier`` (its writer thread, without the lock)."""
            written = tier.write(job.entry)
            if written.retry_in is None:
                return written
            job.attempts += 1  # another process uploads it: look again when its lease ends
            if job.attempts > LEASE_TRIES:
                raise MLXKVError(f"another process held the upload lease through {LEASE_TRIES} tries")
            job.retry_at = time.monotonic() + written.retry_in
            return None

        return run

    def _recorder(self, tier: Tier):
        def done(job: Job) -> None:
            """Record a finished write (the lock is held)."""
            entry, name = job.entry, tier.name
            if self._jobs.get((name, entry.key)) is job:
                del self._jobs[(name, entry.key)]
            if job.error is not None:
                self._failed[(name, entry.key)] = entry.serial
                if tier.durable:  # a breaker counts the failures of its own calls
                    tier.health.failed(job.error)
                self._log.set(entry.key, entry.serial, name, Outcome.FAILED, self._failure(tier, job.error))
                return
            if job.result is None:  # a lease another process still held when the store closed
                message = self._failure(tier, "another process was uploading it when the store closed")
                self._log.set(entry.key, entry.serial, name, Outcome.FAILED, message)
                return
            self._failed.pop((name, entry.key), None)
            if tier is self._disk:
                self._disk_written(job, job.result.record)
            self._log.set(entry.key, entry.serial, name, Outcome.WRITTEN)

        return done

    def _disk_written(self, job: Job, record: Entry) -> None:
        entry = job.entry
        if job in self._removed:  # removed while it was being written: its file goes now
            self._removed.discard(job)
            with contextlib.suppress(OSError):
                os.unlink(record.extra["path"])
            return
        chain = record.extra["chain"]
        self._disk.add(record)
        # whatever this entry covers goes, now that its own file is in place
        for e in self._covered(entry, self._shorter(self._disk, entry, chain)):
            ram = self._ram.get(e.key)
            if ram is None or not ram.pinned:
                self._disk.remove(e.key)
                self._log.written_away(e.key, "disk", Outcome.SUPERSEDED)
        self._limit_disk(entry.key)

    def _limit_disk(self, keep: str) -> None:
        """Remove least recently used files until the directory is under ``disk_cap``; an
        entry written since the last flush and removed here is reported evicted, not
        durable."""
        if self.disk_cap is None:
            return
        for record in self._disk.oldest_first():
            if self._disk.nbytes <= self.disk_cap:
                break
            ram = self._ram.get(record.key)
            if record.key != keep and (ram is None or not ram.pinned):
                self._disk.remove(record.key)
                self._log.written_away(record.key, "disk", Outcome.EVICTED)

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until every queued write is done (retrying failed writes of entries still in
        RAM, at most ``timeout`` seconds); returns what became of the entries put since the
        previous flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._retry_failed()
            for q in self._queues.values():
                q.wait_idle(deadline)
            return self._log.report()

    def _retry_failed(self) -> None:
        for (name, key), serial in list(self._failed.items()):
            del self._failed[(name, key)]
            entry = self._ram.get(key)
            if entry is None or entry.serial != serial or (name, key) in self._jobs:
                continue  # RAM let it go (or a newer put replaced it): nothing to write again
            tier = self._tier(name)
            if self._log.get(key, serial) is None:
                self._log.start(key, entry.ns, entry.tokens, serial, [name])
            self._log.set(key, serial, name, Outcome.QUEUED)
            self._submit(tier, entry)

    def close(self, timeout: float | None = None) -> FlushReport:
        """Finish the queued writes, at most ``timeout`` seconds (default ``close_timeout``)
        for all tiers together, each on its own writer; release the directory and the
        tiers' threads. Writes not done by then are reported failed (a write a hung tier
        still runs is abandoned to its daemon thread). Returns the last flush report;
        idempotent (an empty report after the first)."""
        timeout = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return FlushReport()
            self._closed = True
            for name in sorted(self._queues, key=lambda n: not self._tier(n).durable):  # the disk first
                for job in self._queues[name].close(deadline):
                    self._jobs.pop((name, job.entry.key), None)
                    message = self._failure(self._tier(name), f"not written: the store closed after {timeout:g} s")
                    self._log.set(job.entry.key, job.entry.serial, name, Outcome.FAILED, message)
            for name, q in self._queues.items():  # a write still running when the time ran out
                for job in q.pending():
                    message = self._failure(
                        self._tier(name), f"still being written when the store closed after {timeout:g} s"
                    )
                    self._log.set(job.entry.key, job.entry.serial, name, Outcome.FAILED, message)
            report = self._log.report()
        for t in self._lower:
            t.close()
        return report

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise MLXKVError("this PromptStore is closed")

    # -- what an operator reads ------------------------------------------------------------

    @property
    def open_report(self) -> list[Opened]:
        """Which tiers opened, where, and how many entries each found (a server's banner)."""
        return [t.opened for t in self._tiers]

    def counters(self) -> dict:
        """The store's counters, for a server to publish: ``puts``, ``misses``,
        ``reused_tokens``, and per tier (``tiers[name]``): ``hits``, ``failures``,
        ``skipped`` (calls not made while it failed), ``refused`` (entries that failed a
        check), ``writes``, ``bytes_read``, ``bytes_written``, ``healthy``,
        ``failing_seconds`` (None while healthy), ``last_error``, ``breaker`` (``"open"``
        or ``"closed"``; the shared tier only), ``entries`` and ``bytes`` held (None where
        not known: the shared tier), ``queued`` (writes waiting). Monotonic counts except
        ``entries``, ``bytes``, ``queued``, ``healthy`` and ``failing_seconds``."""
        with self._cond:
            out = {**self._counts, "bytes": self._held(), "write_log": len(self._log), "tiers": {}}
            for t in self._tiers:
                c = t.health.snapshot()
                c["entries"] = len(t) if t.local else None
                c["bytes"] = t.nbytes if t.local else None
                q = self._queues.get(t.name)
                c["queued"] = len(q.pending()) if q is not None else 0
                out["tiers"][t.name] = c
            return out

    @property
    def stats(self) -> dict:
        """``puts``, ``hits`` per tier, ``misses``, ``reused_tokens`` (``counters()`` has all)."""
        c = self.counters()
        hits = {name: t["hits"] for name, t in c["tiers"].items()}
        return {
            "puts": c["puts"],
            "hits": {"ram": 0, "disk": 0, "redis": 0, **hits},
            "misses": c["misses"],
            "reused_tokens": c["reused_tokens"],
        }
