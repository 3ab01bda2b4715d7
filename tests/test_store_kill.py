"""A SIGKILL at any point leaves the store openable with every entry flush() reported.

A child process puts entries (conversations growing turn by turn, so every put also
supersedes an ancestor and deletes its file after its own rename) and flushes every few
puts, printing what each flush reported durable. The parent kills it with SIGKILL after a
random delay, reopens the directory and checks that every reported entry is served whole,
with the bytes it was put with. Real processes, a real file system."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from mlxkv import PromptStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENTITY = {"model_id": "kill-test", "config_fingerprint": "c" * 64, "tokenizer_hash": "t" * 64}
LAYERS, HEADS, DIM = 4, 2, 64

CHILD = r"""
import json, random, sys
sys.path.insert(0, sys.argv[3])
from test_store_kill import IDENTITY, caches_for
from mlxkv import PromptStore

store = PromptStore(None, cap=256 << 20, directory=sys.argv[1], identity=IDENTITY)
rng = random.Random(int(sys.argv[2]))
convs = [[rng.randrange(1000) for _ in range(64)] for _ in range(4)]
for i in range(400):
    c = rng.randrange(len(convs))
    convs[c] = convs[c] + [rng.randrange(1000) for _ in range(rng.randrange(20, 200))]
    if len(convs[c]) > 1500:
        convs[c] = convs[c][:64]
    tokens = list(convs[c]) if rng.random() < 0.8 else [rng.randrange(1000) for _ in range(100)]
    store.put(tokens, caches_for(tokens))
    if i % 3 == 2:
        report = store.flush()
        print(json.dumps([t for _, t in report.durable]), flush=True)
"""


def caches_for(tokens):
    """Plain caches whose row t depends only on (t, tokens[t]): any entry that covers a
    prefix lends exactly the rows an entry of that prefix held."""
    from mlxkv import KVCache

    t = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
    pos = mx.arange(len(tokens), dtype=mx.float32)[None, None, :, None]
    out = []
    for layer in range(LAYERS):
        heads = mx.arange(HEADS, dtype=mx.float32)[None, :, None, None]
        dims = mx.arange(DIM, dtype=mx.float32)[None, None, None, :]
        k = (t * 0.001 + pos * 0.01 + layer + heads * 0.1 + dims * 1e-4).astype(mx.bfloat16)
        out.append(KVCache().adopt(k, -k, len(tokens), slack=False))
    return out


def _run_and_kill(directory, seed, delay):
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, directory, str(seed), os.path.join(ROOT, "tests")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    lines = []

    def read():
        for line in child.stdout:
            lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    started = time.time()
    while not lines and child.poll() is None and time.time() - started < 60:
        time.sleep(0.01)
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    reader.join()
    assert lines, f"the child reported nothing: {child.stderr.read()}"
    reported = []
    for line in lines:
        if line.endswith("\n"):  # a line cut by the kill was never reported
            reported += json.loads(line)
    return reported


def _check(directory, reported):
    with PromptStore(None, cap=1 << 30, directory=directory, identity=IDENTITY) as store:
        assert not store.opened.quarantined
        assert not [n for n in os.listdir(store._disk.root) if n.endswith(".tmp") or ".mlxkv-tmp." in n]
        for tokens in reported:
            hit = store.take(tokens + [5000])
            assert hit is not None and hit.prefix_len == len(tokens), "a reported entry is gone"
            for lent, want in zip(hit.caches, caches_for(tokens)):
                assert np.array_equal(
                    np.array(lent.keys[..., : len(tokens), :].view(mx.uint16)), np.array(want.keys.view(mx.uint16))
                )


def test_sigkill_at_random_points_keeps_every_reported_entry(tmp_path):
    rng = random.Random(1234)
    directory = str(tmp_path / "store")
    reported = []
    for round_ in range(3):
        reported += _run_and_kill(directory, seed=round_, delay=rng.uniform(0.05, 1.0))
        _check(directory, reported)
    assert len(reported) >= 4
