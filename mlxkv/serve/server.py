"""``mlxkv serve``: mlx-lm's OpenAI-compatible HTTP server on mlxkv caches of one scheme.

mlx-lm's handler, request handling, batch engine and prompt cache protocol run unchanged;
mlxkv reaches in at these seams:

- the model's ``make_cache`` (``install_scheme``): every place mlx-lm makes a prompt cache
  (its batch engine, its one-request path, its batchability probe) asks the model, so they
  all get mlxkv caches of the scheme;
- the prompt cache object (``start(..., prompt_cache=)``; ``mlxkv.serve.prompt_cache``):
  what serves cached prefixes and takes finished rows;
- the request handler (``ServingHandler``): each request is checked and tokenized in its own
  thread before it is queued (``mlxkv.serve.requests``): a bad one gets HTTP 400 and never
  reaches the generation thread its neighbours share; mlxkv's errors get their own status
  (mlx-lm answers every failed request with 404); ``GET /metrics`` and ``GET /health``
  (``mlxkv.serve.metrics``); CORS headers only for the origins ``--allowed-origins`` names;
- the listening socket (``mlxkv.serve.listener``): at most ``--max-connections`` served at
  once, one more answered 503;
- the generation thread (``ServingResponseGenerator``): mlx-lm's thread ends for good on the
  first exception; here the requests in flight get the error and the thread goes on serving.

The model loads in the calling thread, before the generation thread starts: a model that
fails to load is an ordinary exception there (MLX aborts the process at exit when a failed
load ran in another thread). With ``--compiled`` the loaded model is wrapped by
``mlxkv.compiled_model`` (fallback eager), so the engine's decode steps run compiled.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import weakref
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from ..caches.compiled import compiled_model
from ..caches.schemes import canonical_scheme, make_cache, model_config
from ..checks import is_int
from ..errors import MLXKVError
from . import requests
from .listener import listening_server
from .metrics import CONTENT_TYPE, ServerCounters, health, render
from .options import FlagError, cache_options, check_flags, mlx_lm_arguments, store_scheme
from .prompt_cache import build_prompt_cache
from .requests import Limits, RequestError

JSON = "application/json"


class GenerationError(MLXKVError):
    """Generation failed for a request in flight; the server goes on serving the others."""

    http_status = 500


class SchemeCaches:
    """``model.make_cache`` for mlx-lm: mlxkv caches of ``scheme`` for every request.
    ``layer_template`` is the model's own ``make_cache`` (what each layer needs), or None."""

    def __init__(self, model, scheme: str, layer_template, **options):
        canonical_scheme(scheme, **options)  # a bad scheme or option fails now, not at a request
        self.model, self.scheme, self.options = model, scheme, options
        self.layer_template = layer_template

    def __call__(self):
        return make_cache(self.model, self.scheme, **self.options)


def install_scheme(model, scheme: str, **options) -> SchemeCaches:
    """Make ``model.make_cache()`` return mlxkv caches of ``scheme`` (so mlx-lm's
    ``make_prompt_cache(model)`` does)."""
    current = getattr(model, "make_cache", None)
    factory = SchemeCaches(model, scheme, getattr(current, "layer_template", current), **options)
    model.make_cache = factory
    return factory


def vocabulary_size(model) -> int:
    """The rows of the model's logits (and embedding): its config's ``vocab_size``, else
    measured on one token."""
    cfg = model_config(model)
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if is_int(size) and size > 0:
        return size
    return int(model(mx.array([[0]])).shape[-1])


class SchemeModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider; a loaded model makes mlxkv caches of the scheme."""

    def __init__(self, cli_args, scheme: str, options: dict | None = None, compiled: bool = False):
        """``compiled``: the model decodes through ``mlxkv.compiled_model``; a step that a cache
        cannot enter compiled runs eagerly with an ``EagerDecodeWarning``."""
        super().__init__(cli_args)
        self.scheme, self.options = scheme, dict(options or {})
        self.compiled = compiled
        self.vocab = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        super()._load(model_path, adapter_path, draft_model_path)
        install_scheme(self.model, self.scheme, **self.options)
        self.is_batchable = self.draft_model is None and all(hasattr(c, "merge") for c in make_prompt_cache(self.model))
        self.vocab = vocabulary_size(self.model)
        if self.compiled:
            self.model = compiled_model(self.model, fallback="eager")


class _Tracked:
    """A request's response queue that knows whether the request is still in flight."""

    def __init__(self, queue, inflight):
        self.queue, self.inflight = queue, inflight
        inflight.add(self)

    def put(self, item):
        if item is None or isinstance(item, Exception):
            self.inflight.discard(self)
        self.queue.put(item)


