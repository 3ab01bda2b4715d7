"""``mlxkv serve --model <fetched directory>`` answers a chat request as ``mlx_lm.server`` does on
the same directory: both started as a user starts them, spoken to over real HTTP on loopback."""

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from real_models import SMOLLM2, child_env, model_dir
from serve_helpers import serve_process

pytestmark = pytest.mark.real

REQUEST = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 10,
    "temperature": 0.0,
}


def chat(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(REQUEST), {"Content-Type": "application/json"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 200, body
    return body


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_lm_server(directory):
    """``python -m mlx_lm.server`` on a free loopback port; returns (process, port) once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", directory, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=child_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"mlx_lm.server did not come up: {proc.stderr.read()[-2000:]}")


def stop(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_mlxkv_serve_answers_a_chat_request_as_mlx_lm_server_does():
    """Both servers run at once (one MLX thread each on two cores, each on OpenBLAS where it is
    installed: they compare only with each other) and get the same request."""
    directory = model_dir(SMOLLM2)
    procs = []
    try:
        theirs_proc, theirs_port = mlx_lm_server(directory)
        procs.append(theirs_proc)
        ours_proc, ours_port = serve_process("--model", directory, env=child_env())
        procs.append(ours_proc)
        with ThreadPoolExecutor(2) as pool:
            theirs, ours = pool.map(chat, (theirs_port, ours_port))
    finally:
        for proc in procs:
            stop(proc)
    answer = ours["choices"][0]["message"]["content"]
    assert answer == theirs["choices"][0]["message"]["content"]
    assert "Paris" in answer
    assert ours["usage"] == theirs["usage"]
