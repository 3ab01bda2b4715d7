"""``mlxkv serve``'s life as a service: it stops on SIGINT or SIGTERM however it was started
(a job started in the background without job control ignores SIGINT), a second signal
during the stop neither cuts it short nor loses an entry, even with Redis hung (SIGSTOP);
at most ``--max-connections`` are served at once (one more gets 503) and an idle client is
dropped; ``GET /health`` says each tier's health and the shared tier's breaker. Real
processes: the command, a private redis-server, HTTP on loopback."""

import http.client
import json
import os
import signal
import socket
import time

import mlx_lm
import pytest
from serve_helpers import Running, post_completion, serve_process
from store_helpers import RedisServer

import mlxkv
from mlxkv.models.seeded import prompt, save_model_dir
from mlxkv.serve import listener

SCHEME = "bf16"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir("llama", str(tmp_path_factory.mktemp("seeded-llama")))


@pytest.fixture(autouse=True)
def deployment_secret(monkeypatch):
    monkeypatch.setenv("MLXKV_STORE_SECRET", "a-test-deployment-secret")


def complete(port, tokens, max_tokens=4):
    return post_completion(port, tokens, max_tokens)


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    return response, response.read().decode()


def stopped(proc, timeout=30):
    rc = proc.wait(timeout)
    return rc, proc.stderr.read()


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_stops_a_server_started_with_sigint_ignored(model_dir, tmp_path):
    """A shell script's ``mlxkv serve ... &`` (or nohup) starts it with SIGINT ignored, and
    Python installs no KeyboardInterrupt handler then: SIGINT must still stop it (before:
    it served on, and a service manager's Ctrl-C hung)."""
    proc, port = serve_process("--model", model_dir, "--store", str(tmp_path / "s"), preexec_fn=_ignore_sigint)
    try:
        response, _ = complete(port, prompt(20, seed=1))
        assert response.status == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc, rest = stopped(proc)
        assert rc == 0, rest[-2000:]
        assert time.monotonic() - t0 < 20
        assert "mlxkv serve: stopping" in rest and "1 durable" in rest, rest[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_with_redis_hung_loses_nothing_and_the_stop_is_bounded(model_dir, tmp_path):
    """Redis stopped (SIGSTOP) while the server writes: SIGTERM, then SIGTERM again during
    the stop. The stop ends within the store's bound (each tier its own writer: the uploads
    stuck behind the hung Redis do not hold the disk's writes), the second signal is logged
    and ignored, the last line reports every entry durable and every one is in the
    directory (before: the second SIGTERM interrupted the store's close)."""
    redis = RedisServer()
    store = tmp_path / "store"
    proc, port = serve_process("--model", model_dir, "--store", str(store), "--redis", redis.url)
    prompts = [prompt(40, seed=70 + i) for i in range(3)]
    try:
        os.kill(redis.proc.pid, signal.SIGSTOP)
        for tokens in prompts:
            response, data = complete(port, tokens)
            assert response.status == 200, data
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        rc, rest = stopped(proc, 60)
        took = time.monotonic() - t0
        assert rc == 0, rest[-3000:]
        assert took < 15, took
        assert "SIGTERM ignored: already stopping" in rest, rest[-3000:]
        assert "prompt store closed: 3 durable" in rest, rest[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.kill(redis.proc.pid, signal.SIGCONT)
        redis.stop()
    model, tokenizer = mlx_lm.load(model_dir)
    with mlxkv.PromptStore(model, tokenizer, cap=1 << 26, directory=str(store), scheme=SCHEME) as s:
        for tokens in prompts:
            hit = s.take(tokens + [5])
            assert hit is not None and hit.tier == "disk" and hit.prefix_len >= len(tokens)


def _idle_connection(port) -> socket.socket:
    """A client that connects and sends nothing (it holds a connection slot)."""
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_connections_past_the_bound_get_503_and_the_others_are_served(model_dir, monkeypatch):
    """``--max-connections 2``: two idle clients hold both slots, a third connection is
    answered 503 with Retry-After in OpenAI's error shape (before: a thread per connection,
    without limit); once a slot is free, requests are served and the refusal is counted."""
    server = Running("--model", model_dir, "--max-connections", "2")
    idle = []
    try:
        idle = [_idle_connection(server.port) for _ in range(2)]
        _wait_for(lambda: server.server.generator.counters.refused_connections == 0 and _slots_taken(server) == 2)
        response, data = complete(server.port, prompt(10, seed=2))
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        assert data["error"]["type"] == "server_error" and "--max-connections" in data["error"]["message"]
        idle.pop().close()
        _wait_for(lambda: _slots_taken(server) < 2)
        response, data = complete(server.port, prompt(10, seed=2))
        assert response.status == 200, data
        _, text = get(server.port, "/metrics")
        assert "mlxkv_refused_connections_total 1" in text.splitlines()
    finally:
        for s in idle:
            s.close()
        server.stop()


def _slots_taken(server) -> int:
    return server.server.httpd.connections


def test_an_idle_client_is_dropped_after_the_client_timeout(model_dir, monkeypatch):
    """A client that sends nothing is closed after ``CLIENT_TIMEOUT``, so idle clients
    cannot hold every slot."""
    monkeypatch.setattr(listener, "CLIENT_TIMEOUT", 0.5)
    server = Running("--model", model_dir, "--max-connections", "1")
    try:
        client = _idle_connection(server.port)
        t0 = time.monotonic()
        assert client.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 10
        client.close()
        _wait_for(lambda: _slots_taken(server) == 0)
        response, data = complete(server.port, prompt(10, seed=3))
        assert response.status == 200, data
    finally:
        server.stop()


def test_health_says_each_tier_and_the_breaker_of_a_hung_redis(model_dir, tmp_path):
    """``GET /health`` with ``--store`` and ``--redis``: every tier healthy, then, with Redis
    stopped (SIGSTOP) and a request made, ``degraded`` (still 200: the server answers), the
    redis tier failing with its breaker open and the disk healthy; healthy again once Redis
    answers."""
    redis = RedisServer()
    server = Running("--model", model_dir, "--store", str(tmp_path / "s"), "--redis", redis.url)
    try:
        response, text = get(server.port, "/health")
        body = json.loads(text)
        assert response.status == 200 and body["status"] == "ok", body
        assert set(body["tiers"]) == {"ram", "disk", "redis"}
        assert body["tiers"]["redis"]["breaker"] == "closed" and body["tiers"]["disk"]["healthy"]
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            response, data = complete(server.port, prompt(70, seed=4))
            assert response.status == 200, data
            response, text = get(server.port, "/health")
            body = json.loads(text)
            assert response.status == 200 and body["status"] == "degraded", body
            shared = body["tiers"]["redis"]
            assert shared["breaker"] == "open" and not shared["healthy"] and shared["failing_seconds"] >= 0
            assert shared["last_error"] and body["tiers"]["disk"]["healthy"] and body["tiers"]["ram"]["healthy"]
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while body["status"] != "ok":  # the breaker probes again on a call once its retry is due
            assert time.monotonic() < deadline, body
            time.sleep(0.5)
            complete(server.port, prompt(70, seed=5))
            body = json.loads(get(server.port, "/health")[1])
        assert body["tiers"]["redis"]["breaker"] == "closed" and body["tiers"]["redis"]["failing_seconds"] is None
    finally:
        server.stop()
        redis.stop()
