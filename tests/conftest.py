import warnings

import mlx.core as mx
import pytest

from mlxkv.models.seeded import build_model


@pytest.fixture(scope="session")
def models():
    cache = {}

    def get(arch, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_model(arch, **overrides)
        return cache[key]

    return get


def run(model, caches, tokens, chunk=None):
    """Forward ``tokens`` through ``model`` in chunks; returns the last logits [1, V]."""
    chunk = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[i : i + chunk])[None], cache=caches)[:, -1]
        mx.eval(logits)
    return logits


def greedy(model, caches, first_token, n):
    """Decode n tokens greedily starting from ``first_token``; returns (tokens, logits list)."""
    toks, logs, y = [], [], first_token
    for _ in range(n):
        logits = model(mx.array([[y]]), cache=caches)[:, -1]
        mx.eval(logits)
        logs.append(logits)
        y = int(mx.argmax(logits, -1).item())
        toks.append(y)
    return toks, logs


@pytest.fixture(autouse=True)
def _quiet_sliding_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sliding-window layers stay.*")
        yield
