"""The shared tier on a real Redis Cluster on loopback (3 masters with a replica each, started
and stopped here; test_store_redis.py runs the tier's rules against it too).

- an entry's keys share one slot and a lookup asks one node for its whole chain;
- an unreachable cluster opens, and is a miss and a reported failure;
- two ``mlxkv serve`` processes on their own ``--store`` share a system prompt through the
  cluster: the second forwards only its suffix;
- a master SIGKILLed mid-run (its replica promoted), and slots migrated mid-run
  (``redis-cli --cluster reshard``): a third server, whose RAM holds one entry so that every
  request looks the cluster up, answers every request as a cold start answers it, misses
  while the tier fails and hits again after, and no request takes longer than the slowest
  healthy one (before, and in the last round, after) plus ``BOUND`` seconds (a lookup's two
  budgets of 0.5 s, and room for a loaded machine).
  Redirections (``MOVED``, ``ASK``) are redis-py's.
"""

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import completion, reference_answers, serve_process
from store_helpers import LocalCluster, build, forward, free_ports, settled

import mlxkv
from mlxkv import PromptStore
from mlxkv.models.seeded import prompt, tokenizer
from mlxkv.store import StoreOptions
from mlxkv.store.keys import block_chain, entry_id, identity_seed

BLOCK = 16
SECRET = "a-test-deployment-secret"
#: what a request may take beyond the slowest healthy one while a master fails or slots move
BOUND = 1.5
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    yield c
    c.stop()


def _store(model, cluster, **kw):
    """A store on the cluster whose lookups may wait 10 s (the budget is not what these
    tests test; on a loaded machine a first read could outlast the default 0.5 s: a miss)."""
    return PromptStore(
        model, tokenizer(), cap=64 << 20, redis=cluster.url, block_tokens=BLOCK, secret=SECRET, redis_budget=10, **kw
    )


def _data_calls(cluster) -> dict:
    """{master port: calls of the tier's data commands since the last reset}."""
    names = ("scard", "smembers", "srandmember", "strlen", "get", "mget", "expire", "srem", "evalsha", "set", "sadd")
    out = {}
    for port in cluster.masters():
        stats = cluster.node(port).info("commandstats")
        out[port] = sum(stats.get(f"cmdstat_{n}", {}).get("calls", 0) for n in names)
    return out


def test_an_entrys_keys_share_a_slot_and_a_lookup_asks_one_node_for_its_chain(models, cluster):
    cluster.flushall()
    model = models("llama")
    tokens = prompt(96, seed=1)  # 6 blocks
    with _store(model, cluster, piece_bytes=4096) as writer:
        writer.put(tokens, build(model, "bf16", {}, tokens, 96))
        assert len(writer.flush().uploaded) == 1
        layout = writer._redis.layout
        seed = identity_seed(writer.identity, "", BLOCK)
    eid = entry_id(seed, tokens)
    node = cluster.node(cluster.alive()[0])
    keys = [k.decode() for k in cluster.keys_matching()]
    blocks = layout.blocks(seed, block_chain(seed, tokens, BLOCK))
    own = [k for k in keys if k not in blocks]
    assert sorted(blocks) == sorted(k for k in keys if ":b:" in k) and len(own) > 10  # manifest and pieces
    assert {node.cluster("keyslot", k) for k in [*own, layout.lease(seed, eid)]} == {node.cluster("keyslot", own[0])}
    assert len({node.cluster("keyslot", b) for b in blocks}) == 1

    reader = _store(model, cluster)
    settled(reader)
    cluster.reset_stats()
    assert reader.take(prompt(96, seed=3)) is None  # six blocks, none known: one node asked
    calls = _data_calls(cluster)
    assert sorted(calls.values()) == [0, 0, 6], calls
    cluster.reset_stats()
    hit = reader.take(tokens + [5])
    assert hit is not None and hit.tier == "redis" and hit.prefix_len == 96
    touched = {p for p, n in _data_calls(cluster).items() if n}
    assert touched == {cluster.master_of(blocks[0]), cluster.master_of(layout.manifest(seed, eid))}
    want = forward(model, build(model, "bf16", {}, [], 1), tokens + [5])
    assert (forward(model, hit.caches, [5]) == want).all()
    reader.close()


