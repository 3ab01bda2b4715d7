"""Prompt store benchmarks, every contender side by side in one run (docs/store.md has results).

1. Restore vs re-prefill: the time to get caches of an N-token prefix (evaluated) from the
   RAM tier, the disk tier (file in the page cache, and evicted from it), the Redis tier,
   against prefilling the same N tokens on a seeded model. Targets: RAM >= 50x faster than
   re-prefill at 2k tokens; disk >= 10x.
2. A multi-turn chat trace (conversations over shared system prompts, turns interleaved at
   random) at one byte cap: prompt tokens forwarded and bytes held, for mlx-lm's
   ``LRUPromptCache`` (with mlx-lm's own caches, as its server uses it), mlxkv's store in
   RAM (least recently used first, and cost-size retention), and in RAM with a disk tier.
   Every contender is driven the way mlx-lm's server drives its prompt cache
   (fetch_nearest_cache, forward the rest, insert_cache).
3. Redis vs disk: put (to durable / uploaded) and get (RAM emptied) throughput of one entry.
4. Operations (``--parts ops``): a take's latency at 1k, 20k and 40k RAM entries sharing a
   first token with a prompt that shares less than one block; the process's RSS over N
   distinct puts with a disk tier and with Redis (4 MiB cap, never flushed, as a server);
   a bystander's longest gap between decode steps while Redis is stopped (SIGSTOP) for 8 s
   (one generation thread, a new request through the store every 10 steps, as mlx-lm's
   server has).

5. The shared tier on a Redis Cluster (``--cluster``: 3 masters with a replica each on
   loopback, and one redis-server on loopback TCP beside it): put and get of one entry and
   restore latency at N tokens on the cluster, one Redis and the disk, interleaved; then 4
   ``mlxkv serve`` processes over 4 system prompts (requests spread over the processes in
   a seeded random order): prompt tokens forwarded and request latency without a shared
   tier and with the cluster.

Timings are medians over interleaved repeats with their min-max spread.

Usage: python -m benchmarks.store [--sizes 512,2048,8192] [--repeats 3] [--convs 40
       --turns 5 --systems 4 --cap-mib 8] [--entry-mib 32] [--puts 200] [--skip-redis]
       [--parts restore,chat,throughput,ops,cluster] [--cluster] [--cluster-sizes 512,2048]
       [--requests 32] [--system-tokens 1024] [--json FILE]
       (``--cluster`` alone runs part 5 only)
"""

import argparse
import gc
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

import mlxkv
from benchmarks.common import summary, timed, write_result
from mlxkv.models.seeded import build_model, prompt, save_model_dir, tokenizer
from mlxkv.store import StorePromptCache
from tests.store_helpers import LocalCluster, free_ports

SECRET = "benchmark-deployment-secret"  # the shared tier authenticates its entries with it
#: a shared tier timed for its speed: a read may take longer than the default budget (0.5 s,
#: after which a lookup is a miss) on a busy machine, and is waited for
TIMING = {"secret": SECRET, "redis_budget": 60.0, "redis_timeout": 60.0}


class Redis:
    """A private redis-server on a unix socket, or (``tcp``) on a free loopback port, as a
    cluster's nodes are reached."""

    def __init__(self, tcp=False):
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (apt-get install -y redis-server), or pass --skip-redis")
        self.dir = tempfile.mkdtemp(prefix="mlxkv-bench-redis-")
        sock = os.path.join(self.dir, "r.sock")
        port = free_ports(1)[0] if tcp else 0
        self.proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock]
            + ["--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL,
        )
        while not os.path.exists(sock):
            time.sleep(0.02)
        self.url = f"redis://127.0.0.1:{port}/0" if tcp else f"unix://{sock}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def evaluated(caches):
    mx.eval([c.state for c in caches])
    return caches


