"""The shared tier against a real redis-server (started here on a private unix socket; the
tests fail, not skip, when it is not installed: `apt-get install -y redis-server`), and the
same tests against a real Redis Cluster on loopback (3 masters, a replica each): one tier,
two key layouts, the same rules."""

import json
import os
import subprocess
import sys
import zlib

import mlx.core as mx
import msgpack
import numpy as np
import pytest
from store_helpers import LocalCluster, RedisServer, build, continuation, forward, masters_of, settled

from mlxkv import PromptStore
from mlxkv.models.seeded import prompt, tokenizer
from mlxkv.store import stream_generate
from mlxkv.store.keys import block_chain, entry_id, identity_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16
CAP = 64 << 20
SECRET = "a-test-deployment-secret"


@pytest.fixture(scope="module", params=["server", "cluster"])
def server(request):
    s = RedisServer() if request.param == "server" else LocalCluster()
    yield s
    s.stop()


@pytest.fixture
def r(server):
    client = server.client()
    client.flushall()
    return client


def _store(model, server, **kw):
    kw.setdefault("secret", SECRET)
    store = PromptStore(model, tokenizer(), cap=kw.pop("cap", CAP), redis=server.url, block_tokens=BLOCK, **kw)
    return settled(store)  # a cluster's client has learnt the slot table


def _upload(model, server, tokens, **kw):
    s = _store(model, server, **kw)
    s.put(tokens, build(model, "bf16", {}, tokens, 64))
    report = s.flush()
    s.close()
    return report


CHILD = r"""
import sys
from mlxkv import PromptStore, make_cache
from mlxkv.models.seeded import build_model, prompt, tokenizer
import mlx.core as mx
model = build_model("llama")
tokens = prompt(64, seed=21) + prompt(30, seed=22)
caches = make_cache(model, "bf16")
model(mx.array([tokens]), cache=caches)
store = PromptStore(model, tokenizer(), cap=64 << 20, redis=sys.argv[1], block_tokens=16, secret=sys.argv[2])
store.put(tokens, caches)
print(len(store.flush().uploaded))
"""


