"""``mlxkv serve``: mlx-lm's OpenAI-compatible HTTP server on mlxkv caches of one scheme.

mlx-lm's handler, request handling, batch engine and prompt cache protocol run unchanged;
mlxkv reaches in at three seams:

- the model's ``make_cache`` (``install_scheme``): every place mlx-lm makes a prompt cache
  (its batch engine, its one-request path, its batchability probe) asks the model, so they
  all get mlxkv caches of the scheme;
- the prompt cache object (``start(..., prompt_cache=)``; ``mlxkv.serve.prompt_cache``):
  what serves cached prefixes and takes finished rows;
- the generation thread (``ServingResponseGenerator``): mlx-lm's thread ends for good on the
  first exception; here the requests in flight get the error and the thread goes on serving.
  Requests longer than the context are refused before they reach a cache.

With ``--compiled`` the loaded model is wrapped by ``mlxkv.compiled_model`` (fallback eager),
so the engine's decode steps run compiled.

The handler (``ServingHandler``) only maps mlxkv's errors to their HTTP status: mlx-lm
answers every failed request with 404.
"""

import contextlib
import json
import logging
import socket
import sys
import threading
import weakref
from http.server import ThreadingHTTPServer

from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from ..caches.compiled import compiled_model
from ..caches.schemes import make_cache, parse_scheme
from ..errors import MLXKVError, SchemeError
from .options import cache_options, mlx_lm_arguments
from .prompt_cache import build_prompt_cache


class RequestError(MLXKVError):
    """A request the server refuses (``http_status`` is what the client gets)."""

    http_status = 400


class GenerationError(MLXKVError):
    """Generation failed for a request in flight; the server goes on serving the others."""

    http_status = 500


class SchemeCaches:
    """``model.make_cache`` for mlx-lm: mlxkv caches of ``scheme`` for every request.
    ``layer_template`` is the model's own ``make_cache`` (what each layer needs), or None."""

    def __init__(self, model, scheme: str, layer_template, **options):
        parsed = parse_scheme(scheme, options)  # a bad scheme fails now, not at the first request
        if options.get("max_kv_size") is not None and parsed.ring is None:
            raise SchemeError(f"scheme {scheme!r} has no ring form: --max-kv-size cannot be used with it")
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


class SchemeModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider; a loaded model makes mlxkv caches of the scheme."""

    def __init__(self, cli_args, scheme: str, options: dict | None = None, on_load=None, compiled: bool = False):
        """``on_load(model, tokenizer)``: called after a model loads (a prompt store opens).
        ``compiled``: the model decodes through ``mlxkv.compiled_model``; a step that a cache
        cannot enter compiled runs eagerly with an ``EagerDecodeWarning``."""
        super().__init__(cli_args)
        self.scheme, self.options = scheme, dict(options or {})
        self.on_load = on_load
        self.compiled = compiled

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        super()._load(model_path, adapter_path, draft_model_path)
        install_scheme(self.model, self.scheme, **self.options)
        self.is_batchable = self.draft_model is None and all(hasattr(c, "merge") for c in make_prompt_cache(self.model))
        if self.on_load is not None:
            self.on_load(self.model, self.tokenizer)
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


class ServingResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread, kept alive: an exception fails the requests in flight
    (``GenerationError``) and the loop starts again (the model and prompt cache stay)."""

    def __init__(self, model_provider, prompt_cache, max_context: int | None = None):
        self._inflight = weakref.WeakSet()  # requests removed by mlx-lm are dropped with them
        self.max_context = max_context
        self.failures = 0
        self.load_error = None
        self.ready = threading.Event()  # the model is loaded (or failed to load)
        super().__init__(model_provider, prompt_cache)  # starts the thread

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:
                if self.model_provider.model is None:  # the model never loaded: nothing to serve
                    logging.exception("mlxkv serve: the model could not be loaded")
                    self.load_error = e
                    self._generation_failed = True
                    self.ready.set()
                    return
                self.failures += 1
                logging.exception(f"mlxkv serve: generation failed, the requests in flight get the error: {e}")
                failure = GenerationError(f"generation failed: {type(e).__name__}: {e}")
                for request in list(self._inflight):
                    request.put(failure)

    def _next_request(self, timeout=None):
        if not self.ready.is_set() and self.model_provider.model is not None:
            self.ready.set()
        request = super()._next_request(timeout)
        if request is None:
            return None
        rqueue, *rest = request
        return (_Tracked(rqueue, self._inflight), *rest)

    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        limit = self.context_limit()
        if limit is not None and len(out[0]) + args.max_tokens > limit:
            raise RequestError(
                f"the prompt has {len(out[0])} tokens and max_tokens is {args.max_tokens}: together "
                f"more than the {limit} tokens this server serves; shorten the prompt or lower max_tokens"
            )
        return out

    def context_limit(self) -> int | None:
        if self.max_context is not None:
            return self.max_context
        args = getattr(self.model_provider.model, "args", None)
        return getattr(args, "max_position_embeddings", None)