class CheckedRequest(mlx_server.CompletionRequest):
    """A request that passed ``mlxkv.serve.requests`` with what mlx-lm's ``_tokenize`` made
    of it (in the handler's thread), so the generation thread does not tokenize it again."""

    def __init__(self, request, tokenizer, tokenized):
        super().__init__(request.request_type, request.prompt, request.messages, request.tools, request.role_mapping)
        self.tokenizer, self.tokenized = tokenizer, tokenized


class ServingResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread, kept alive: an exception fails the requests in flight
    (``GenerationError``) and the loop starts again (the model and prompt cache stay).
    ``limits``: what a request must respect (``mlxkv.serve.requests.Limits``)."""

    def __init__(self, model_provider, prompt_cache, limits: Limits, counters: ServerCounters | None = None):
        self._inflight = weakref.WeakSet()  # requests removed by mlx-lm are dropped with them
        self.limits = limits
        self.failures = 0
        self.counters = counters if counters is not None else ServerCounters()
        super().__init__(model_provider, prompt_cache)  # starts the thread

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:
                self.failures += 1
                logging.exception(f"mlxkv serve: generation failed, the requests in flight get the error: {e}")
                failure = GenerationError(f"generation failed: {type(e).__name__}: {e}")
                for request in list(self._inflight):
                    request.put(failure)

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is None:
            return None
        rqueue, *rest = request
        return (_Tracked(rqueue, self._inflight), *rest)

    def check(self, request, chat_template_kwargs, max_tokens: int) -> CheckedRequest:
        """Tokenize ``request`` as the generation thread would and check the prompt (called
        in the handler's thread); raises ``RequestError``."""
        tokenizer = self.model_provider.tokenizer
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)
        try:
            tokenized = super()._tokenize(tokenizer, request, args)
        except Exception as e:  # a template or content mlx-lm cannot render: this request's
            what = "messages" if request.request_type == "chat" else "prompt"
            raise RequestError(f"cannot make a prompt of this request: {type(e).__name__}: {e}", what) from e
        requests.check_prompt(tokenized[0], max_tokens, self.limits, chat=request.request_type == "chat")
        return CheckedRequest(request, tokenizer, tokenized)

    def _tokenize(self, tokenizer, request, args):
        if isinstance(request, CheckedRequest) and request.tokenizer is tokenizer:
            prompt, segments, types, state, vision = request.tokenized  # mlx-lm edits the lists: copies
            return list(prompt), [list(s) for s in segments], list(types), state, vision
        return super()._tokenize(tokenizer, request, args)

    def generate(self, request, generation_args, progress_callback=None):
        ctx, response = super().generate(request, generation_args, progress_callback)
        self.counters.prompt(len(ctx.prompt), max(ctx.prompt_cache_count, 0))
        return ctx, self.counters.generated(response)