def prefill(model, tokens, step=2048):
    caches = mlxkv.make_cache(model, "bf16")
    for i in range(0, len(tokens), step):
        model(mx.array([tokens[i : i + step]]), cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def drop_page_cache(store):
    for e in store._disk.entries():
        fd = os.open(e.extra["path"], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- 1. restore vs re-prefill -------------------------------------------------------------


def restore_vs_prefill(model, sizes, repeats, shared, work, with_prefill=True):
    """Per size: seconds to restore from RAM, disk (page cache, device) and each shared tier
    (``{name: url}``), and (``with_prefill``) to re-prefill, interleaved per repeat."""
    results = {}
    for n in sizes:
        tokens = prompt(n, seed=7)
        probe = tokens + [1]
        reference = prefill(model, tokens)
        tiers = {"ram": mlxkv.PromptStore(model, tokenizer(), cap=1 << 34)}
        tiers["disk"] = mlxkv.PromptStore(model, tokenizer(), cap=1 << 34, directory=os.path.join(work, f"d{n}"))
        for name, url in shared.items():
            tiers[name] = mlxkv.PromptStore(model, tokenizer(), cap=1 << 34, redis=url, block_tokens=256, **TIMING)
        for s in tiers.values():
            s.put(tokens, reference)
            s.flush()
        names = ["ram", "disk", "disk_cold", *shared]
        times = {k: [] for k in (["prefill"] if with_prefill else []) + names}
        for _ in range(repeats):
            if with_prefill:
                times["prefill"].append(timed(lambda tokens=tokens: prefill(model, tokens))[0])
            for tier in names:
                store = tiers["disk" if tier == "disk_cold" else tier]
                if tier != "ram":
                    store.shrink(n_entries=0)  # the next take reads the lower tier
                if tier == "disk_cold":
                    drop_page_cache(store)
                dt, hit = timed(lambda store=store, probe=probe: evaluated(store.take(probe).caches))
                assert len(hit) == len(reference)
                times[tier].append(dt)
        for s in tiers.values():
            s.close()
        row = {k: summary(v) for k, v in times.items()}
        p = row["prefill"]["median"] if with_prefill else None
        if with_prefill:
            row["speedup"] = {k: p / row[k]["median"] for k in names}
        results[n] = row
        print(
            f"{n:>6} tokens: "
            + (f"prefill {p * 1e3:9.1f} ms | " if with_prefill else "")
            + " | ".join(
                f"{k} {row[k]['median'] * 1e3:7.2f} ms ({row[k]['min'] * 1e3:.2f}-{row[k]['max'] * 1e3:.2f})"
                + (f" {row['speedup'][k]:7.0f}x" if with_prefill else "")
                for k in names
            ),
            flush=True,
        )
    return results


# -- 2. the chat trace --------------------------------------------------------------------


def chat_trace(n_convs, turns, n_systems, seed=0):
    """(conversation, system prompt, user turns, assistant replies), and a random order of
    (conversation, turn) steps in which each conversation's turns stay in order."""
    rng = random.Random(seed)
    systems = [prompt(128, seed=1000 + s) for s in range(n_systems)]
    convs = []
    for c in range(n_convs):
        users = [prompt(rng.randint(12, 40), seed=2000 + 100 * c + t) for t in range(turns)]
        replies = [prompt(16, seed=5000 + 100 * c + t) for t in range(turns)]
        convs.append((systems[c % n_systems], users, replies))
    pending = dict.fromkeys(range(n_convs), 0)
    order = []
    while pending:
        c = rng.choice(sorted(pending))
        order.append((c, pending[c]))
        pending[c] += 1
        if pending[c] == turns:
            del pending[c]
    return convs, order


def drive(model, cache_store, make_caches, convs, order, key=("seeded/llama", None, None)):
    """mlx-lm's server pattern: fetch, forward the rest (the reply is forwarded as if it had
    been generated), insert under every token. Returns (forwarded, total prompt tokens,
    largest nbytes seen)."""
    forwarded = total = peak = 0
    for c, t in order:
        system, users, replies = convs[c]
        history = list(system)
        for i in range(t):
            history += users[i] + replies[i]
        p = history + users[t]
        cache, rest = cache_store.fetch_nearest_cache(key, p)
        if cache is None:
            cache = make_caches()
        forwarded += len(rest)
        total += len(p)
        model(mx.array([rest + replies[t]]), cache=cache)
        mx.eval([c.state for c in cache])
        cache_store.insert_cache(key, p + replies[t], cache)
        peak = max(peak, cache_store.nbytes)
    return forwarded, total, peak


def held_bytes_lru(lru):
    """What mlx-lm's cache really holds: every array of every entry (its count includes the
    256-row slack of each cache, as this does)."""
    total = 0
    for model_trie in lru._trie._trie.values():
        stack = [model_trie]
        while stack:
            node = stack.pop()
            for k, v in node.items():
                if k == "__value__":
                    total += sum(c.nbytes for c in v.prompt_cache)
                else:
                    stack.append(v)
    return total


def chat(model, n_convs, turns, n_systems, cap, work):
    convs, order = chat_trace(n_convs, turns, n_systems)
    out = {}
    lru = LRUPromptCache(max_size=1 << 30, max_bytes=cap)
    t, (fwd, total, peak) = timed(lambda: drive(model, lru, lambda: make_prompt_cache(model), convs, order))
    out["mlx-lm LRUPromptCache"] = {
        "forwarded": fwd,
        "prompt_tokens": total,
        "peak_counted": peak,
        "held": held_bytes_lru(lru),
        "entries": len(lru),
        "seconds": t,
    }
    ram = StorePromptCache(mlxkv.PromptStore(model, tokenizer(), cap=cap))
    t, (fwd, total, peak) = timed(lambda: drive(model, ram, lambda: mlxkv.make_cache(model, "bf16"), convs, order))
    out["mlxkv RAM"] = {
        "forwarded": fwd,
        "prompt_tokens": total,
        "peak_counted": peak,
        "held": ram.nbytes,
        "entries": len(ram),
        "seconds": t,
    }
    gdsf = StorePromptCache(mlxkv.PromptStore(model, tokenizer(), cap=cap, retention="cost-size"))
    t, (fwd, total, peak) = timed(lambda: drive(model, gdsf, lambda: mlxkv.make_cache(model, "bf16"), convs, order))
    out["mlxkv RAM, cost-size"] = {
        "forwarded": fwd,
        "prompt_tokens": total,
        "peak_counted": peak,
        "held": gdsf.nbytes,
        "entries": len(gdsf),
        "seconds": t,
    }
    disk_store = mlxkv.PromptStore(model, tokenizer(), cap=cap, directory=os.path.join(work, "chat"))
    disk = StorePromptCache(disk_store)
    t, (fwd, total, peak) = timed(lambda: drive(model, disk, lambda: mlxkv.make_cache(model, "bf16"), convs, order))
    disk_store.flush()
    out["mlxkv RAM + disk"] = {
        "forwarded": fwd,
        "prompt_tokens": total,
        "peak_counted": peak,
        "held": disk.nbytes,
        "entries": len(disk),
        "disk_bytes": disk_store._disk.nbytes,
        "seconds": t,
    }
    disk_store.close()
    for name, r in out.items():
        print(
            f"{name:>24}: forwarded {r['forwarded']:6d} of {r['prompt_tokens']} prompt tokens "
            f"({100 * r['forwarded'] / r['prompt_tokens']:.1f} %), held {r['held'] / 2**20:.2f} MiB "
            f"(peak counted {r['peak_counted'] / 2**20:.2f} MiB, cap {cap / 2**20:.2f}), {r['entries']} entries, "
            f"{r['seconds']:.1f} s",
            flush=True,
        )
    return out


# -- 3. Redis vs disk ---------------------------------------------------------------------


def synthetic_caches(mib):
    """Plain caches of about ``mib`` MiB: 8 layers of [1, 8, T, 128] bf16 keys and values."""
    layers, heads, dim = 8, 8, 128
    t = max(1, (mib << 20) // (layers * 2 * heads * dim * 2))
    out = []
    for i in range(layers):
        k = mx.random.normal((1, heads, t, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        out.append(mlxkv.KVCache().adopt(k, -k, t, slack=False))
    mx.eval([c.keys for c in out])
    return out, t


def throughput(mib, repeats, shared, work):
    """Put (until durable, or uploaded) and get (RAM emptied) of one ``mib`` MiB entry on the
    disk and each shared tier (``{name: url}``), interleaved per repeat."""
    caches, t = synthetic_caches(mib)
    ident = {"model_id": "bench", "config_fingerprint": "b" * 64, "tokenizer_hash": ""}
    nbytes = sum(c.nbytes for c in caches)
    times = {"disk put": [], "disk get": [], "disk get cold": []}
    for name in shared:
        times.update({f"{name} put": [], f"{name} get": []})
    for r in range(repeats):
        tokens = prompt(t, seed=100 + r)
        for tier in ("disk", *shared):
            disk = {"directory": os.path.join(work, f"tp{r}")}
            kw = disk if tier == "disk" else {"redis": shared[tier], **TIMING}
            store = mlxkv.PromptStore(None, cap=1 << 34, identity=ident, block_tokens=256, **kw)
            store.take(prompt(300, seed=99))  # a miss that connects (a cluster's client learns its slots)
            dt, _ = timed(lambda store=store, tokens=tokens: (store.put(tokens, caches), store.flush()))
            times[f"{tier} put"].append(dt)
            store.shrink(n_entries=0)
            times[f"{tier} get"].append(
                timed(lambda store=store, tokens=tokens: evaluated(store.take(tokens + [1]).caches))[0]
            )
            if tier == "disk":
                store.shrink(n_entries=0)
                drop_page_cache(store)
                times["disk get cold"].append(
                    timed(lambda store=store, tokens=tokens: evaluated(store.take(tokens + [1]).caches))[0]
                )
            store.close()
    out = {}
    for k, v in times.items():
        if v:
            s = summary(v)
            s["MiB/s"] = nbytes / 2**20 / s["median"]
            out[k] = s
            print(
                f"{k:>14}: {s['median'] * 1e3:8.1f} ms ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}) "
                f"{s['MiB/s']:8.0f} MiB/s for {nbytes / 2**20:.0f} MiB",
                flush=True,
            )
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def take_latency(model, counts, repeats=21):
    """Median (min-max) ms of a take among ``counts`` RAM entries sharing the prompt's first
    token, the prompt sharing less than one block with them."""
    caches = mlxkv.make_cache(model, "bf16")
    mx.eval(model(mx.array([[7, 8, 9]]), cache=caches))
    store = mlxkv.PromptStore(model, tokenizer(), cap=8 << 30)
    out, n = {}, 0
    for target in counts:
        while n < target:
            store.put([7, n % 60000 + 10, n // 60000 + 10], caches)
            n += 1
        ms = [timed(store.take, [7, 5, 5, 5, i])[0] * 1e3 for i in range(repeats)]
        out[target] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        print(f"  take at {target:>6} entries: {out[target]['median_ms']:.3f} ms ({min(ms):.3f}-{max(ms):.3f})")
    return out


def rss_over_puts(model, n, tier, work, redis_url):
    """RSS growth (MiB) after each quarter of ``n`` distinct 1.25 MiB puts, never flushed."""
    caches = mlxkv.make_cache(model, "bf16")
    base = prompt(640, seed=1)
    mx.eval(model(mx.array([base]), cache=caches))
    kw = {"directory": os.path.join(work, f"rss-{tier}")} if tier == "disk" else {"redis": redis_url, "secret": SECRET}
    store = mlxkv.PromptStore(model, tokenizer(), cap=4 << 20, **kw)
    gc.collect()
    start, out = rss_mib(), []
    for i in range(n):
        store.put([i % 250, i // 250, *base[2:]], caches)
        if (i + 1) % (n // 4) == 0:
            time.sleep(0.5)  # the writers drain
            gc.collect()
            out.append({"puts": i + 1, "rss_mib": rss_mib() - start, "held_mib": store.nbytes / 2**20})
    store.close()
    print(f"  RSS over {n} puts ({tier}): " + ", ".join(f"+{o['rss_mib']:.0f} MiB at {o['puts']}" for o in out))
    return out


def bystander(model, work, freeze=8.0, disk=False):
    """The longest gap (ms) between a bystander's decode steps while Redis is stopped for
    ``freeze`` seconds, a new request through the store every 10 steps."""
    redis = Redis()
    kw = {"directory": os.path.join(work, "bystander")} if disk else {}
    store = mlxkv.PromptStore(model, tokenizer(), cap=64 << 20, redis=redis.url, secret=SECRET, **kw)
    caches = mlxkv.make_cache(model, "bf16")
    mx.eval(model(mx.array([prompt(32, seed=3)]), cache=caches))
    y = mx.array([[5]])
    gaps, state = {"healthy": [], "frozen": []}, "healthy"
    t0 = last = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < freeze + 6:
        now = time.perf_counter() - t0
        if state == "healthy" and 2 < now < 2 + freeze:
            os.kill(redis.proc.pid, signal.SIGSTOP)
            state = "frozen"
        elif state == "frozen" and now >= 2 + freeze:
            os.kill(redis.proc.pid, signal.SIGCONT)
            state = "after"
        mx.eval(model(y, cache=caches))
        t = time.perf_counter()
        gaps["frozen" if state == "frozen" else "healthy"].append(t - last)
        last, i = t, i + 1
        if i % 10 == 0:
            req = prompt(70, seed=100 + i)
            t1 = time.perf_counter()
            c = mlxkv.make_cache(model, "bf16")
            mx.eval(model(mx.array([req]), cache=c))
            last += time.perf_counter() - t1  # the request's own prefill is not the store's
            store.take(req + [1])
            store.put(req, c)
    close = timed(store.close)[0]
    redis.stop()
    out = {k: {"p50_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3} for k, v in gaps.items()}
    out["close_s"] = close
    print(
        f"  bystander{' (with disk)' if disk else ''}: longest gap {out['frozen']['max_ms']:.0f} ms with Redis "
        f"stopped (p50 {out['frozen']['p50_ms']:.1f} ms), {out['healthy']['max_ms']:.0f} ms otherwise; "
        f"close {close:.2f} s"
    )
    return out


def operations(model, n_puts, redis_url, work):
    out = {"rss": {"disk": rss_over_puts(model, n_puts, "disk", work, redis_url)}}  # first: a clean heap
    if redis_url:
        out["rss"]["redis"] = rss_over_puts(model, n_puts, "redis", work, redis_url)
    out["take"] = take_latency(model, [1000, 20000, 40000])
    if redis_url:
        out["bystander"] = bystander(model, work)
        out["bystander_disk"] = bystander(model, work, disk=True)
    return out


# -- 5. the shared tier on a Redis Cluster ------------------------------------------------


def serving(model_dir, cluster, n_requests, n_servers=4, n_systems=4, system_tokens=1024, max_tokens=8):
    """``n_servers`` mlxkv serve processes, requests over ``n_systems`` system prompts (each
    with its own user turn of 16-48 tokens) sent one at a time to the processes in a seeded
    random order: prompt tokens forwarded, and request seconds, without a shared tier and
    with the cluster."""
    from tests.serve_helpers import completion, serve_process

    os.environ["MLXKV_STORE_SECRET"] = SECRET  # the servers' (serve_process passes this environment)
    rng = random.Random(0)
    systems = [prompt(system_tokens, seed=9000 + s) for s in range(n_systems)]
    trace = [
        (rng.randrange(n_servers), systems[rng.randrange(n_systems)] + prompt(rng.randint(16, 48), seed=9100 + i))
        for i in range(n_requests)
    ]
    out = {}
    for name, flags in (("no shared tier", []), ("cluster", ["--redis", cluster.url])):
        cluster.flushall()
        with ThreadPoolExecutor(n_servers) as pool:
            procs = list(pool.map(lambda argv: serve_process(*argv), [["--model", model_dir, *flags]] * n_servers))
        drains = [threading.Thread(target=proc.stderr.read, daemon=True) for proc, _ in procs]
        for d in drains:
            d.start()
        try:
            forwarded = total = 0
            secs = {"new everywhere": [], "new to its server": [], "seen by its server": []}
            seen = {}  # system prompt -> the servers that answered it
            for server, tokens in trace:
                system = tuple(tokens[:system_tokens])
                dt, (_, n, cached) = timed(completion, procs[server][1], tokens, max_tokens, 600)
                forwarded += n - cached
                total += n
                kind = "seen by its server" if server in seen.get(system, ()) else "new to its server"
                secs[kind if system in seen else "new everywhere"].append(dt)
                seen.setdefault(system, set()).add(server)
                time.sleep(0.05)
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                proc.wait(60)
        out[name] = {"forwarded": forwarded, "prompt_tokens": total}
        out[name]["seconds"] = {k: summary(v) for k, v in secs.items() if v}
        print(
            f"  {n_servers} servers, {name:>14}: forwarded {forwarded} of {total} prompt tokens "
            f"({100 * forwarded / total:.1f} %); request seconds, median (min-max), by its system prompt: "
            + "; ".join(
                f"{k} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}, {len(v)})" for k, v in secs.items() if v
            ),
            flush=True,
        )
    return out


def on_a_cluster(model, sizes, entry_mib, repeats, n_requests, system_tokens, work):
    cluster = LocalCluster()
    one = Redis(tcp=True)
    try:
        shared = {"redis": one.url, "cluster": cluster.url}
        print("  restore an N-token prefix")
        out = {"restore": restore_vs_prefill(model, sizes, repeats, shared, work, with_prefill=False)}
        print(f"  one {entry_mib} MiB entry")
        out["throughput"] = throughput(entry_mib, repeats, shared, work)
        model_dir = save_model_dir("llama", os.path.join(work, "seeded-llama"))
        out["serving"] = serving(model_dir, cluster, n_requests, system_tokens=system_tokens)
    finally:
        one.stop()
        cluster.stop()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--convs", type=int, default=40)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--cap-mib", type=float, default=8.0)
    ap.add_argument("--entry-mib", type=int, default=32)
    ap.add_argument("--puts", type=int, default=200)
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--parts", default=None, help="default: restore,chat,throughput (with --cluster: cluster)")
    ap.add_argument("--cluster", action="store_true", help="part 5: the shared tier on a Redis Cluster")
    ap.add_argument("--cluster-sizes", default="512,2048")
    ap.add_argument("--requests", type=int, default=32, help="requests of part 5's serving run")
    ap.add_argument("--system-tokens", type=int, default=1024, help="system prompts of part 5's serving run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = set((args.parts or ("cluster" if args.cluster else "restore,chat,throughput")).split(","))
    if args.cluster:
        parts.add("cluster")
    model = build_model("llama")
    redis = None if args.skip_redis or parts == {"cluster"} else Redis()
    shared = {"redis": redis.url} if redis else {}
    work = tempfile.mkdtemp(prefix="mlxkv-bench-store-")
    results = {}
    try:
        if "restore" in parts:
            print("1. restore an N-token prefix vs re-prefill (seeded llama, bf16)")
            sizes = [int(s) for s in args.sizes.split(",")]
            results["restore"] = restore_vs_prefill(model, sizes, args.repeats, shared, work)
        if "chat" in parts:
            print(f"2. chat trace: {args.convs} conversations x {args.turns} turns over {args.systems} system prompts")
            results["chat"] = chat(model, args.convs, args.turns, args.systems, int(args.cap_mib * 2**20), work)
        if "throughput" in parts:
            print("3. one entry: Redis vs disk")
            results["throughput"] = throughput(args.entry_mib, args.repeats, shared, work)
        if "ops" in parts:
            print("4. operations: take latency, RSS over puts, a bystander with Redis stopped")
            results["ops"] = operations(model, args.puts, redis and redis.url, work)
        if "cluster" in parts:
            print("5. the shared tier on a Redis Cluster (3 masters, a replica each, loopback TCP)")
            sizes = [int(s) for s in args.cluster_sizes.split(",")]
            results["cluster"] = on_a_cluster(
                model, sizes, args.entry_mib, args.repeats, args.requests, args.system_tokens, work
            )
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {write_result('store', results, args.json)}")


if __name__ == "__main__":
    main()