def test_an_entry_written_and_read_while_its_slots_move_follows_ask_then_moved(models, cluster):
    """The entry's slot and its chain's, moved by hand a step at a time as ``redis-cli
    --cluster reshard`` moves each slot: an upload while both are migrating (its keys go to
    the target, the source answering ``ASK``), a read then (``ASK`` again), and a read once
    the slots are the target's by a client whose slot table is older (``MOVED``): each a
    hit on the whole entry, none a failure of the tier; the redirections are redis-py's."""
    cluster.flushall()
    model = models("llama")
    tokens = prompt(48, seed=5)
    want = forward(model, build(model, "bf16", {}, [], 1), tokens + [5])
    writer, reader = settled(_store(model, cluster, piece_bytes=4096)), settled(_store(model, cluster))
    layout, seed = writer._redis.layout, identity_seed(writer.identity, "", BLOCK)
    manifest = layout.manifest(seed, entry_id(seed, tokens))
    moves = [cluster.begin_move(k) for k in (manifest, layout.blocks(seed, block_chain(seed, tokens, BLOCK))[0])]
    cluster.reset_stats()
    writer.put(tokens, build(model, "bf16", {}, tokens, 48))
    report = writer.flush()
    assert len(report.uploaded) == 1 and not report.failed, report.failed
    assert all(cluster.keys_in_slot(t, s) > 0 and cluster.keys_in_slot(f, s) == 0 for s, f, t in moves)
    assert cluster.redirections()["ASK"] > 0
    for step in ("ASK", "MOVED"):
        if step == "MOVED":
            for move in moves:
                cluster.end_move(*move)
        cluster.reset_stats()
        hit = reader.take(tokens + [5])
        assert hit is not None and hit.tier == "redis" and hit.prefix_len == 48, step
        assert (forward(model, hit.caches, [5]) == want).all()
        assert cluster.redirections()[step] > 0, step
        reader.shrink(n_entries=0)  # the next take asks the cluster again
    assert all(s.counters()["tiers"]["redis"]["failures"] == 0 for s in (writer, reader))
    assert cluster.master_of(manifest) == moves[0][2]
    writer.close()
    reader.close()


def test_an_unreachable_cluster_is_a_miss_and_a_reported_failure(models):
    url = "redis+cluster://mlxkv:hunter2@" + ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    StoreOptions(cap=1 << 20, redis=url, secret=SECRET)  # its form is checked; nothing is sent
    StoreOptions(cap=1 << 20, redis="rediss+cluster://[::1]:7000,cache-2/0?ssl_ca_certs=/ca.pem", secret=SECRET)
    for bad in ("redis+cluster://", "redis+cluster://host:port", "redis+cluster://h:1/2", "redis+cluster://h:70000"):
        with pytest.raises(mlxkv.MLXKVError):
            StoreOptions(cap=1 << 20, redis=bad, secret=SECRET)
    model = models("llama")
    tokens = prompt(40, seed=1)
    store = PromptStore(model, tokenizer(), cap=64 << 20, redis=url, block_tokens=BLOCK, secret=SECRET)
    t = time.perf_counter()
    assert store.take(tokens + [1]) is None
    assert time.perf_counter() - t < 2.0
    store.put(tokens, build(model, "bf16", {}, tokens, 40))
    report = store.flush()
    assert [len(t) for _, t, _ in report.failed] == [40] and "shared tier" in report.failed[0][2]
    assert not store.counters()["tiers"]["redis"]["healthy"]
    assert store.take(tokens + [1]).tier == "ram"
    assert "hunter2" not in store.open_report[-1].line() and "***@127.0.0.1" in store.open_report[-1].line()
    store.close()


