"""``mlxkv serve``: mlx-lm's HTTP server on mlxkv caches, started for real on loopback with a
seeded model saved to a model directory, spoken to by a real HTTP client (``http.client``)."""

import http.client
import json
import re
import signal
import socket
import threading
import warnings

import mlx.core as mx
import pytest
from serve_helpers import reference_answers, serve_process, words

import mlxkv
from mlxkv.batched.attention import BatchedKVCache
from mlxkv.cli import main as mlxkv_main
from mlxkv.models.seeded import prompt, save_model_dir
from mlxkv.serve import options
from mlxkv.serve.server import start

SCHEME = "turbo-k8v3"
MAX_CONTEXT = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir("llama", str(tmp_path_factory.mktemp("seeded-llama")))


@pytest.fixture(scope="module")
def reference(model_dir):
    """What ``mlx_lm.generate`` answers with the same model and scheme (greedy)."""
    return reference_answers(model_dir, SCHEME)


@pytest.fixture(scope="module")
def server(model_dir):
    args = options.parse(["--model", model_dir, "--scheme", SCHEME, "--port", "0", "--max-context", str(MAX_CONTEXT)])
    srv = start(args)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    thread.join(10)


def distinct_prompts(n, lengths):
    """Prompts whose first tokens differ from each other and from every earlier test's
    (a shared prefix would be served from the prompt cache, see docs/serving.md)."""
    out = []
    for i, length in enumerate(lengths):
        p = prompt(length, seed=100 + n + i)
        out.append([1 + n + i] + p[1:])
    return out


