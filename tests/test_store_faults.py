"""The shared tier in operation, against a real redis-server (a private unix socket): a hung
server (SIGSTOP) never holds a lookup or a put beyond its budget, is skipped while it hangs,
logged once, and used again when it answers; an uploader killed mid-upload (SIGKILL) leaves
nothing that outlives its lease and no entry neither uploaded nor failed; a shutdown with
Redis hung is bounded and leaves the disk's entries durable; entries are authenticated
(another secret, a rewritten header, another tenant's key: misses), every read bounded by
what the store may hold, the joined bytes checked against the header's CRC-32 (these on
one server and on a real Redis Cluster too)."""

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import zlib

import msgpack
import pytest
from store_helpers import LocalCluster, RedisServer, build, masters_of, settled

from mlxkv import PromptStore, StoreTrustError
from mlxkv.models.seeded import prompt, tokenizer
from mlxkv.store import namespace_key
from mlxkv.store.entry import Entry
from mlxkv.store.keys import block_chain, entry_id, identity_seed
from mlxkv.store.trust import EntryMac

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16
CAP = 64 << 20
SECRET = "a-test-deployment-secret"


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    if s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)
    s.stop()


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    yield c
    c.stop()


@pytest.fixture(params=["server", "cluster"])
def shared(request):
    """The trust tests' shared tier: a redis-server of their own, or the module's Redis
    Cluster, emptied (one tier, two key layouts: the same rules)."""
    if request.param == "server":
        s = RedisServer()
        yield s
        s.stop()
    else:
        c = request.getfixturevalue("cluster")
        c.flushall()
        yield c


def _store(model, server, **kw):
    kw.setdefault("secret", SECRET)
    kw.setdefault("cap", CAP)
    return settled(PromptStore(model, tokenizer(), redis=server.url, block_tokens=BLOCK, **kw))


def _upload(model, server, tokens, **kw):
    with _store(model, server, **kw) as s:
        s.put(tokens, build(model, "bf16", {}, tokens, 64))
        return s.flush()


def _manifest(r, store, tokens, ns=""):
    seed = identity_seed(store.identity, ns, BLOCK)
    key = store._redis.layout.manifest(seed, entry_id(seed, tokens))
    return key, msgpack.unpackb(r.get(key))


def test_a_hung_redis_costs_one_budget_then_nothing(models, server, tmp_path, caplog):
    """SIGSTOP: the first take waits the read budget, later ones skip the tier at once; puts
    never wait; one warning says so, one line says when it answers again, and takes are
    served from Redis again."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    _upload(model, server, tokens)
    caplog.set_level(logging.WARNING, logger="mlxkv.store")
    store = _store(model, server, directory=str(tmp_path / "d"), redis_budget=0.3, redis_timeout=1.0)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        times = []
        for i in range(20):
            t = time.perf_counter()
            assert store.take(tokens + [i + 1]) is None  # not in RAM nor on disk; Redis hangs
            times.append(time.perf_counter() - t)
        assert times[0] < 0.3 + 0.25 and max(times[1:]) < 0.05, times
        caches = build(model, "bf16", {}, prompt(40, seed=2), 40)
        t = time.perf_counter()
        for i in range(5):
            store.put(prompt(40, seed=10 + i), caches)
        assert time.perf_counter() - t < 0.5
        c = store.counters()["tiers"]["redis"]
        assert not c["healthy"] and c["skipped"] >= 19 and c["failures"] >= 1
        failing = [r for r in caplog.records if "redis tier" in r.getMessage() and "failing" in r.getMessage()]
        assert len(failing) == 1, [r.getMessage() for r in caplog.records]
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    hit = None
    while hit is None and time.monotonic() < deadline:  # the breaker probes, then closes
        time.sleep(0.2)
        hit = store.take(tokens + [99])
    assert hit is not None and hit.tier == "redis" and hit.prefix_len == 40
    assert any("recovered" in r.getMessage() for r in caplog.records)
    assert store.counters()["tiers"]["redis"]["healthy"]
    store.close()


def test_shutdown_with_redis_hung_is_bounded_and_the_disk_writes_land(models, server, tmp_path):
    """Each tier has its own writer: uploads stuck behind a stopped Redis do not hold the
    disk's writes, and close() returns within its timeout with every entry on disk."""
    model = models("llama")
    store = _store(model, server, directory=str(tmp_path / "d"), redis_timeout=5.0)
    os.kill(server.proc.pid, signal.SIGSTOP)
    entries = [prompt(40, seed=s) for s in range(4)]
    for t in entries:
        store.put(t, build(model, "bf16", {}, t, 40))
    t0 = time.perf_counter()
    report = store.close(timeout=1.5)
    took = time.perf_counter() - t0
    assert took < 2.5, took
    assert sorted(map(tuple, (t for _, t in report.durable))) == sorted(map(tuple, entries))
    os.kill(server.proc.pid, signal.SIGCONT)
    with PromptStore(model, tokenizer(), cap=CAP, directory=str(tmp_path / "d"), block_tokens=BLOCK) as again:
        assert again.opened.indexed == 4