@pytest.mark.parametrize("server", ["server"], indirect=True)  # the cluster: test_store_cluster.py's servers
def test_two_processes_share_a_system_prompt(models, server, r):
    """Another process uploads system prompt + its question; this one, with an empty RAM
    tier, forwards only its own suffix and gets the logits of a full prefill."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, server.url, SECRET],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
    model = models("llama")
    system, question = prompt(64, seed=21), prompt(25, seed=23)
    store = _store(model, server)
    hit = store.take(system + question)
    assert hit.tier == "redis" and hit.prefix_len == 64
    logits = forward(model, hit.caches, question)
    np.testing.assert_array_equal(logits, forward(model, build(model, "bf16", {}, [], 1), system + question))
    # through the generate helper: the prompt it forwards is the suffix
    other = _store(model, server)
    first = next(iter(stream_generate(model, tokenizer(), system + prompt(9, seed=24), other, max_tokens=2)))
    assert first.prompt_tokens == 9


def test_lookup_finds_the_longest_shared_prefix(models, server, r):
    model = models("llama")
    base = prompt(100, seed=1)
    for n in (40, 70):
        _upload(model, server, base[:n] + prompt(20, seed=n))
    store = _store(model, server)
    assert store.take(base + [1]).prefix_len == 70
    assert store.take(base[:50] + [1, 2]).prefix_len == 50
    assert store.take(prompt(100, seed=2)) is None


def test_a_piece_redis_evicted_is_a_miss_and_the_manifest_goes(models, server, r):
    model = models("llama")
    tokens = prompt(80, seed=1)
    _upload(model, server, tokens, piece_bytes=4096)
    pieces = sorted(k for k in r.keys("*:p:*"))
    assert len(pieces) > 4
    r.delete(pieces[3])
    store = _store(model, server)
    assert store.take(tokens + [1]) is None
    assert r.keys("*:m:*") == []


def test_a_manifest_without_pieces_or_with_a_damaged_piece_is_a_miss(models, server, r):
    model = models("llama")
    tokens = prompt(80, seed=1)
    _upload(model, server, tokens, piece_bytes=4096)
    key = sorted(r.keys("*:p:*"))[0]
    value = bytearray(r.get(key))
    value[10] ^= 1
    r.set(key, bytes(value))
    assert _store(model, server).take(tokens + [1]) is None
    _upload(model, server, tokens, piece_bytes=4096)  # uploaded again: the manifest was deleted
    for k in r.keys("*:p:*"):
        r.delete(k)
    assert _store(model, server).take(tokens + [1]) is None


def test_one_process_uploads_a_prefix(models, server, r):
    """The lease: while another process holds it, the upload waits (on its writer) until the
    lease ends, then finds the entry present or uploads it itself, so the entry is never
    left neither uploaded nor failed; an entry already there is not uploaded twice."""
    import time

    model = models("llama")
    tokens = prompt(40, seed=1)
    store = _store(model, server)
    seed = identity_seed(store.identity, "", BLOCK)
    lease = store._redis.layout.lease(seed, entry_id(seed, tokens))
    r.set(lease, "another-process", px=1500)
    t0 = time.monotonic()
    assert len(_upload(model, server, tokens).uploaded) == 1
    assert time.monotonic() - t0 >= 1.0 and len(r.keys("*:m:*")) == 1
    pieces = set(r.keys("*:p:*"))
    assert len(_upload(model, server, tokens).uploaded) == 1  # present counts
    assert set(r.keys("*:p:*")) == pieces  # and nothing was uploaded again


def test_a_server_that_lost_its_scripts_still_takes_uploads_and_deletes(models, server, r):
    """A restarted server, or a replica promoted in a failover, has no script cache (Redis 7
    replicates scripts as their effects): the first EVALSHA there answers NOSCRIPT, which
    must cost nothing: the upload's expiry script and the damaged manifest's delete both run."""
    model = models("llama")
    first, second = prompt(80, seed=1), prompt(80, seed=2)
    _upload(model, server, first, piece_bytes=4096, redis_ttl=600)  # the scripts are cached now
    r.script_flush()  # on every master
    assert len(_upload(model, server, second, piece_bytes=4096, redis_ttl=600).uploaded) == 1
    assert all(0 < r.ttl(k) <= 600 for k in r.keys("*"))  # the expiry script ran on every key
    assert _store(model, server).take(second + [1]).prefix_len == 80
    r.flushall()
    _upload(model, server, first, piece_bytes=4096)
    r.script_flush()
    key = sorted(r.keys("*:p:*"))[0]
    r.set(key, b"damaged", keepttl=True)
    assert _store(model, server).take(first + [1]) is None
    assert r.keys("*:m:*") == []  # the damaged entry's manifest deleted by the script


def test_other_identities_and_namespaces_never_match(models, server, r):
    llama, gemma = models("llama"), models("gemma3")
    tokens = prompt(40, seed=1)
    _upload(llama, server, tokens)
    assert (
        PromptStore(llama, None, cap=CAP, redis=server.url, block_tokens=BLOCK, secret=SECRET).take(tokens + [1])
        is None
    )
    assert _store(llama, server, scheme="kv4").take(tokens + [1]) is None
    assert _store(llama, server).take(tokens + [1], ns="lora") is None
    assert _store(gemma, server).take(tokens + [1]) is None
    assert _store(llama, server).take(tokens + [1]).prefix_len == 40


def test_every_key_expires(models, server, r):
    model = models("llama")
    _upload(model, server, prompt(40, seed=1), redis_ttl=600)
    keys = r.keys("*")
    assert keys and all(0 < r.ttl(k) <= 600 for k in keys)


def test_an_upload_found_present_keeps_its_pieces_alive(models, server, r):
    """Putting an entry Redis holds already gives every key of it, its pieces too, another
    time to live: pieces expiring under a live manifest would be a miss later."""
    model = models("llama")
    tokens = prompt(40, seed=1)
    _upload(model, server, tokens, redis_ttl=600)
    for k in r.keys("*"):  # as if most of the time to live had passed
        r.expire(k, 5)
    assert len(_upload(model, server, tokens, redis_ttl=600).uploaded) == 1  # present
    keys = r.keys("*")
    assert any(b":p:" in k for k in keys) and all(r.ttl(k) > 500 for k in keys)
    assert _store(model, server).take(tokens + [1]).prefix_len == 40


def test_eviction_under_maxmemory_gives_misses_never_wrong_caches(models, server, r):
    """A small Redis (on a cluster: each master) with allkeys-lru evicts pieces, manifests
    and block sets as entries pile up, each key on its own: a hit is an entry whose keys all
    survived and gives the logits of a full prefill; anything else is a miss."""
    masters = masters_of(server)
    for node in masters:  # about 1.6 MB of room in all, 12 entries of 180 KiB need more
        used = node.info("memory")["used_memory"]
        # a master with replicas counts its replication backlog (filled as it writes)
        backlog = (
            int(node.config_get("repl-backlog-size")["repl-backlog-size"])
            if node.info("replication")["connected_slaves"]
            else 0
        )
        node.config_set("maxmemory-policy", "allkeys-lru")
        node.config_set("maxmemory", used + backlog + (1600 << 10) // len(masters))
    try:
        model = models("llama")
        entries = [prompt(90, seed=s) for s in range(12)]  # ~180 KiB each
        for t in entries:
            _upload(model, server, t, piece_bytes=8192)
        assert sum(node.info("stats")["evicted_keys"] for node in masters) > 0
        store = _store(model, server)
        seed = identity_seed(store.identity, "", BLOCK)
        whole = set()
        for i, t in enumerate(entries):
            eid = entry_id(seed, t)
            raw = r.get(store._redis.layout.manifest(seed, eid))
            blocks = store._redis.layout.blocks(seed, block_chain(seed, t, BLOCK))
            if raw is None or not any(r.sismember(b, eid) for b in blocks):
                continue
            m = msgpack.unpackb(raw)
            keys = [store._redis.layout.piece(seed, eid, m["upload"], j) for j in range(len(m["pieces"]))]
            if all(r.exists(k) for k in keys):
                whole.add(i)
        hits = set()
        for i, t in reversed(list(enumerate(entries))):  # the newest first: the likeliest whole
            hit = store.take(t + [7])
            if hit is None:
                continue
            want = forward(model, build(model, "bf16", {}, [], 1), t + [7])
            np.testing.assert_array_equal(forward(model, hit.caches, (t + [7])[hit.prefix_len :]), want)
            if hit.prefix_len == len(t):  # its own entry (one promoted to RAM may share a first token)
                hits.add(i)
        # reads can evict more (a reply buffer counts against maxmemory): a hit needs a whole entry
        assert hits <= whole
    finally:
        for node in masters:
            node.config_set("maxmemory", 0)
            node.config_set("maxmemory-policy", "noeviction")


def test_redis_down_is_a_miss_and_a_reported_failure(models, tmp_path):
    gone = RedisServer()
    url = gone.url
    gone.stop()
    model = models("llama")
    tokens = prompt(30, seed=1)
    store = PromptStore(model, tokenizer(), cap=CAP, redis=url, block_tokens=BLOCK, secret=SECRET)
    assert store.take(tokens + [1]) is None
    store.put(tokens, build(model, "bf16", {}, tokens, 30))
    report = store.flush()
    assert [len(t) for _, t, _ in report.failed] == [30] and "shared tier" in report.failed[0][2]
    assert store.take(tokens + [1]).tier == "ram"


def test_the_layout_reads_back_without_mlxkv(models, server, r):
    """docs/store.md's Redis layout is enough to read an entry with msgpack, json, zlib and
    numpy alone: names from the seed and chain (a cluster's with their hash tags: the
    entry's id, the chain's first block), manifest, pieces, checksums."""
    import hashlib

    model = models("llama")
    tokens = prompt(40, seed=1)
    caches = build(model, "bf16", {}, tokens, 40)
    store = _store(model, server)
    store.put(tokens, caches)
    store.flush()
    ident = store.identity
    doc = {
        "block": BLOCK,
        "configFingerprint": ident.config_fingerprint,
        "kvScheme": "",
        "ns": "",
        "tokenizerHash": ident.tokenizer_hash,
    }
    seed = hashlib.sha256(b"mlxkv-store-1\n" + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).digest()
    space = seed[:16].hex()
    u32 = np.asarray(tokens, dtype="<u4").tobytes()
    h = hashlib.sha256(seed + u32[: 4 * BLOCK]).digest()  # the first block's chain hash
    cluster = isinstance(server, LocalCluster)
    root = h[:16].hex()
    (eid,) = r.smembers(f"mlxkv:{space}:b:{{{root}}}:{root}" if cluster else f"mlxkv:{space}:b:{root}")
    assert eid.decode() == hashlib.sha256(seed + u32).digest()[:16].hex()
    tagged = f"{{{eid.decode()}}}" if cluster else eid.decode()
    manifest = msgpack.unpackb(r.get(f"mlxkv:{space}:m:{tagged}"))
    assert manifest["v"] == 2 and f"{zlib.crc32(manifest['header'].encode()):08x}" == manifest["headerCrc32"]
    header = json.loads(manifest["header"])
    assert header["tokens"] == tokens
    data = {}
    for i, (name, nbytes, crc) in enumerate(manifest["pieces"]):
        piece = r.get(f"mlxkv:{space}:p:{tagged}:{manifest['upload']}:{i}")
        assert len(piece) == nbytes and zlib.crc32(piece) == crc
        data[name] = data.get(name, b"") + piece
    # the entry's HMAC (docs/store.md, Trust): the namespace key, then every field length-prefixed
    import hmac

    def field(b):
        return len(b).to_bytes(8, "little") + b

    ns_key = hmac.new(SECRET.encode(), b"mlxkv-store-namespace-1\n" + b"", hashlib.sha256).digest()
    mac = hmac.new(ns_key, b"mlxkv-store-entry-1\n", hashlib.sha256)
    for text in (space, eid.decode(), manifest["upload"], manifest["header"]):
        mac.update(field(text.encode()))
    for i, (name, nbytes, _) in enumerate(manifest["pieces"]):
        piece = r.get(f"mlxkv:{space}:p:{tagged}:{manifest['upload']}:{i}")
        mac.update(field(name.encode()) + nbytes.to_bytes(8, "little") + piece)
    assert mac.hexdigest() == manifest["mac"]
    keys0 = header["caches"][0]["tensors"][0]
    assert keys0["dtype"] == "BF16" and f"{zlib.crc32(data[keys0['name']]):08x}" == keys0["crc32"]
    got = np.frombuffer(data[keys0["name"]], dtype="<u2").reshape(keys0["shape"])
    np.testing.assert_array_equal(got, np.array(caches[0].keys[..., :40, :].view(mx.uint16)))
    assert block_chain(seed, tokens, BLOCK)[0] == h
    continuation(model, store.take(tokens + [1]).caches, [1])


SLOW_START = """#!{python}
import os, sys, time
# a redis-server whose socket file appears a second before it accepts connections on it
sock = sys.argv[sys.argv.index("--unixsocket") + 1]
open(sock, "w").close()
time.sleep(1.0)
os.unlink(sock)
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def test_the_redis_helper_is_ready_only_once_the_server_answers(tmp_path, monkeypatch):
    """The socket file is not the server listening: the helper waits for PING (a test under
    load got "connection refused" from a server not yet listening), and a restart after a
    SIGKILL is ready again on the same socket."""
    import shutil
    import signal

    slow = tmp_path / "redis-server"
    slow.write_text(SLOW_START.format(python=sys.executable, real=shutil.which("redis-server")))
    slow.chmod(0o755)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: str(slow) if name == "redis-server" else real_which(name))
    s = RedisServer()
    try:
        assert s.client().ping()
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()
        s.restart()
        assert s.client().ping()
    finally:
        s.stop()
