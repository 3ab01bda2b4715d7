"""``mlxkv serve --store DIR --redis URL``: the server's prompt cache is a PromptStore. A
shared system prompt is forwarded once; a restarted server finds its prefixes in the
directory; a second server with an empty directory finds them in Redis (a real
redis-server on a private socket). Real HTTP on loopback; answers checked against
``mlx_lm.generate`` resuming the same prefix."""

import http.client
import json
import os
import signal
import threading

import mlx.core as mx
import mlx_lm
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import Running, completion, serve_process, words
from store_helpers import RedisServer

import mlxkv
from mlxkv.models.seeded import prompt, save_model_dir
from mlxkv.serve import options
from mlxkv.serve.server import start

SCHEME = "kv8-g32"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir("llama", str(tmp_path_factory.mktemp("seeded-llama")))


@pytest.fixture(scope="module")
def loaded(model_dir):
    return mlx_lm.load(model_dir)


@pytest.fixture(scope="module")
def redis_server():
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def deployment_secret(monkeypatch):
    """Every server of a deployment shares the secret its Redis entries are authenticated with."""
    monkeypatch.setenv("MLXKV_STORE_SECRET", "a-test-deployment-secret")


def answer(loaded, tokens, cached, max_tokens, **cache_options):
    """What the server must answer: ``mlx_lm.generate`` on caches of the scheme that hold the
    first ``cached`` tokens (prefilled alone, as the stored entry was), then the rest."""
    model, tokenizer = loaded
    caches = mlxkv.make_cache(model, SCHEME, **cache_options)
    if cached:
        mx.eval(model(mx.array(tokens[:cached])[None], cache=caches))
    return mlx_lm.generate(model, tokenizer, tokens[cached:], max_tokens=max_tokens, prompt_cache=caches)


def complete(port, tokens, max_tokens=6):
    text, _, cached = completion(port, tokens, max_tokens)
    return text, cached


def serve(model_dir, *extra):
    return Running("--model", model_dir, "--scheme", SCHEME, *extra)


def snapshot_files(directory):
    return [n for _, _, names in os.walk(directory) for n in names if n.endswith(".safetensors")]


def test_a_shared_prefix_survives_a_restart_and_spans_servers(model_dir, loaded, redis_server, tmp_path):
    redis_server.client().flushall()
    system = prompt(80, seed=21)  # a system prompt every request starts with
    first, second = system + prompt(9, seed=22), system + prompt(12, seed=23)
    a = serve(model_dir, "--store", str(tmp_path / "a"), "--redis", redis_server.url)
    try:
        text, cached = complete(a.port, first)
        assert cached == 0 and text == answer(loaded, first, 0, 6)
        text, cached = complete(a.port, second)  # the system prompt is not forwarded again
        assert cached >= len(system) and text == answer(loaded, second, cached, 6)
    finally:
        a.stop()  # the store closes: its queued writes reach the directory and Redis
    assert snapshot_files(tmp_path / "a")
    assert redis_server.client().dbsize() > 0

    third = system + prompt(7, seed=24)
    b = serve(model_dir, "--store", str(tmp_path / "a"))  # restarted on the same directory
    try:
        text, cached = complete(b.port, third)
        assert cached >= len(system) and text == answer(loaded, third, cached, 6)
    finally:
        b.stop()
    c = serve(model_dir, "--redis", redis_server.url)  # another server: RAM empty, no directory
    try:
        text, cached = complete(c.port, third)
        assert cached >= len(system) and text == answer(loaded, third, cached, 6)
    finally:
        c.stop()


def test_the_command_writes_its_store_when_stopped(model_dir, loaded, tmp_path):
    """``mlxkv serve --store`` stopped by SIGTERM (a service manager) exits 0 with every
    prompt it served in the directory."""
    store = tmp_path / "store"
    proc, port = serve_process("--model", model_dir, "--scheme", SCHEME, "--store", str(store))
    try:
        tokens = prompt(40, seed=31)
        text, cached = complete(port, tokens)
        assert cached == 0 and text == answer(loaded, tokens, 0, 6)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        rest = proc.stderr.read()
    assert rc == 0, rest[-2000:]
    assert snapshot_files(store)
    with mlxkv.PromptStore(loaded[0], loaded[1], cap=1 << 26, directory=str(store), scheme=SCHEME) as s:
        hit = s.take(tokens + [5])
        assert hit is not None and hit.prefix_len >= len(tokens) and hit.tier == "disk"


def test_a_store_option_without_a_model_load_is_refused_cleanly(tmp_path):
    with pytest.raises(mlxkv.MLXKVError, match="cannot load the model"):
        start(options.parse(["--model", str(tmp_path / "missing"), "--port", "0", "--store", str(tmp_path / "s")]))


