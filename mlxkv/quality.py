"""What a cache scheme costs in answers, measured on a model: the same text through the
scheme's caches and through bf16's, compared position by position.

- :func:`prefill_logprobs`: log-probabilities of a text prefilled in chunks, the last token
  appended as a decode step, so the caches end in the state a generation sees;
- :func:`text_scores`: mean negative log-likelihood and mean KL(reference || scheme);
- :func:`teacher_forced_logprobs`: log-probabilities of decode steps fed the given tokens;
- :func:`greedy_flips`: where two runs' greedy tokens differ, the reference's top-two gap;
- :func:`held_bytes`, :func:`marginal_bytes`: what the caches hold, and one more token costs;
- :class:`NamedReadSite` and :func:`named_read_attention`: mlx-lm's attention on the seeded
  architectures attends through a cache's named read (the TurboQuant codes read).
"""

import contextlib

import mlx.core as mx


def _eval_caches(caches):
    mx.eval([c.state for c in caches])


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill_logprobs(model, caches, tokens: mx.array, chunk: int) -> mx.array:
    """Log-probabilities [B, L, V] (float32): tokens ``0 .. L-2`` prefilled in chunks of
    ``chunk``, the last token appended as a decode step, so the caches end in the state a
    generation sees (a rotating window drops the extra rows a multi-token block leaves)."""
    L = tokens.shape[1]
    bounds = [(i, min(i + chunk, L - 1)) for i in range(0, L - 1, chunk)] + [(L - 1, L)]
    out = []
    for a, b in bounds:
        lp = _logprobs(model(tokens[:, a:b], cache=caches))
        mx.eval(lp)
        _eval_caches(caches)
        out.append(lp)
    return mx.concatenate(out, axis=1)


def text_scores(lp: mx.array, ref_lp: mx.array, tokens: mx.array, first: int) -> tuple[float, float]:
    """(mean NLL, mean KL(ref || lp)) over predictions made at positions ``first .. L-2``."""
    lp, ref = lp[:, first:-1], ref_lp[:, first:-1]
    nll = -mx.take_along_axis(lp, tokens[:, first + 1 :, None], axis=-1)
    kl = mx.sum(mx.exp(ref) * (ref - lp), axis=-1)
    return float(mx.mean(nll).item()), float(mx.mean(kl).item())


def teacher_forced_logprobs(model, caches, tokens, prefill: int) -> mx.array:
    """Log-probabilities [steps, vocab] (float32) of one decode step per token after the first
    ``prefill`` tokens, which are forwarded as one block."""
    model(mx.array(tokens[:prefill])[None], cache=caches)
    out = []
    for t in tokens[prefill:]:
        out.append(_logprobs(model(mx.array([[t]]), cache=caches)[0, -1]))
    return mx.stack(out)


def greedy_flips(reference: mx.array, other: mx.array) -> list[float]:
    """The reference's top-two gap at every step where the two runs' greedy tokens differ."""
    flips = (mx.argmax(reference, -1) != mx.argmax(other, -1)).tolist()
    top2 = mx.sort(reference, axis=-1)[:, -2:]
    return [g for g, f in zip((top2[:, 1] - top2[:, 0]).tolist(), flips) if f]


def held_bytes(caches) -> int:
    return int(sum(c.nbytes for c in caches))


def marginal_bytes(caches) -> int:
    return int(sum(c.bytes_per_token() for c in caches))


class NamedReadSite:
    """A cache behind the named reads: the model's append becomes ``append_decode`` /
    ``append_window`` and its attention call (patched by :func:`named_read_attention`)
    attends through that read."""

    def __init__(self, cache):
        self.cache, self.read = cache, None

    def update_and_fetch(self, keys, values):
        name = "append_decode" if keys.shape[2] == 1 else "append_window"
        self.read = getattr(self.cache, name)(keys, values)
        return self.read.keys, self.read.values

    def __getattr__(self, name):
        return getattr(self.cache, name)


@contextlib.contextmanager
def named_read_attention():
    """Route the seeded architectures' attention calls on a :class:`NamedReadSite` to its read."""
    import mlx_lm.models.gemma3_text
    import mlx_lm.models.lfm2
    import mlx_lm.models.llama

    modules = (mlx_lm.models.llama, mlx_lm.models.gemma3_text, mlx_lm.models.lfm2)
    saved = [m.scaled_dot_product_attention for m in modules]
    for m, real in zip(modules, saved):

        def sdpa(q, k, v, cache, scale, mask, sinks=None, real=real):
            if isinstance(cache, NamedReadSite):
                return cache.read.attend(q, scale)
            return real(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

        m.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        for m, real in zip(modules, saved):
            m.scaled_dot_product_attention = real