def test_a_lookup_while_the_client_is_made_waits_within_its_budget_then_is_skipped():
    """The breaker's start (a cluster's client learning the slot table as the store opens):
    a call meanwhile waits for it within the budget; one still waiting then is skipped, not
    a failure; a start that fails makes the tier failing."""
    from mlxkv.store.health import Breaker, TierUnavailable

    quick = Breaker("redis", "here", lambda: None, budget=0.5)
    quick.start(lambda: time.sleep(0.1))
    assert quick.call(lambda: "answer") == "answer"
    slow = Breaker("redis", "here", lambda: None, budget=0.2)
    slow.start(lambda: time.sleep(1.0))
    t = time.perf_counter()
    with pytest.raises(TierUnavailable, match="still connecting"):
        slow.call(lambda: "answer")
    assert time.perf_counter() - t < 0.6 and slow.healthy and slow.counts["skipped"] == 1
    broken = Breaker("redis", "here", lambda: None, budget=0.5)
    broken.start(lambda: 1 / 0)
    with pytest.raises(TierUnavailable):
        broken.call(lambda: "answer")
    assert not broken.healthy and "ZeroDivisionError" in broken.last_error
    for b in (quick, slow, broken):
        b.close()


# -- servers over real HTTP --------------------------------------------------------------


class Server:
    """``mlxkv serve`` as a process; its log is read on a thread (a full pipe would stall it)."""

    def __init__(self, *argv):
        self.proc, self.port = serve_process(*argv)
        self.log = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def complete(self, tokens):
        """(text, cached tokens, seconds) of one greedy completion."""
        t = time.perf_counter()
        text, _, cached = completion(self.port, tokens, MAX_TOKENS)
        return text, cached, time.perf_counter() - t

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def cold(llama_dir):
    """What a cold start answers: mlx_lm.generate over the whole prompt, fresh caches."""
    answer, memo = reference_answers(llama_dir, "bf16"), {}

    def cached(tokens):
        if tuple(tokens) not in memo:
            memo[tuple(tokens)] = answer(tokens, MAX_TOKENS)
        return memo[tuple(tokens)]

    return cached