class ServingHandler(mlx_server.APIHandler):
    """mlx-lm's request handler; mlxkv's errors get their own HTTP status and a failure
    after the response started is reported to the client instead of dropping the connection."""

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404:  # mlx-lm's status for every failed request
            status_code = getattr(sys.exc_info()[1], "http_status", status_code)
        super()._set_completion_headers(status_code)

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        except GenerationError as e:
            self._late_failure(e)

    def _late_failure(self, error: GenerationError):
        body = {"error": {"message": str(error), "type": "server_error", "code": error.http_status}}
        if self.stream:  # the status line and headers are out: end the stream with the error
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        else:  # nothing is sent yet: replace the buffered 200 by the error
            self._headers_buffer = []
            payload = json.dumps(body).encode()
            self._set_completion_headers(error.http_status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        self.wfile.flush()


class Server:
    """A started ``mlxkv serve``: ``port``, ``serve_forever()``, ``shutdown()``."""

    def __init__(self, httpd, generator, prompt_cache):
        self.httpd, self.generator, self.prompt_cache = httpd, generator, prompt_cache
        self._serving = False

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def serve_forever(self):
        self._serving = True
        with contextlib.suppress(KeyboardInterrupt):
            self.httpd.serve_forever()

    def shutdown(self):
        """Stop serving (from any thread), close the port, stop the generation thread, close
        the prompt store (its queued writes reach the directory and Redis first)."""
        if self._serving:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.generator.stop_and_join()
        close = getattr(self.prompt_cache, "close", None)
        if close is not None:
            close()


def start(args, prompt_cache=None, wait: float | None = 300.0) -> Server:
    """Load the model and bind the port (``args`` from ``mlxkv.serve.options``); requests are
    served once ``serve_forever()`` runs (in this thread or another). ``prompt_cache``: any
    object with mlx-lm's prompt-cache interface (default: ``build_prompt_cache(args)``)."""
    cli_args = mlx_lm_arguments(args)
    options = cache_options(args)
    SchemeCaches(None, args.scheme, None, **options)  # refuse a bad scheme before loading anything
    cache = prompt_cache if prompt_cache is not None else build_prompt_cache(args)
    provider = SchemeModelProvider(
        cli_args, args.scheme, options, on_load=getattr(cache, "bind", None), compiled=args.compiled
    )
    generator = ServingResponseGenerator(provider, cache, args.max_context)
    if wait is not None and not generator.ready.wait(wait):
        generator.stop_and_join()
        raise MLXKVError(f"the model {args.model!r} did not load within {wait:.0f} s")
    if generator.load_error is not None:
        generator.stop_and_join()
        raise MLXKVError(f"cannot load the model {args.model!r}: {generator.load_error}")
    family, _, _, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
    server_class = type("MLXKVHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    fingerprint = mlx_server.get_system_fingerprint()
    httpd = server_class(
        address[:2], lambda *a, **k: ServingHandler(generator, *a, system_fingerprint=fingerprint, **k)
    )
    return Server(httpd, generator, cache)