def test_redis_killed_mid_run_is_a_miss_logged_and_puts_stay_bounded(models, tmp_path):
    """SIGKILL: takes are misses, puts are reported failed (no disk tier), and the store keeps
    no entry alive for a retry once RAM let it go."""
    server = RedisServer()
    model = models("llama")
    store = _store(model, server, cap=400_000)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    caches = build(model, "bf16", {}, prompt(40, seed=3), 40)
    for s in range(30):
        store.put(prompt(40, seed=100 + s), caches)
    report = store.flush(timeout=10)
    assert len(report.failed) == 30 and all("shared tier" in m for *_, m in report.failed)
    gc.collect()
    mine = {tuple(prompt(40, seed=100 + s)) for s in range(30)}
    live = [o for o in gc.get_objects() if isinstance(o, Entry) and o.arrays is not None and tuple(o.tokens) in mine]
    assert len(live) <= len(store) + 1, f"{len(live)} entries alive, {len(store)} in RAM"
    assert len(store._failed) <= len(store)  # nor a record of each failure, once RAM let it go
    store.close(timeout=2)
    server.stop()


KILLED = r"""
import sys, time
import mlx.core as mx
from mlxkv import PromptStore, make_cache
from mlxkv.models.seeded import build_model, prompt, tokenizer
from mlxkv.store import redis_tier
model = build_model("llama")
tokens = prompt(200, seed=41)
caches = make_cache(model, "bf16")
model(mx.array([tokens]), cache=caches)
slow = redis_tier.RedisTier._upload
def crawl(self, entry, seed, chain):
    real = self.client.pipeline
    def pipeline(*a, **k):
        p = real(*a, **k)
        execute = p.execute
        def slowly():
            out = execute()
            print("piece", flush=True)
            time.sleep(0.5)
            return out
        p.execute = slowly
        return p
    self.client.pipeline = pipeline
    return slow(self, entry, seed, chain)
redis_tier.RedisTier._upload = crawl
store = PromptStore(model, tokenizer(), cap=64 << 20, redis=sys.argv[1], block_tokens=16, secret=sys.argv[2],
                    redis_lease=float(sys.argv[3]), piece_bytes=4096)
store.put(tokens, caches)
store.flush()
"""


def test_an_uploader_killed_mid_upload_leaves_nothing_that_outlives_its_lease(models, server):
    """A process killed half way through an upload holds the lease and has written some
    pieces: every key it wrote expires with its lease (no piece with a day to live), and
    another process putting the same entry waits the lease out and uploads it itself: its
    flush reports it uploaded, and it is served."""
    lease = 3.0
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, server.url, SECRET, str(lease)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    for _ in range(3):
        assert child.stdout.readline().strip() == "piece"
    child.kill()
    child.wait()
    r = server.client()
    keys = r.keys("*")
    assert any(b":p:" in k for k in keys) and any(b":lease:" in k for k in keys)
    assert all(0 < r.pttl(k) <= lease * 1000 for k in keys), {k: r.ttl(k) for k in keys}
    model = models("llama")
    tokens = prompt(200, seed=41)
    t0 = time.monotonic()
    report = _upload(model, server, tokens, redis_lease=lease)
    assert [len(t) for _, t in report.uploaded] == [200] and not report.failed
    assert time.monotonic() - t0 < lease + 5
    hit = _store(model, server).take(tokens + [1])
    assert hit is not None and hit.tier == "redis" and hit.prefix_len == 200
    time.sleep(lease + 0.5)  # the killed upload's keys are gone; the finished one's live a day
    assert all(r.ttl(k) > 3600 for k in r.keys("*"))


def test_no_secret_no_shared_tier(models, shared):
    with pytest.raises(StoreTrustError, match="secret"):
        PromptStore(models("llama"), tokenizer(), cap=CAP, redis=shared.url)