class ServingHandler(mlx_server.APIHandler):
    """mlx-lm's request handler. Each completion request is checked before it is queued
    (a bad one gets 400), every error is answered in OpenAI's shape (``{"error": {"message",
    "type", "param", "code"}}``, which the official client shows) with mlxkv's status for
    mlxkv's errors (mlx-lm answers every failed request with 404), a failure after the
    response started is reported to the client instead of dropping the connection, and
    every completion request is counted (``GET /metrics``)."""

    status = None  # the status line sent

    def send_response(self, code, message=None):
        self.status = code
        super().send_response(code, message)

    def _set_cors_headers(self):
        if self.response_generator.cli_args.allowed_origins:  # CORS only where it was asked for
            super()._set_cors_headers()

    def _set_completion_headers(self, status_code: int = 200):
        error = sys.exc_info()[1]
        if status_code < 400 or error is None:
            return super()._set_completion_headers(status_code)
        # mlx-lm is answering the exception it caught, and writes {"error": "..."} next: answer
        # it here instead, and drop what mlx-lm writes after
        status = getattr(error, "http_status", 500 if status_code == 404 else status_code)
        self._answer_error(status, error)
        self.wfile = _Answered(self.wfile)

    def _answer_error(self, status: int, error: Exception):
        payload = json.dumps(error_body(status, error)).encode()
        super()._set_completion_headers(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def do_POST(self):
        counters = self.response_generator.counters
        counters.started()
        disconnected = False
        try:
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type != JSON:
                why = f"a request body must be JSON, sent with Content-Type: {JSON} (got {content_type or 'none'})"
                return self._answer_error(415, RequestError(why, "Content-Type"))
            super().do_POST()
        except (BrokenPipeError, ConnectionResetError):
            disconnected = True
        except Exception:
            self.status = 500  # the answer broke off
            raise
        finally:
            counters.finished(self.status or 500, disconnected)

    def validate_model_parameters(self):
        super().validate_model_parameters()  # mlx-lm's type and range checks (ValueError: 400)
        requests.check_parameters(self, self.response_generator.limits)
        # One model description for every request: mlx-lm reloads the model for another
        # name of it (its path, /v1/models' id) and drains the batch for another description
        self.model_name = self.requested_model  # what the answers echo
        self.requested_model, self.adapter, self.requested_draft_model = "default_model", None, "default_model"

    def generate_response(self, *args, **kwargs):
        return {**super().generate_response(*args, **kwargs), "model": self.model_name}

    def completion_usage_response(self, *args, **kwargs):
        return {**super().completion_usage_response(*args, **kwargs), "model": self.model_name}

    def handle_text_completions(self):
        requests.check_prompt_field(self.body)
        return self._checked(super().handle_text_completions())

    def handle_chat_completions(self):
        messages = self.body.get("messages")
        requests.check_messages(messages)
        if self.response_generator.model_provider.processor is None and any(mlx_server._image_parts(messages)):
            # refused before mlx-lm fetches the images' URLs for a model that takes none
            raise RequestError("this model takes no images: send text content parts only", "messages")
        return self._checked(super().handle_chat_completions())

    def _checked(self, request):
        return self.response_generator.check(request, self.chat_template_kwargs, self.max_tokens)

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        except GenerationError as e:
            self._late_failure(e)

    def _late_failure(self, error: GenerationError):
        if self.stream:  # the status line and headers are out: end the stream with the error
            self.wfile.write(f"data: {json.dumps(error_body(error.http_status, error))}\n\n".encode())
            self.wfile.flush()
            self.status = error.http_status
        else:  # nothing is sent yet: replace the buffered 200 by the error
            self._headers_buffer = []
            self._answer_error(error.http_status, error)

    def do_GET(self):
        generator = self.response_generator
        if self.path == "/metrics":
            self._answer(200, CONTENT_TYPE, render(generator.counters, generator.failures, generator.prompt_cache))
        elif self.path == "/health":
            status, body = health(generator.is_healthy, generator.prompt_cache)
            self._answer(status, JSON, json.dumps(body))
        else:
            super().do_GET()

    def _answer(self, status: int, content_type: str, text: str):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def error_body(status: int, error: Exception) -> dict:
    """OpenAI's error object for ``error`` answered with HTTP ``status``."""
    message = f"the request body is not JSON: {error}" if isinstance(error, json.JSONDecodeError) else str(error)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": getattr(error, "param", None), "code": None}}


class _Answered:
    """A connection's writer once the handler answered: what mlx-lm writes after is dropped."""

    def __init__(self, wfile):
        self._wfile = wfile

    @property
    def closed(self) -> bool:
        return self._wfile.closed

    def write(self, data) -> int:
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._wfile.close()


class Server:
    """A started ``mlxkv serve``: ``port``, ``banner()``, ``serve_forever()``, ``shutdown()``."""

    def __init__(self, httpd, generator, prompt_cache, args):
        self.httpd, self.generator, self.prompt_cache = httpd, generator, prompt_cache
        self.args = args
        self._serving = False

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def banner(self) -> list[str]:
        """What ``mlxkv serve`` prints when it starts: where it listens, the prompt cache
        and its tiers (where, how many entries were found), who may call it."""
        a = self.args
        lines = [f"mlxkv serve: {a.model} on {a.scheme} caches at http://{a.host}:{self.port}"]
        report = getattr(self.prompt_cache, "open_report", None)
        if report is None:
            cap = "" if a.prompt_cache_bytes is None else f", {_mib(a.prompt_cache_bytes)} at most"
            lines.append(
                f"mlxkv serve: prompt cache in memory, {a.prompt_cache_size} entries{cap} (no --store or --redis)"
            )
        else:
            tiers = "; ".join(opened.line() for opened in report)
            lines.append(f"mlxkv serve: prompt store for {store_scheme(a)} caches: {tiers}")
        origins = ", ".join(a.allowed_origins) if a.allowed_origins else "none (no CORS header)"
        lines.append(f"mlxkv serve: web pages allowed (CORS): {origins}; GET /metrics, /health")
        return lines

    def serve_forever(self):
        self._serving = True
        with contextlib.suppress(KeyboardInterrupt):
            self.httpd.serve_forever()

    def shutdown(self):
        """Stop serving (from any thread), close the port, stop the generation thread, close
        the prompt store (its queued writes reach the directory and Redis first, each tier
        on its own writer, within the store's ``close_timeout``). Returns the store's last
        ``FlushReport`` (None without a store)."""
        if self._serving:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.generator.stop_and_join()
        return _close(self.prompt_cache)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def start(args, prompt_cache=None) -> Server:
    """Check the options, load the model (in this thread), open the prompt store, bind the
    port and start the generation thread (``args`` from ``mlxkv.serve.options``); requests
    are served once ``serve_forever()`` runs (in this thread or another). ``prompt_cache``:
    any object with mlx-lm's prompt-cache interface (default: ``build_prompt_cache(args)``).

    Raises ``FlagError`` for options that cannot be served (before anything loads) and
    ``MLXKVError`` for a model that does not load, a store that does not open or a port
    that cannot be bound."""
    check_flags(args)
    cli_args = mlx_lm_arguments(args)
    try:
        cache = prompt_cache if prompt_cache is not None else build_prompt_cache(args)  # opened at bind
    except MLXKVError as e:  # the store's options (StoreOptions checks them)
        raise FlagError(str(e)) from e
    provider = SchemeModelProvider(cli_args, args.scheme, cache_options(args), compiled=args.compiled)
    try:
        provider.load_default()
    except Exception as e:
        raise MLXKVError(f"cannot load the model {args.model!r}: {type(e).__name__}: {e}") from e
    bind = getattr(cache, "bind", None)
    if bind is not None:
        try:
            bind(provider.model, provider.tokenizer)
        except Exception as e:
            raise MLXKVError(f"cannot open the prompt store: {type(e).__name__}: {e}") from e
    context = args.max_context
    if context is None:
        context = model_config(provider.model).get("max_position_embeddings")
    names = {"default_model", args.model, os.path.realpath(args.model)}
    limits = Limits(provider.vocab, context, frozenset(names), args.adapter_path)
    counters = ServerCounters()
    try:
        family, _, _, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
        fingerprint = mlx_server.get_system_fingerprint()
        httpd = listening_server(
            address[:2],
            family,
            lambda *a, **k: ServingHandler(generator, *a, system_fingerprint=fingerprint, **k),
            args.max_connections,
            refused=counters.refused,
        )
    except OSError as e:
        _close(cache)
        raise MLXKVError(f"cannot listen on {args.host}:{args.port}: {e}") from e
    generator = ServingResponseGenerator(provider, cache, limits, counters)
    return Server(httpd, generator, cache, args)


def _close(cache):
    close = getattr(cache, "close", None)
    return None if close is None else close()
