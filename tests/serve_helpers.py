"""Shared by the server tests: prompts as words the seeded tokenizer reads, the server
started in this process or as the ``mlxkv serve`` command a user starts, and clients."""

import http.client
import json
import os
import re
import subprocess
import sys
import threading

import mlx_lm
import openai
from mlx_lm.sample_utils import make_logits_processors

import mlxkv
from mlxkv.serve import options
from mlxkv.serve.server import start


def words(tokens):
    """Text the seeded tokenizer encodes to exactly ``tokens``."""
    return " ".join(f"<{t:02x}>" for t in tokens)


def reference_answers(model_dir, scheme):
    """``answer(tokens, max_tokens, scheme=scheme, logit_bias=None)``: what ``mlx_lm.generate``
    answers (greedy) with the model of ``model_dir`` and fresh mlxkv caches of the scheme;
    ``answer.tokenizer`` is the model's."""
    model, tokenizer = mlx_lm.load(model_dir)

    def answer(tokens, max_tokens, scheme=scheme, logit_bias=None):
        caches = mlxkv.make_cache(model, scheme)
        processors = make_logits_processors(logit_bias=logit_bias)
        return mlx_lm.generate(
            model, tokenizer, tokens, max_tokens=max_tokens, prompt_cache=caches, logits_processors=processors
        )

    answer.tokenizer = tokenizer
    return answer


def serve_process(*argv, **popen):
    """``python -m mlxkv.cli serve ARGV --port 0`` started (``popen``: more arguments of
    ``subprocess.Popen``); returns (process, port) once it printed its address (the first
    line of its banner), which it does once its port listens: a connection made then waits
    in the listen backlog, never refused."""
    cmd = [sys.executable, "-m", "mlxkv.cli", "serve", *argv, "--port", "0"]
    env = {**popen.pop("env", os.environ), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, **popen)
    for line in proc.stderr:
        found = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
        if found:
            return proc, int(found.group(1))
    proc.wait(30)
    raise AssertionError(f"the server did not report its address (exit code {proc.returncode})")


class Running:
    """``mlxkv serve ARGV --port 0`` started in this process, served from a thread."""

    def __init__(self, *argv):
        self.server = start(options.parse([*argv, "--port", "0"]))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self):
        self.server.shutdown()
        self.thread.join(10)


def openai_client(port) -> openai.OpenAI:
    """The official client, pointed at the server on loopback (no retries: each request once)."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def post_completion(port, tokens, max_tokens=6, timeout=120):
    """A greedy ``/v1/completions`` request of ``tokens`` over raw HTTP: (response, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"prompt": words(tokens), "max_tokens": max_tokens, "temperature": 0.0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    return response, data


def completion(port, tokens, max_tokens, timeout=120):
    """One greedy completion of ``tokens`` over real HTTP: (text, prompt tokens, cached
    tokens) from its answer and usage block."""
    response, data = post_completion(port, tokens, max_tokens, timeout)
    assert response.status == 200, data
    usage = data["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return data["choices"][0]["text"], usage["prompt_tokens"], cached