def test_entries_of_another_secret_or_rewritten_are_misses(models, shared):
    """An entry uploaded under another deployment's secret is never served; neither is one
    whose header a raw client rewrote (tokens of another prompt on the same pieces)."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    _upload(model, shared, tokens, secret="another-deployment-secret")
    store = _store(model, shared)
    assert store.take(tokens + [1]) is None
    assert store.counters()["tiers"]["redis"]["refused"] >= 1
    shared.client().flushall()

    _upload(model, shared, tokens)
    r = shared.client()
    key, m = _manifest(r, store, tokens)
    header = json.loads(m["header"])
    other = prompt(40, seed=2)
    header["tokens"] = other
    m["header"] = json.dumps(header, separators=(",", ":"))
    m["headerCrc32"] = f"{zlib.crc32(m['header'].encode()):08x}"
    seed = identity_seed(store.identity, "", BLOCK)
    r.set(store._redis.layout.manifest(seed, entry_id(seed, other)), msgpack.packb(m))
    for b in store._redis.layout.blocks(seed, block_chain(seed, other, BLOCK)):
        r.sadd(b, entry_id(seed, other))
    assert store.take(other + [1]) is None  # the pieces say otherwise: its HMAC does not match
    assert store.take(tokens + [1]).prefix_len == 40  # the genuine entry is untouched


def test_a_tenant_cannot_write_into_another_tenants_namespace(models, shared):
    """A tenant's server holds only its namespace's key: it cannot put into another
    namespace, and an entry it writes under another namespace with its own key is a miss
    for that namespace's readers."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    key_b = namespace_key(SECRET, "tenant-b")
    tenant_b = _store(model, shared, secret=None, namespace_keys={"tenant-b": key_b})
    with pytest.raises(StoreTrustError, match="tenant-a"):
        tenant_b.put(tokens, build(model, "bf16", {}, tokens, 40), ns="tenant-a")
    assert tenant_b.take(tokens + [1], ns="tenant-a") is None
    tenant_b.put(tokens, build(model, "bf16", {}, tokens, 40), ns="tenant-b")
    tenant_b.flush()
    # a forger: tenant b's key passed off as tenant a's
    forger = _store(model, shared, secret=None, namespace_keys={"tenant-a": key_b})
    forger.put(tokens, build(model, "bf16", {}, tokens, 40), ns="tenant-a")
    assert len(forger.flush().uploaded) == 1
    reader = _store(model, shared)  # the deployment's server: every namespace's key
    assert reader.take(tokens + [1], ns="tenant-a") is None
    assert reader.take(tokens + [1], ns="tenant-b").prefix_len == 40


def test_the_joined_bytes_are_checked_against_the_headers_crc32(models, shared):
    """A zeroed piece with its piece-table CRC updated (and the HMAC recomputed, as a buggy
    writer holding the secret would) is refused by the header's CRC-32 of the tensor."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    _upload(model, shared, tokens, piece_bytes=4096)
    store = _store(model, shared)
    r = shared.client()
    key, m = _manifest(r, store, tokens)
    seed = identity_seed(store.identity, "", BLOCK)
    eid = entry_id(seed, tokens)
    name, size, _ = m["pieces"][2]
    r.set(store._redis.layout.piece(seed, eid, m["upload"], 2), bytes(size))
    m["pieces"][2][2] = zlib.crc32(bytes(size))
    mac = EntryMac(namespace_key(SECRET, ""), seed[:16].hex(), eid, m["upload"], m["header"])
    for i, (n, _, _) in enumerate(m["pieces"]):
        mac.piece(n, r.get(store._redis.layout.piece(seed, eid, m["upload"], i)))
    m["mac"] = mac.hexdigest()
    r.set(key, msgpack.packb(m))
    assert store.take(tokens + [1]) is None
    assert r.get(key) is None  # damaged: its manifest goes


def _net_out(server):
    return sum(node.info("stats")["total_net_output_bytes"] for node in masters_of(server))


def test_reads_are_bounded_by_what_the_store_may_hold(models, shared):
    """Manifests larger than a reader fetches, and an entry larger than the store's cap, are
    never downloaded: Redis sends a few KiB, not the megabytes they hold."""
    model = models("llama")
    tokens = prompt(600, seed=5)  # 1.2 MiB of cache
    _upload(model, shared, tokens)
    small = _store(model, shared, cap=1 << 20)
    r = shared.client()
    before = _net_out(shared)
    assert small.take(tokens + [1]) is None
    assert _net_out(shared) - before < 64 << 10
    big = _store(model, shared)
    key, m = _manifest(r, big, tokens)
    seed = identity_seed(big.identity, "", BLOCK)
    block = big._redis.layout.blocks(seed, block_chain(seed, tokens, BLOCK))[0]
    for i in range(6):  # foreign manifests of 5 MiB each, filed under the prompt's first block
        r.set(big._redis.layout.manifest(seed, f"{i:032x}"), b"\x00" * (5 << 20))
        r.sadd(block, f"{i:032x}")
    before = _net_out(shared)
    hit = big.take(tokens[:40] + [1])
    assert hit is not None and hit.prefix_len == 40
    assert _net_out(shared) - before < 2 << 20  # the genuine entry, not 30 MiB of foreign manifests