def request(port, path, body, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data)


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_concurrent_chat_and_completion_requests_get_mlx_lm_generate_answers(server, reference):
    prompts = distinct_prompts(10, (6, 40, 17, 90, 3, 28))
    bodies = []
    for i, p in enumerate(prompts):
        if i % 2:
            bodies.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": words(p)}]}))
        else:
            bodies.append(("/v1/completions", {"prompt": words(p)}))
    results = [None] * len(bodies)

    def send(i, path, body):
        results[i] = request(server.port, path, {**body, "max_tokens": 12, "temperature": 0.0})

    threads = [threading.Thread(target=send, args=(i, *b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ((path, body), p) in enumerate(zip(bodies, prompts)):
        status, data = results[i]
        assert status == 200, data
        choice = data["choices"][0]
        if "chat" in path:
            tokens = reference.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            text = choice["message"]["content"]
        else:
            tokens, text = p, choice["text"]
        assert text == reference(tokens, 12), i
        assert data["usage"]["prompt_tokens"] == len(tokens)


def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(server, reference):
    long, short = distinct_prompts(30, (20, 9))
    body = json.dumps({"prompt": words(long), "max_tokens": 150, "stream": True, "temperature": 0.0}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    seen = b""
    while seen.count(b"data:") < 2:  # two streamed chunks, then the client goes away
        chunk = sock.recv(4096)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.0 200")
    sock.close()
    status, data = request(server.port, "/v1/completions", {"prompt": words(short), "max_tokens": 10})
    assert status == 200 and data["choices"][0]["text"] == reference(short, 10)
    assert health(server.port) == (200, {"status": "ok"})


def test_a_request_longer_than_the_context_gets_a_clear_400(server, reference):
    (p,) = distinct_prompts(40, (MAX_CONTEXT - 5,))
    status, data = request(server.port, "/v1/completions", {"prompt": words(p), "max_tokens": 10})
    assert status == 400
    message = data["error"]["message"]
    assert re.search(r"the prompt has 195 tokens and max_tokens is 10: together more than the 200", message)
    (ok,) = distinct_prompts(41, (12,))
    status, data = request(server.port, "/v1/completions", {"prompt": words(ok), "max_tokens": 6})
    assert status == 200 and data["choices"][0]["text"] == reference(ok, 6)


def test_a_failure_in_the_generation_thread_is_an_http_error_not_a_dead_server(server, reference, monkeypatch):
    real, failing = BatchedKVCache.update_and_fetch, threading.Event()

    def update_and_fetch(self, keys, values):
        if failing.is_set():
            failing.clear()
            raise RuntimeError("injected cache failure")
        return real(self, keys, values)

    monkeypatch.setattr(BatchedKVCache, "update_and_fetch", update_and_fetch)
    before = server.generator.failures
    broken, fine = distinct_prompts(50, (15, 11))
    failing.set()
    status, data = request(server.port, "/v1/completions", {"prompt": words(broken), "max_tokens": 5})
    assert status == 500 and "injected cache failure" in data["error"]["message"]
    assert server.generator.failures == before + 1
    assert health(server.port) == (200, {"status": "ok"})
    status, data = request(server.port, "/v1/completions", {"prompt": words(fine), "max_tokens": 8})
    assert status == 200 and data["choices"][0]["text"] == reference(fine, 8)


@pytest.mark.parametrize("scheme", [SCHEME, "tova-b32-s4", "kv4-start16"])
def test_a_compiled_server_answers_as_mlx_lm_generate(model_dir, reference, scheme):
    """``--compiled``: the batch decodes through mlxkv's compiled step (traced per layout and
    batch size, not per step); batches without a decode step (eviction rows, rows before their
    bf16-first start) run eagerly. The answers are ``mlx_lm.generate``'s."""
    args = options.parse(["--model", model_dir, "--scheme", scheme, "--port", "0", "--compiled"])
    srv = start(args)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        decoder = srv.generator.model_provider.model.decoder
        prompts = distinct_prompts(30, (9, 33, 4, 21))
        results = [None] * len(prompts)

        def send(i):
            body = {"prompt": words(prompts[i]), "max_tokens": 10, "temperature": 0.0}
            results[i] = request(srv.port, "/v1/completions", body)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mlxkv.EagerDecodeWarning)
            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert all(status == 200 for status, _ in results) and srv.generator.failures == 0
        for (_, data), p in zip(results, prompts):
            assert data["choices"][0]["text"] == reference(p, 10, scheme)
        if scheme == "kv4-start16":  # the 4-token row never reaches its start: its batch runs eagerly
            assert decoder.eager_steps >= 1
        elif scheme.startswith("tova"):
            assert decoder.traces == 0 and decoder.eager_steps >= 10
        else:
            assert 1 <= decoder.traces < 10  # the longest request alone decodes 10 steps
    finally:
        srv.shutdown()
        thread.join(10)


@pytest.mark.parametrize("scheme", ["kv4", "kv8-g32"])
def test_a_byte_capped_prompt_cache_serves_affine_schemes(model_dir, reference, scheme):
    """``--prompt-cache-bytes``: mlx-lm's server sums ``nbytes`` over the caches of queued
    requests, empty ones included (every completion once got HTTP 500 on affine schemes)."""
    args = options.parse(["--model", model_dir, "--scheme", scheme, "--port", "0", "--prompt-cache-bytes", "1GB"])
    srv = start(args)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        (p,) = distinct_prompts(70, (12,))
        status, data = request(srv.port, "/v1/completions", {"prompt": words(p), "max_tokens": 6})
        assert status == 200 and data["choices"][0]["text"] == reference(p, 6, scheme)
    finally:
        srv.shutdown()
        thread.join(10)


def test_options_that_would_replace_the_caches_are_refused(model_dir, capsys):
    for flag, value, why in (
        ("--kv-bits", "4", "--scheme kv4"),
        ("--quantized-kv-start", "100", "kv4-start5000"),
        ("--draft-model", model_dir, "speculative decoding"),
    ):
        assert mlxkv_main(["serve", "--model", model_dir, flag, value]) == 2
        assert why in capsys.readouterr().err
    assert mlxkv_main(["serve", "--model", model_dir, "--scheme", "kv7"]) == 2
    assert "got bits=7" in capsys.readouterr().err


def test_the_mlxkv_serve_command(model_dir, reference):
    """The command as a user runs it: a process that prints its address and serves."""
    proc, port = serve_process("--model", model_dir, "--scheme", SCHEME)
    try:
        (p,) = distinct_prompts(60, (14,))
        status, data = request(port, "/v1/completions", {"prompt": words(p), "max_tokens": 7})
        assert status == 200 and data["choices"][0]["text"] == reference(p, 7)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        rest = proc.stderr.read()
        assert rc == 0, rest[-2000:]
    mx.eval(mx.zeros(1))


def test_the_prompt_cache_follows_mlxkvs_reuse_rule(models):
    """Never below a cache's reuse floor, never an empty prompt (mlx-lm's batch engine refuses
    one), and a copy every time."""
    from mlxkv.serve.prompt_cache import PromptCache

    model = models("llama")
    tokens = prompt(30, seed=5)
    caches = mlxkv.make_cache(model, "kv4-start16")
    mx.eval(model(mx.array(tokens[:20])[None], cache=caches))  # converts at 20: floor 20
    mx.eval(model(mx.array(tokens[20:])[None], cache=caches))
    store = PromptCache(max_size=4)
    store.insert_cache("m", tokens, caches)
    got, rest = store.fetch_nearest_cache("m", tokens)  # exact: served one token short
    assert rest == tokens[-1:] and [c.offset for c in got] == [29] * 4 and caches[0].offset == 30
    got, rest = store.fetch_nearest_cache("m", tokens[:24] + [7, 7])  # above the floor: trimmed
    assert rest == [7, 7] and [c.offset for c in got] == [24] * 4
    got, rest = store.fetch_nearest_cache("m", tokens[:12] + [7])  # below the floor: a miss
    assert got is None and rest == tokens[:12] + [7]
