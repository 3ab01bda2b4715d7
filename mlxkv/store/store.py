"""``PromptStore``: saved prefixes reused across requests, sessions and machines.

Tiers, each optional below RAM: RAM (entries with their arrays, a byte cap that holds, LRU
eviction, pinned entries), disk (one snapshot file per entry, written behind a queue, durable
after ``flush``), Redis (entries shared by several processes). ``take`` finds the longest
usable prefix over every tier (RAM first; a lower tier only when it offers a strictly longer
one) and lends copies trimmed to it; ``put`` stores caches under the tokens they encode,
replacing an exact duplicate and dropping entries it covers. docs/store.md has the rules.
"""

import contextlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import MLXKVError, SnapshotError, StoreCapacityError
from ..state.checkpoint import read_checkpoint
from ..state.identity import model_identity, tokenizer_hash
from ..state.reuse import common_prefix, covers
from .disk import DiskTier, OpenReport
from .entry import Entry, freeze
from .keys import block_chain, entry_id, identity_seed
from .queue import Job, WriteQueue
from .ram import RamTier
from .retention import retention_policy

CHECKPOINT_SPACE = "\0checkpoint:"


@dataclass
class Hit:
    """A prefix found for a prompt: ``caches`` (lent: yours to append to) hold its first
    ``prefix_len`` tokens; forward ``prompt[prefix_len:]``. ``tier``: ram, disk or redis;
    ``attachments``: what was put with the entry (only ever lent with the whole entry)."""

    caches: list
    prefix_len: int
    tier: str = "ram"
    attachments: dict | None = None  # the entry's method companion state (lent whole only)


@dataclass
class FlushReport:
    """What became of the entries put since the previous flush, each as (ns, tokens).

    ``durable``: on disk (file and directory fsync'd); ``superseded``: dropped before they
    were written, because an entry that covers them replaced them; ``failed``: the write
    failed (the message says why; a later flush tries again while the entry is in RAM);
    ``uploaded``: in the shared tier (present there counts)."""

    durable: list = field(default_factory=list)
    superseded: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (ns, tokens, message)
    uploaded: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def checkpoint_space(key: str, cache_ns: str) -> str:
    """The space a generation's checkpoints are filed under: its request key and namespace
    (mlx-bun files them under ``__generation_checkpoint__:<key>`` and checks ``cacheNs``)."""
    return f"{CHECKPOINT_SPACE}{key}:{cache_ns}"


def _checkpoint_space(header: dict) -> str:
    cp = read_checkpoint(header)
    return checkpoint_space(cp.key, cp.cache_ns)


