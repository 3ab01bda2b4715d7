"""What a request must be before it is queued for the generation thread (docs/serving.md,
"Refused requests").

mlx-lm's server serves every request in one generation thread, and some requests fail
there for every request in flight (an empty prompt, a ``stop`` that is not a string, a
``top_k`` of at least the vocabulary under sampling) or for the process (a ``logit_bias``
token id at or beyond the vocabulary indexes outside the logits: heap corruption, a
segfault). mlxkv serve checks each request in its own handler thread, after mlx-lm's type
checks and before it is queued: a bad one gets HTTP 400 with what is wrong; the others never
see it. The prompt is tokenized there too (once: the generation thread reuses it), so an
empty prompt, a token the model has no row for or a request longer than the context is
refused before it reaches the batch.
"""

import math
from dataclasses import dataclass

from ..errors import MLXKVError

#: mlx-lm's numeric sampling and penalty parameters (the handler's attribute names)
NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "xtc_probability",
    "xtc_threshold",
)
SEED_LIMIT = 2**64  # mx.random.seed takes an unsigned 64-bit integer


class RequestError(MLXKVError, ValueError):
    """A request the server refuses (``http_status`` is what the client gets; ``param``: the
    request field at fault, if one is). A ``ValueError`` too: what mlx-lm's handler answers
    with 400."""

    http_status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What the loaded model allows. ``vocab``: token ids are in ``[0, vocab)`` (the rows of
    its embedding and logits); ``context``: prompt plus ``max_tokens`` at most this (None: no
    limit); ``models``: the names a request may give the served model; ``adapter``: the one
    adapter path it may give (the server's ``--adapter-path``)."""

    vocab: int
    context: int | None
    models: frozenset
    adapter: str | None = None


def check_parameters(handler, limits: Limits) -> None:
    """The parameters mlx-lm read from the body into ``handler`` (after its own type checks)."""
    if handler.requested_model not in limits.models:
        served = sorted(m for m in limits.models if m != "default_model")
        raise RequestError(
            f"model {handler.requested_model!r} is not served here: this server serves one model; "
            f"name it {' or '.join(repr(m) for m in ['default_model', *served])}",
            "model",
        )
    if handler.adapter is not None and handler.adapter != limits.adapter:
        raise RequestError(
            f"adapters {handler.adapter!r} is not served here: this server serves "
            + ("no adapter" if limits.adapter is None else f"the adapter {limits.adapter!r} only"),
            "adapters",
        )
    if handler.requested_draft_model not in (None, "default_model"):
        raise RequestError("draft_model is not served here: mlxkv serve runs no speculative decoding", "draft_model")
    for name in NUMBERS:
        value = getattr(handler, name)
        if not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}", name)
    if handler.top_k >= limits.vocab:
        raise RequestError(f"top_k must be below the model's vocabulary of {limits.vocab} tokens (0: off)", "top_k")
    if handler.top_logprobs > limits.vocab:
        raise RequestError(
            f"top_logprobs must be at most the model's vocabulary of {limits.vocab} tokens", "top_logprobs"
        )
    if handler.seed is not None and not 0 <= handler.seed < SEED_LIMIT:
        raise RequestError(f"seed must be an integer in [0, 2**64), got {handler.seed}", "seed")
    check_logit_bias(handler.logit_bias, limits.vocab)
    check_stop(handler.body.get("stop"))
    options = handler.stream_options
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage"), bool)):
        raise RequestError('stream_options must be an object like {"include_usage": true}', "stream_options")
    if handler.chat_template_kwargs is not None and not isinstance(handler.chat_template_kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")


def check_logit_bias(bias: dict | None, vocab: int) -> None:
    """Every key a token id of the model, every bias a finite number (mlx-lm made them int
    and float): an id outside ``[0, vocab)`` would index outside the logits."""
    for token, value in (bias or {}).items():
        if not 0 <= token < vocab:
            raise RequestError(
                f"logit_bias has token id {token}, outside the model's vocabulary: ids are 0 to {vocab - 1}",
                "logit_bias",
            )
        if not math.isfinite(value):
            raise RequestError(f"logit_bias of token {token} must be a finite number, got {value}", "logit_bias")


def check_stop(stop) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", "stop")


def check_prompt_field(body: dict) -> None:
    """A text completion's ``prompt``: a string (token-id lists are not taken)."""
    if not isinstance(body.get("prompt"), str):
        raise RequestError("prompt must be a string", "prompt")


def check_messages(messages) -> None:
    """A chat completion's ``messages``: a non-empty list of objects with a string ``role``
    and, if any, a string, list or null ``content``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise RequestError(f"messages[{i}].content must be a string or a list of content parts", "messages")


def check_prompt(tokens: list, max_tokens: int, limits: Limits, chat: bool) -> None:
    """The tokenized prompt: not empty, every id a row of the model, within the context."""
    if not tokens:
        what = "the messages render to no token (a message without content?)" if chat else "the prompt is empty"
        raise RequestError(f"{what}: a request needs at least one prompt token", "messages" if chat else "prompt")
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= limits.vocab:
        bad = low if low < 0 else high
        raise RequestError(
            f"the prompt has token id {bad}, outside the model's vocabulary of {limits.vocab}: "
            "the tokenizer and the model disagree",
            "messages" if chat else "prompt",
        )
    if limits.context is not None and len(tokens) + max_tokens > limits.context:
        raise RequestError(
            f"the prompt has {len(tokens)} tokens and max_tokens is {max_tokens}: together more than "
            f"the {limits.context} tokens this server serves; shorten the prompt or lower max_tokens",
            "max_tokens",
        )
