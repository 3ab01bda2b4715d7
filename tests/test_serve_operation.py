"""``mlxkv serve`` as an operator runs it: options refused before anything loads (exit
status 2), a model that fails to load (exit status 1, never an abort), the startup banner,
``GET /metrics`` (read back with Prometheus' own parser) and ``GET /health``."""

import http.client
import json
import re
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import Running, openai_client, serve_process, words

from mlxkv.cli import main as mlxkv_main
from mlxkv.models.seeded import prompt, save_model_dir

SCHEME = "bf16"


def serve_command(*argv, timeout=120):
    """``python -m mlxkv.cli serve ARGV`` run to its end: (exit status, stderr)."""
    cmd = [sys.executable, "-m", "mlxkv.cli", "serve", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr


def test_options_that_cannot_be_served_exit_2_before_the_model_loads(tmp_path, capsys):
    """The model directory does not exist: had it been loaded first, the exit status would
    be 1 ("cannot load the model")."""
    missing = str(tmp_path / "no-model")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for argv, says in (
        (["--store", str(a_file)], f"the store directory '{a_file}' is not a directory"),
        (["--store", str(a_file / "sub")], f"cannot be made: '{a_file}' is a file, not a directory"),
        (["--store", str(a_file / "a" / "b")], f"cannot be made: '{a_file}' is a file, not a directory"),
        (
            ["--redis", "not-a-url"],
            "--redis must be a Redis URL (redis://host:6379/0, rediss://, unix:///path.sock, or redis+cluster://",
        ),
        (["--max-kv-size", "4"], "max_kv_size must be an integer above the 4 positions a ring keeps"),
        (["--scheme", "turbo-k8v3", "--max-kv-size", "64"], "scheme 'turbo-k8v3' has no ring form"),
        (["--scheme", "kv7"], "--scheme kv7: affine quantization needs bits in"),
        (["--decode-concurrency", "0"], "--decode-concurrency must be at least 1, got 0"),
        (["--kv-bits", "4"], "--scheme kv4"),
    ):
        assert mlxkv_main(["serve", "--model", missing, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "cannot load" not in err, err
    status, err = serve_command("--model", missing, "--store", str(a_file))  # what the shell sees
    assert status == 2 and "not a directory" in err


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path):
    """Weights read, then refused (the config asks for 6 layers, the file has 4): before the
    model loaded in the main thread, MLX aborted the process at exit (SIGABRT, 134)."""
    broken = save_model_dir("llama", str(tmp_path / "broken"))
    with open(f"{broken}/config.json") as f:
        config = json.load(f)
    with open(f"{broken}/config.json", "w") as f:
        json.dump({**config, "num_hidden_layers": 6}, f)
    for _ in range(2):
        status, err = serve_command("--model", broken, "--port", "0")
        assert status == 1, err[-2000:]
        assert f"mlxkv serve: error: cannot load the model '{broken}': ValueError:" in err
        assert "terminate called" not in err
    status, err = serve_command("--model", str(tmp_path / "missing"), "--port", "0")
    assert status == 1 and "cannot load the model" in err


def test_the_banner_says_where_it_serves_and_what_it_caches(llama_dir, tmp_path):
    store = tmp_path / "store"
    for found in (0, 1):  # the second start finds the entry the first one wrote
        proc, port = serve_process("--model", llama_dir, "--scheme", "kv4", "--store", str(store))
        try:
            lines = [proc.stderr.readline().strip() for _ in range(2)]
            assert re.search(
                rf"mlxkv serve: prompt store for kv4-g64 caches: ram \(memory\), 0 entries; "
                rf"disk \({re.escape(str(store))}/[0-9a-f]+\), {found} entries$",
                lines[0],
            ), lines
            assert lines[1].endswith("web pages allowed (CORS): none (no CORS header); GET /metrics, /health")
            if not found:
                openai_client(port).completions.create(model="default_model", prompt=words(prompt(9)), max_tokens=3)
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
    proc, port = serve_process("--model", llama_dir, "--prompt-cache-size", "4")
    try:
        assert proc.stderr.readline().strip().endswith("prompt cache in memory, 4 entries (no --store or --redis)")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    return response, response.read().decode()


def metrics(port) -> dict:
    """``GET /metrics`` parsed by Prometheus' parser, once no request is in flight (a client
    can read its answer a moment before the server counts it): {(name, labels): value}."""
    deadline = time.monotonic() + 30
    while True:
        response, text = get(port, "/metrics")
        assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        if samples[("mlxkv_requests_in_flight", ())] == 0 or time.monotonic() > deadline:
            return samples


def test_metrics_count_requests_and_tokens_and_health_says_ok(llama_dir):
    server = Running("--model", llama_dir, "--scheme", SCHEME)
    try:
        client = openai_client(server.port)
        first, second = [1] + prompt(12, seed=3)[1:], [2] + prompt(20, seed=4)[1:]
        answers = [client.completions.create(model="default_model", prompt=words(first), max_tokens=5)]
        answers.append(client.completions.create(model="default_model", prompt=words(first + [7]), max_tokens=4))
        streamed = client.completions.create(
            model="default_model",
            prompt=words(second),
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [e.usage for e in streamed if e.usage is not None]
        with pytest.raises(Exception, match="stop must be"):
            client.completions.create(model="default_model", prompt="<01>", max_tokens=2, extra_body={"stop": 5})
        m = metrics(server.port)
        assert m[("mlxkv_requests_total", (("code", "200"),))] == 3
        assert m[("mlxkv_requests_total", (("code", "400"),))] == 1
        everything = [a.usage for a in answers] + usage
        assert m[("mlxkv_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in everything)
        assert m[("mlxkv_completion_tokens_total", ())] == sum(u.completion_tokens for u in everything)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in everything)
        assert cached >= len(first) - 1 and m[("mlxkv_cached_prompt_tokens_total", ())] == cached
        assert m[("mlxkv_generation_failures_total", ())] == 0
        assert m[("mlxkv_prompt_cache_entries", ())] >= 1 and m[("mlxkv_prompt_cache_bytes", ())] > 0
        response, text = get(server.port, "/health")
        assert response.status == 200 and json.loads(text) == {"status": "ok"}
    finally:
        server.stop()
