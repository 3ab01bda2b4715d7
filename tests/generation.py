"""Forward passes the tests share: a prompt through a model in chunks, greedy decode steps."""

import mlx.core as mx


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
