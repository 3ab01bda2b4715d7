"""``GET /metrics``: the server's and its prompt store's counters in Prometheus' text
exposition format (version 0.0.4; docs/serving.md lists every metric); ``GET /health``:
whether the server serves and each tier's health, as JSON.

The format is a few lines of text per metric (``# HELP``, ``# TYPE``, then ``name{labels}
value``); writing it here costs less than a dependency would. The tests read it back with
Prometheus' own parser (``prometheus_client``).
"""

import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerCounters:
    """What the server counts itself, from every handler thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter()  # HTTP status of each completion request -> count
        self.in_flight = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self.refused_connections = 0  # past --max-connections

    def refused(self) -> None:
        with self._lock:
            self.refused_connections += 1

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, status: int, disconnected: bool = False) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[status] += 1
            self.disconnects += disconnected

    def prompt(self, tokens: int, cached: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens
            self.cached_tokens += cached

    def generated(self, responses):
        """``responses``, counting each generated token as it passes."""
        for r in responses:
            with self._lock:
                self.completion_tokens += 1
            yield r


class Exposition:
    """Metrics in the text format, one family after another."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, name: str, kind: str, help_text: str, samples) -> None:
        """``samples``: a number, or ``[(labels dict, number), ...]``."""
        if not isinstance(samples, list):
            samples = [({}, samples)]
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(counters: ServerCounters, generation_failures: int, prompt_cache) -> str:
    out = Exposition()
    with counters._lock:
        requests = sorted(counters.requests.items())
        tokens = (counters.prompt_tokens, counters.cached_tokens, counters.completion_tokens)
        in_flight, disconnects = counters.in_flight, counters.disconnects
        refused = counters.refused_connections
    out.add(
        "mlxkv_requests_total",
        "counter",
        "Completion requests answered, by HTTP status (a stream that failed after its 200 counts as 500).",
        [({"code": code}, n) for code, n in requests],
    )
    out.add("mlxkv_requests_in_flight", "gauge", "Completion requests being answered now.", in_flight)
    out.add("mlxkv_client_disconnects_total", "counter", "Clients that hung up before their answer ended.", disconnects)
    out.add(
        "mlxkv_refused_connections_total",
        "counter",
        "Connections answered 503 because --max-connections were being served.",
        refused,
    )
    out.add("mlxkv_prompt_tokens_total", "counter", "Prompt tokens of the requests served.", tokens[0])
    out.add("mlxkv_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prompt cache.", tokens[1])
    out.add("mlxkv_completion_tokens_total", "counter", "Tokens generated.", tokens[2])
    out.add(
        "mlxkv_generation_failures_total",
        "counter",
        "Failures of the generation thread (its requests in flight got the error; it serves on).",
        generation_failures,
    )
    out.add("mlxkv_prompt_cache_entries", "gauge", "Entries the prompt cache holds in memory.", len(prompt_cache))
    out.add("mlxkv_prompt_cache_bytes", "gauge", "Bytes the prompt cache holds in memory.", prompt_cache.nbytes)
    counters_of = getattr(prompt_cache, "counters", None)
    if counters_of is not None:
        _store(out, counters_of())
    return out.text()


#: (metric, type, help, per-tier counter); every per-tier sample is labelled with its tier
TIER_METRICS = [
    ("mlxkv_store_hits_total", "counter", "Prompts served a prefix by the prompt store, by tier.", "hits"),
    ("mlxkv_store_failures_total", "counter", "Calls to a tier that failed.", "failures"),
    ("mlxkv_store_skipped_total", "counter", "Calls not made to a tier while it was failing.", "skipped"),
    ("mlxkv_store_refused_entries_total", "counter", "Entries a tier held that failed a check.", "refused"),
    ("mlxkv_store_writes_total", "counter", "Entries written to a tier.", "writes"),
    ("mlxkv_store_read_bytes_total", "counter", "Bytes read from a tier.", "bytes_read"),
    ("mlxkv_store_written_bytes_total", "counter", "Bytes written to a tier.", "bytes_written"),
    ("mlxkv_store_queued_writes", "gauge", "Writes waiting for a tier.", "queued"),
    ("mlxkv_store_entries", "gauge", "Entries a tier holds (local tiers).", "entries"),
    ("mlxkv_store_bytes", "gauge", "Bytes a tier holds (local tiers).", "bytes"),
]


def _store(out: Exposition, c: dict) -> None:
    """A prompt store's ``counters()`` (docs/store.md names each)."""
    if not c:  # not open yet
        return
    out.add("mlxkv_store_misses_total", "counter", "Prompts the prompt store had no prefix for.", c["misses"])
    out.add("mlxkv_store_puts_total", "counter", "Entries put into the prompt store.", c["puts"])
    out.add("mlxkv_store_refused_total", "counter", "Entries the prompt store refused to hold.", c["refused_inserts"])
    out.add("mlxkv_store_reused_tokens_total", "counter", "Prompt tokens the prompt store served.", c["reused_tokens"])
    tiers = c["tiers"]
    for name, kind, help_text, key in TIER_METRICS:
        samples = [({"tier": t}, v[key]) for t, v in tiers.items() if v.get(key) is not None]
        out.add(name, kind, help_text, samples)
    healthy = [({"tier": t}, int(bool(v["healthy"]))) for t, v in tiers.items()]
    out.add("mlxkv_store_tier_healthy", "gauge", "1 while a tier answers, 0 while it is skipped.", healthy)


#: what ``/health`` says of each tier (``PromptStore.counters()``'s names)
HEALTH_FIELDS = ("healthy", "failing_seconds", "last_error", "breaker", "queued")


def health(serving: bool, prompt_cache) -> tuple[int, dict]:
    """``GET /health``'s status and body: ``{"status": "ok"}`` while the generation thread
    serves (mlx-lm's answer), ``"degraded"`` while a tier of the prompt store fails (the
    server answers, with fewer cached tokens: still 200), ``"unavailable"`` (503) once the
    generation thread is gone; with a store, ``"tiers"``: each tier's ``healthy``,
    ``failing_seconds``, ``last_error``, ``breaker`` (the shared tier's: ``"open"`` while it
    is skipped) and ``queued`` writes."""
    counters_of = getattr(prompt_cache, "counters", None)
    tiers = (counters_of() if counters_of is not None else {}).get("tiers", {})
    body = {"status": "ok"}
    if tiers:
        body["tiers"] = {name: {k: t[k] for k in HEALTH_FIELDS if k in t} for name, t in tiers.items()}
        if not all(t["healthy"] for t in tiers.values()):
            body["status"] = "degraded"
    if not serving:
        body["status"] = "unavailable"
    return (200 if serving else 503), body
