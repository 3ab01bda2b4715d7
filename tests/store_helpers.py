"""Shared tools of the prompt-store tests: cache cases of every kind, a redis-server."""

import os
import shutil
import subprocess
import tempfile
import time
import warnings

import mlx.core as mx
import numpy as np

from mlxkv.caches.schemes import make_cache, parse_scheme
from mlxkv.errors import SchemeError

# (id, arch, scheme, make_cache options, prompt length, prefill chunk)
KIND_CASES = [
    ("plain", "llama", "bf16", {}, 40, 16),
    ("affine", "llama", "kv4", {}, 40, 16),
    ("affine-g32", "llama", "kv8-g32", {}, 40, 16),
    ("bf16-first-pending", "llama", "kv4-start64", {}, 40, 16),
    ("bf16-first-converted", "llama", "kv4-start16", {}, 40, 16),
    ("ring-unwrapped", "llama", "bf16", {"max_kv_size": 64}, 40, 16),
    ("ring-wrapped", "llama", "bf16", {"max_kv_size": 24}, 40, 8),
    ("affine-ring-wrapped", "llama", "kv4", {"max_kv_size": 24}, 40, 8),
    ("sliding-rings", "gemma3", "bf16", {}, 40, 16),
    ("recurrent", "hybrid", "bf16", {}, 40, 16),
    ("turboquant", "llama", "turbo-k8v3", {}, 40, 16),
    ("tova-evicted", "llama", "tova-b32-s4", {}, 40, 16),
    ("tova-under-budget", "llama", "tova-b64-s4", {}, 40, 16),
    ("qfilters-evicted", "llama", "qfilters-b32-s4-r8", {"calib_tokens": 16}, 40, 16),
    ("qfilters-warming", "llama", "qfilters-b64-s4-r8", {"calib_tokens": 48}, 40, 16),
]


def accepted(scheme):
    try:
        parse_scheme(scheme)
        return True
    except SchemeError:
        return False


def build(model, scheme, opts, tokens, chunk):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_cache(model, scheme, **opts)
    forward(model, caches, tokens, chunk)
    return caches


def forward(model, caches, tokens, chunk=None):
    """Forward ``tokens`` in chunks; returns the last logits, float32 numpy."""
    chunk = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[i : i + chunk]]), cache=caches)[0, -1]
        mx.eval(logits, [c.state for c in caches])
    return None if logits is None else np.array(logits.astype(mx.float32))


def continuation(model, caches, tokens):
    """Logits of forwarding ``tokens`` one by one, then all of them again as one block is
    not possible (state moved); so: one by one."""
    return np.stack([forward(model, caches, [t]) for t in tokens])


def snapshot_arrays(arrays: dict) -> dict:
    return {k: np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v) for k, v in arrays.items()}


def same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class RedisServer:
    """A private redis-server on a unix socket in a temporary directory."""

    def __init__(self, *extra):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server is not installed: the Redis tier tests need it. Install it with "
                "`apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"
            )
        self.dir = tempfile.mkdtemp(prefix="mlxkv-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                "0",
                "--unixsocket",
                self.socket,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