class PromptStore:
    """Saved prefixes of one model (its config fingerprint), tokenizer and cache scheme.

    ``cap``: bytes of RAM the store may hold, entries and writes in flight together.
    ``directory``: the disk tier; ``redis``: a Redis or Valkey URL (``redis://host:port/0``,
    ``unix:///path/redis.sock``) or a ``redis.Redis`` client, for the shared tier.
    ``scheme``: the cache scheme the caches are built with (entries of another never match).
    ``block_tokens``: the block of the prefix index (the shared tier finds entries sharing
    at least one whole block with a prompt). ``disk_cap``: bytes of files the disk tier may
    keep (least recently used go first); None: no limit. ``retention``: which RAM entry goes
    first, ``"lru"`` or ``"cost-size"`` (``retention.py``).
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
        block_tokens: int = 64,
        disk_cap: int | None = None,
        redis_prefix: str = "mlxkv",
        redis_ttl: int = 24 * 3600,
        piece_bytes: int = 1 << 20,
        identity: dict | Identity | None = None,
        verify: bool = True,
        retention: str = "lru",
    ):
        if not isinstance(cap, int) or cap < 0:
            raise MLXKVError(f"cap must be a number of bytes >= 0, got {cap!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise MLXKVError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        self.model = model
        self._policy = retention_policy(retention)
        self._cap = cap
        self.block = block_tokens
        self.verify = verify
        self.identity = self._identity(model, tokenizer, scheme, identity)
        self._cond = threading.Condition(threading.RLock())
        self._ram = RamTier(block_tokens)
        self._seeds: dict[str, bytes] = {}
        self._jobs: dict[str, Job] = {}  # entry key -> its latest write
        self._log: dict[str, dict] = {}  # entry key -> what became of it since the last flush
        self._failed: dict[str, Entry] = {}
        self._removed: set[Job] = set()  # running writes of removed entries
        self.stats = {"puts": 0, "hits": {"ram": 0, "disk": 0, "redis": 0}, "misses": 0, "reused_tokens": 0}
        self._closed = False
        self.disk_cap = disk_cap
        self._disk = None
        self.opened = OpenReport()
        if directory is not None:
            sid = identity_seed(self.identity, "", 0)[:8].hex()
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self._disk = DiskTier(os.path.join(directory, sid), self.identity, block_tokens, self._locate)
            self.opened = self._disk.open()
        self._redis = None
        if redis is not None:
            from .redis_tier import RedisTier

            self._redis = RedisTier(
                redis, self.identity, block_tokens, prefix=redis_prefix, ttl=redis_ttl, piece_bytes=piece_bytes
            )
        lower = self._disk is not None or self._redis is not None
        self._queue = WriteQueue(self._cond, self._run, self._done) if lower else None

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
        written) until at most ``n_bytes`` are held and ``n_entries`` are in RAM: room an
        engine makes for its active caches. The cap is unchanged."""
        with self._cond:
            while (n_bytes is not None and self._held() > max(0, n_bytes)) or (
                n_entries is not None and len(self._ram) > max(0, n_entries)
            ):
                victim = self._victim()
                if victim is None:
                    break
                self._evict(victim)

    def _queued_only(self) -> int:
        if self._queue is None:
            return 0
        return sum(j.entry.nbytes for j in self._queue.pending() if self._ram.get(j.entry.key) is not j.entry)

    def _held(self) -> int:
        return self._ram.nbytes + self._queued_only()

    def _pending(self, entry: Entry) -> bool:
        job = self._jobs.get(entry.key)
        return job is not None and job.entry is entry and job.state in ("queued", "running")

    def _victim(self) -> Entry | None:
        """The entry the retention policy lets go first (never pinned, never being written)."""
        return self._policy.victim([e for e in self._ram.entries() if not e.pinned and not self._pending(e)])

    def _evict(self, entry: Entry) -> None:
        self._policy.on_evict(entry)
        self._drop(entry, "evicted")

    def _make_room(self, n: int, wait: bool, strict: bool = True) -> bool:
        """Evict (least recently used first; never pinned, never an entry still being
        written) until ``n`` more bytes fit under the cap. Waits for the writer when only
        unwritten entries are left (``wait``); False if no room can be made."""
        while self._held() + n > self._cap:
            victim = self._victim()
            if victim is not None:
                self._evict(victim)
                continue
            if wait and self._queue is not None and not self._queue.idle:
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
        higher) are dropped; then the least recently used entries are evicted until it fits.
        A pinned entry is never evicted nor dropped. Raises :class:`StoreCapacityError` when
        the entry is larger than the cap or pinned entries leave no room for it."""
        self._check_open()
        ns, tokens = self._check_ns(ns), self._tokens(tokens)
        if not tokens:
            raise MLXKVError("put needs the tokens the caches encode; got none")
        seed = self._seed(ns)
        entry = freeze(entry_id(seed, tokens), ns, caches, tokens, self.identity, ns, attachments=attachments)
        if entry.nbytes > self._cap:
            raise StoreCapacityError(
                f"an entry of {entry.nbytes} bytes ({len(tokens)} tokens) is larger than the store's cap of "
                f"{self._cap} bytes: raise cap= or store a shorter prefix"
            )
        with self._cond:
            self._admit(entry, block_chain(seed, tokens, self.block), pin)
            self.stats["puts"] += 1

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
        for e in self._covered(entry, self._ram.entries()):
            if not e.pinned:
                self._drop(e, "superseded")
        self._make_room(entry.nbytes, wait=True)
        entry.pinned = pin
        self._ram.add(entry, chain)
        self._policy.on_put(entry)
        self._log[entry.key] = {"entry": entry, "status": "volatile", "message": "", "uploaded": False}
        if self._queue is not None:
            self._jobs[entry.key] = self._queue.submit(Job(entry))
            self._log[entry.key]["status"] = "queued"

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
        """Take ``entry`` out of RAM; a write of it that has not started is cancelled."""
        self._ram.remove(entry.key)
        job = self._jobs.get(entry.key)
        if job is not None and job.entry is entry and self._queue.cancel(job):
            del self._jobs[entry.key]
            log = self._log.get(entry.key)
            if log is not None and log["entry"] is entry:
                log["status"] = "superseded"
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
            job = self._jobs.get(key)
            if job is not None and job.state == "running":
                self._removed.add(job)  # its file goes as soon as it lands
            if self._disk is not None and self._disk.remove(key) is not None:
                found = True
            return found

    # -- taking ----------------------------------------------------------------------------

    def take(self, prompt, *, ns: str = "") -> Hit | None:
        """The longest usable prefix of ``prompt`` over every tier, lent: the caches are new
        and yours; the stored entry stays whole. At least one prompt token is always left
        to forward. None when no entry can serve the prompt."""
        self._check_open()
        ns, prompt = self._check_ns(ns), self._tokens(prompt)
        if len(prompt) < 2:
            return None
        seed = self._seed(ns)
        chain = block_chain(seed, prompt, self.block)
        with self._cond:
            entry, p = self._ram.find(ns, prompt, chain)
            if entry is not None:
                self._ram.touch(entry.key)
                self._policy.on_lend(entry, p)
        hit = None
        if entry is not None:
            hit = (entry, p, "ram")
        while self._disk is not None and p < len(prompt) - 1:
            with self._cond:
                record, pd = self._disk.find(ns, prompt, chain)
            if record is None or pd <= p:
                break
            loaded = self._read_disk(record)
            if loaded is not None:
                self._promote(loaded, chain)
                hit, p = (loaded, pd, "disk"), pd
                break
        if self._redis is not None and p < len(prompt) - 1:
            hit, p = self._take_shared(seed, prompt, chain, hit, p)
        if hit is None:
            self.stats["misses"] += 1
            return None
        source, p, tier = hit
        if tier != "ram":
            with self._cond:
                if self._ram.get(source.key) is source:  # promoted: this lending counts
                    self._policy.on_lend(source, p)
        self.stats["hits"][tier] += 1
        self.stats["reused_tokens"] += p
        return Hit(source.lend(p), p, tier, source.header.get("attachments"))

    def _take_shared(self, seed, prompt, chain, hit, p):
        try:
            manifest, raw, pr = self._redis.find(seed, prompt, chain, better_than=p)
            if manifest is None:
                return hit, p
            eid = entry_id(seed, manifest["headerDoc"]["tokens"])
            fetched = self._redis.fetch(seed, eid, manifest, raw)
        except Exception:  # the shared tier is a cache: when it is down, it is a miss
            return hit, p
        if fetched is None:
            return hit, p
        self._promote(fetched, block_chain(seed, fetched.tokens, self.block))
        return (fetched, pr, "redis"), pr

    def _read_disk(self, record: Entry) -> Entry | None:
        try:
            return self._disk.read(record, self.model, verify=self.verify)
        except SnapshotError:
            with self._cond:
                if self._disk.get(record.key) is record:
                    self._disk.remove(record.key, delete=False)
                    if os.path.exists(record.extra["path"]):
                        self._disk.quarantine(record.extra["path"])
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
        from ..state.session import Session

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
            source = e if e.arrays is not None else self._read_disk(e)
            if source is None:
                continue
            if e.arrays is None:
                self._promote(source, [])
            caches = source.lend(len(source.tokens))
            return Session.resume(self.model, caches, source.header, where="prompt store", **resume)
        return None

    # -- the writer ------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        """Write one entry to the lower tiers (the writer thread, without the lock)."""
        entry = job.entry
        if self._disk is not None:
            try:
                job.result["disk"] = self._disk.write(entry)
            except Exception as e:
                job.result["disk"] = e
        if self._redis is not None and entry.checkpoint is None:
            try:
                seed = self._seed(entry.space)
                job.result["redis"] = self._redis.upload(entry, seed, block_chain(seed, entry.tokens, self.block))
            except Exception as e:
                job.result["redis"] = e

    def _done(self, job: Job) -> None:
        """Record a finished write (the lock is held)."""
        entry = job.entry
        if self._jobs.get(entry.key) is job:
            del self._jobs[entry.key]
        log = self._log.get(entry.key)
        if log is not None and log["entry"] is not entry:
            log = None  # a newer entry of the same key is logged
        disk = job.result.get("disk")
        if job.error is not None:
            disk = job.error
        if isinstance(disk, Entry) and job in self._removed:
            self._removed.discard(job)
            with contextlib.suppress(OSError):
                os.unlink(disk.extra["path"])
        elif isinstance(disk, Entry):
            self._disk.add(disk)
            self._failed.pop(entry.key, None)
            # whatever this entry covers goes, now that its own file is in place
            for e in self._covered(entry, self._disk.entries()):
                ram = self._ram.get(e.key)
                if ram is None or not ram.pinned:
                    self._disk.remove(e.key)
            self._limit_disk(entry.key)
            if log is not None:
                log["status"] = "durable"
        elif isinstance(disk, BaseException):
            self._failed[entry.key] = entry
            if log is not None:
                log["status"], log["message"] = "failed", f"{type(disk).__name__}: {disk}"
        shared = job.result.get("redis")
        if log is not None and shared in ("uploaded", "present"):
            log["uploaded"] = True
        elif log is not None and isinstance(shared, BaseException) and self._disk is None:
            log["status"], log["message"] = "failed", f"shared tier: {type(shared).__name__}: {shared}"

    def _limit_disk(self, keep: str) -> None:
        if self.disk_cap is None:
            return
        for record in self._disk.oldest_first():
            if self._disk.nbytes <= self.disk_cap:
                break
            ram = self._ram.get(record.key)
            if record.key != keep and (ram is None or not ram.pinned):
                self._disk.remove(record.key)

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until every queued write is done (retrying failed writes of entries still in
        RAM); returns what became of the entries put since the previous flush."""
        with self._cond:
            if self._queue is not None:
                for key, entry in list(self._failed.items()):
                    if self._ram.get(key) is entry and key not in self._jobs:
                        self._jobs[key] = self._queue.submit(Job(entry))
                        self._log[key] = {"entry": entry, "status": "queued", "message": "", "uploaded": False}
                    del self._failed[key]
                self._queue.wait_idle(timeout)
            report = FlushReport()
            for log in self._log.values():
                item = (log["entry"].ns, list(log["entry"].tokens))
                if log["status"] == "durable":
                    report.durable.append(item)
                elif log["status"] == "superseded":
                    report.superseded.append(item)
                elif log["status"] == "failed":
                    report.failed.append((*item, log["message"]))
                if log["uploaded"]:
                    report.uploaded.append(item)
            self._log = {k: v for k, v in self._log.items() if v["status"] == "queued"}  # still running (timeout)
            return report

    def close(self) -> None:
        """Finish the queued writes and release the directory. Idempotent."""
        with self._cond:
            if self._closed:
                return
            if self._queue is not None:
                self._queue.close()
            self._closed = True
        if self._disk is not None:
            self._disk.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise MLXKVError("this PromptStore is closed")