def _stream_gaps(port, tokens, max_tokens):
    """Seconds between the chunks of one streamed completion."""
    import time

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"prompt": words(tokens), "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    times = []
    for line in response:
        if line.startswith(b"data:") and b"[DONE]" not in line:
            times.append(time.perf_counter())
    conn.close()
    return [b - a for a, b in zip(times, times[1:])]


def test_a_hung_redis_does_not_stall_a_bystanders_stream(model_dir, redis_server, tmp_path):
    """Redis stopped (SIGSTOP) under a running server: requests arriving while a bystander
    streams each look Redis up from the one generation thread; the first waits the read
    budget, the rest skip the hung tier, so the bystander's tokens keep coming and every
    request is answered (before: each lookup waited the 10 s socket timeout)."""
    redis_server.client().flushall()
    a = serve(model_dir, "--store", str(tmp_path / "a"), "--redis", redis_server.url)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        gaps = []
        bystander = threading.Thread(target=lambda: gaps.extend(_stream_gaps(a.server.port, prompt(20, seed=50), 60)))
        bystander.start()
        answers = [complete(a.server.port, prompt(70, seed=60 + i), max_tokens=2) for i in range(4)]
        bystander.join(120)
        assert len(answers) == 4 and len(gaps) >= 50
        assert max(gaps) < 2.0, f"longest gap {max(gaps):.2f} s"
        counters = a.server.prompt_cache.counters()
        assert not counters["tiers"]["redis"]["healthy"] and counters["tiers"]["redis"]["skipped"] >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        a.stop()


def store_metrics(port) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_servers_that_differ_in_max_kv_size_never_serve_each_others_entries(model_dir, loaded, tmp_path):
    """``--max-kv-size`` changes what a cache holds (a ring of 32 positions, not every
    position), so it is part of the store's identity: on one directory, servers with rings of
    32, without rings and with rings of 64 find only their own entries, each answering as its
    own cold start."""
    store = str(tmp_path / "shared")
    ring = {"max_kv_size": 32}
    first, second = prompt(20, seed=41), prompt(20, seed=42)
    later = lambda p: p[:18] + prompt(10, seed=43)  # shares 18 tokens with an entry of ``p``
    a = serve(model_dir, "--store", store, "--max-kv-size", "32")
    try:
        assert complete(a.port, first, 10) == (answer(loaded, first, 0, 10, **ring), 0)
    finally:
        a.stop()
    b = serve(model_dir, "--store", store)
    try:
        assert complete(b.port, later(first), 10) == (answer(loaded, later(first), 0, 10), 0)
        assert complete(b.port, second, 10) == (answer(loaded, second, 0, 10), 0)
    finally:
        b.stop()
    c = serve(model_dir, "--store", store, "--max-kv-size", "64")  # rings of another size
    try:
        assert complete(c.port, later(first), 10) == (answer(loaded, later(first), 0, 10, max_kv_size=64), 0)
    finally:
        c.stop()
    a = serve(model_dir, "--store", store, "--max-kv-size", "32")  # restarted: its own entries only
    try:
        assert complete(a.port, later(second), 10) == (answer(loaded, later(second), 0, 10, **ring), 0)
        text, cached = complete(a.port, later(first), 10)
        assert cached == 18 and text == answer(loaded, later(first), 18, 10, **ring)
        m = store_metrics(a.port)
        assert m[("mlxkv_store_hits_total", (("tier", "disk"),))] == 1
        assert m[("mlxkv_store_misses_total", ())] == 1
    finally:
        a.stop()


def test_a_library_store_and_the_server_key_entries_alike(model_dir, loaded, tmp_path):
    """The store's identity is one rule (canonical_scheme) for ``mlxkv serve`` and for a
    ``PromptStore`` a program opens: a server's entries under ``--scheme kv4 --max-kv-size
    64`` are found by ``PromptStore(scheme="kv4", cache_options={"max_kv_size": 64})`` on its
    directory, and an entry that program puts is served by the server restarted there."""
    store, model, tokenizer = str(tmp_path / "s"), *loaded
    flags = ("--model", model_dir, "--scheme", "kv4", "--max-kv-size", "64", "--store", store)
    served = prompt(30, seed=81)
    a = Running(*flags)
    try:
        complete(a.port, served)
    finally:
        a.stop()
    put = prompt(30, seed=82)
    ring = {"max_kv_size": 64}
    with mlxkv.PromptStore(model, tokenizer, cap=1 << 26, directory=store, scheme="kv4", cache_options=ring) as s:
        hit = s.take(served + [3])
        assert hit is not None and hit.tier == "disk" and hit.prefix_len == len(served)
        caches = mlxkv.make_cache(model, "kv4", **ring)
        mx.eval(model(mx.array(put)[None], cache=caches))
        s.put(put, caches)
    b = Running(*flags)
    try:
        assert complete(b.port, put + prompt(4, seed=83))[1] == len(put)
    finally:
        b.stop()