@pytest.fixture(scope="module")
def servers(llama_dir, cluster, tmp_path_factory):
    """a and b on their own --store; c with no directory and RAM for one entry (every
    request it serves looks the cluster up)."""
    base = tmp_path_factory.mktemp("stores")
    argvs = {
        "a": ["--store", str(base / "a")],
        "b": ["--store", str(base / "b")],
        "c": ["--prompt-cache-bytes", "0.32MB"],
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXKV_STORE_SECRET", SECRET)
        with ThreadPoolExecutor(3) as pool:
            started = dict(
                zip(argvs, pool.map(lambda v: Server("--model", llama_dir, "--redis", cluster.url, *v), argvs.values()))
            )
    yield started
    for s in started.values():
        s.stop()


def _wait_for(what, timeout=30.0):
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_two_servers_on_their_own_stores_share_a_system_prompt_through_the_cluster(cluster, servers, cold):
    cluster.flushall()
    system = prompt(80, seed=21)
    first, second = system + prompt(9, seed=22), system + prompt(12, seed=23)
    text, cached, _ = servers["a"].complete(first)
    assert cached == 0 and text == cold(first)
    _wait_for(lambda: cluster.keys_matching("*:m:*"))  # a's upload (its writer, after the answer)
    text, cached, _ = servers["b"].complete(second)  # b's RAM and directory are empty
    assert cached >= len(system) and text == cold(second)


#: prompts of a whole block (the shared tier finds entries sharing one) and a few tokens more
PROMPTS = [prompt(72, seed=300 + i) + prompt(8, seed=400 + i) for i in range(6)]


def _round(server, cold, record):
    """Each prompt once, every answer checked; (completed at, cached, seconds) recorded."""
    for tokens in PROMPTS:
        text, cached, seconds = server.complete(tokens)
        record.append((time.monotonic(), cached, seconds))
        assert text == cold(tokens), (cached, tokens)
    return all(cached > 0 for _, cached, _ in record[-len(PROMPTS) :])


def _rounds(server, cold, record, timeout=60.0):
    """Rounds until one finds every prompt in the cluster (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not _round(server, cold, record):
        assert time.monotonic() < deadline, f"the cluster's entries were not found again: {record}"


def _healthy(cluster, servers, cold):
    """On an emptied cluster, rounds on c until every prompt is found in the cluster (the
    first uploads them). Returns the slowest request's seconds."""
    cluster.flushall()
    record = []
    _round(servers["c"], cold, record)
    _rounds(servers["c"], cold, record)
    return max(s for _, _, s in record)


def _during(action, servers, cold):
    """Rounds on c while ``action()`` runs on a thread, then until a round finds every
    prompt in the cluster again: (the record, when the action began, when it ended)."""
    done, span = threading.Event(), {}

    def run():
        span["began"] = time.monotonic()
        try:
            action()
        except BaseException as e:  # re-raised below, in the test
            span["error"] = e
        span["ended"] = time.monotonic()
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    record = []
    try:
        while not done.is_set():
            _round(servers["c"], cold, record)
        _rounds(servers["c"], cold, record)
    finally:
        thread.join(130)
    if "error" in span:
        raise span["error"]
    return record, span["began"], span["ended"]


def _assert_bounded(record, slowest, *context):
    """No request of ``record`` took longer than the slowest healthy one plus BOUND; the
    healthy ones are the rounds before (``slowest``) and the last round of ``record``, every
    prompt found again: the machine's load at both ends of the run counts."""
    healthy = max(slowest, *(s for _, _, s in record[-len(PROMPTS) :]))
    worst = max(s for _, _, s in record)
    assert worst < healthy + BOUND, (worst, healthy, *context)


def test_a_master_killed_mid_run_costs_misses_never_a_wrong_answer(cluster, servers, cold):
    slowest = _healthy(cluster, servers, cold)
    cluster.wait_replicated()
    counts = {}
    for k in cluster.keys_matching("*:b:*"):  # the master holding most of c's block sets: lookups fail there
        counts[cluster.master_of(k)] = counts.get(cluster.master_of(k), 0) + 1
    victim = max(counts, key=counts.get)

    def failover():
        cluster.kill(victim)
        cluster.wait_ok(60)  # its replica promoted

    record, killed, promoted = _during(failover, servers, cold)
    during = [cached for t, cached, _ in record if killed <= t <= promoted]
    assert 0 in during, record  # lookups failed over to misses
    _assert_bounded(record, slowest, promoted - killed)


def test_slots_migrated_mid_run_cost_no_wrong_answer(cluster, servers, cold):
    slowest = _healthy(cluster, servers, cold)
    node = cluster.node(cluster.alive()[0])
    slot = {k: node.cluster("keyslot", k) for k in cluster.keys_matching("mlxkv:*")}
    masters = cluster.masters()
    held = {p: sorted(s for s in set(slot.values()) if any(a <= s <= b for a, b in r)) for p, r in masters.items()}
    source = max(held, key=lambda p: len(held[p]))
    target = next(p for p in masters if p != source)
    # the source's lowest slots move (redis-cli takes them in order), up to its median slot of ours
    median = held[source][len(held[source]) // 2]
    n = sum(max(0, min(b, median) - a + 1) for a, b in masters[source])
    moving = [k for k, s in slot.items() if s <= median and s in held[source]]
    reshard = subprocess.Popen(
        ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{source}"]
        + ["--cluster-from", cluster.node_id(source), "--cluster-to", cluster.node_id(target)]
        + ["--cluster-slots", str(n), "--cluster-yes"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    record, _, moved = _during(lambda: reshard.wait(120), servers, cold)
    assert reshard.returncode == 0, reshard.stderr.read()
    assert any(t < moved for t, _, _ in record), record  # requests answered while the slots moved
    assert moving and all(cluster.node(target).exists(k) for k in moving)  # the target's own view
    _assert_bounded(record, slowest, n)
