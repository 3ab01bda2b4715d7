"""A tier's health: its counters, its failures logged (rate-limited) with their recovery,
and for a tier across a network the circuit breaker that keeps it off the caller's path.

Every tier has a :class:`Health`: what it served, what failed, and one log line when it
starts failing and one when it recovers (not one per failure: a server that loses its disk
or its Redis answers hundreds of requests a minute). A tier reached over a network (Redis)
has a :class:`Breaker`, a ``Health`` that also runs the tier's reads on its own thread and
waits for them at most ``budget`` seconds, so a hung server costs a lookup ``budget`` once,
then nothing: while it is open (after a failure, or a call that outlived its budget) every
call is skipped at once and counted; one probe at a time, on the breaker's thread, sees
whether the tier answers again, first after ``retry`` seconds, then twice as long each time
it does not (at most ``max_retry``).
"""

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import MLXKVError

log = logging.getLogger("mlxkv.store")

#: a failing tier's state is logged again at most this often (seconds)
LOG_EVERY = 60.0


class TierUnavailable(MLXKVError):
    """A call skipped because its tier is failing (the breaker is open), or that outlived its
    budget. The store treats it as a miss (a read) or a failed write."""


class Health:
    """Counters of one tier and its failure log. Thread-safe."""

    def __init__(self, name: str, where: str, clock=time.monotonic):
        self.name, self.where = name, where
        self._clock = clock
        self._lock = threading.Lock()
        self.counts = {
            "hits": 0,
            "failures": 0,
            "skipped": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "writes": 0,
            "refused": 0,  # entries that failed a check (damaged, unauthenticated, too large)
        }
        self.failing_since: float | None = None
        self.last_error = ""
        self._logged_at = 0.0
        self._quiet = 0  # failures and skips not logged since the last line
        self._refused_at = 0.0

    @property
    def healthy(self) -> bool:
        return self.failing_since is None

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def failed(self, error: BaseException | str) -> None:
        """A call of this tier failed: counted; logged when the tier starts failing, then at
        most every :data:`LOG_EVERY` seconds."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        now = self._clock()
        with self._lock:
            self.counts["failures"] += 1
            self.last_error = text
            first = self.failing_since is None
            if first:
                self.failing_since = now
            due = first or now - self._logged_at >= LOG_EVERY
            if due:
                quiet, self._quiet, self._logged_at = self._quiet, 0, now
            else:
                self._quiet += 1
        if due:
            more = f" ({quiet} more failures or skipped calls since the last report)" if quiet else ""
            log.warning(f"prompt store: the {self.name} tier ({self.where}) is failing: {text}{more}{self._next()}")

    def _next(self) -> str:
        return "; its entries are misses until it recovers"

    def refuse(self, text: str) -> None:
        """An entry of this tier failed a check (damaged, unauthenticated, too large): a
        miss, counted, logged at most every :data:`LOG_EVERY` seconds. The tier is not
        failing for it."""
        now = self._clock()
        with self._lock:
            self.counts["refused"] += 1
            n = self.counts["refused"]
            due = now - self._refused_at >= LOG_EVERY or n == 1
            if due:
                self._refused_at = now
        if due:
            log.warning(f"prompt store: {self.name} tier ({self.where}): {text} ({n} refused so far)")

    def recovered(self) -> None:
        now = self._clock()
        with self._lock:
            since, self.failing_since = self.failing_since, None
            quiet, self._quiet = self._quiet, 0
        if since is not None:
            log.warning(
                f"prompt store: the {self.name} tier ({self.where}) recovered after {now - since:.1f} s"
                + (f" ({quiet} failures or skipped calls not logged)" if quiet else "")
            )

    def probe_if_due(self) -> None:
        """A local tier recovers when a call of it succeeds again: nothing to probe."""

    def skipped(self) -> None:
        with self._lock:
            self.counts["skipped"] += 1
            self._quiet += 1

    def snapshot(self) -> dict:
        """The counts, ``healthy``, ``failing_seconds`` (how long it has been failing, None
        while healthy) and ``last_error``."""
        now = self._clock()
        with self._lock:
            since = self.failing_since
            failing = None if since is None else round(now - since, 3)
            return {**self.counts, "healthy": since is None, "failing_seconds": failing, "last_error": self.last_error}


class Breaker(Health):
    """The health of a tier across a network, and the guard of its calls.

    ``call(fn, ...)`` runs ``fn`` on the breaker's own thread and waits at most ``budget``
    seconds; ``run(fn, ...)`` runs it on the calling thread (a tier's writer, which may
    wait). Both raise :class:`TierUnavailable` at once while the breaker is open, and open
    it on any exception of ``fn`` (re-raised) or a call past its budget. ``probe()`` must
    raise unless the tier answers (a ``PING``)."""

    def __init__(self, name, where, probe, *, budget: float, retry: float = 1.0, max_retry: float = 30.0, **kw):
        super().__init__(name, where, **kw)
        self.budget, self.retry, self.max_retry = float(budget), float(retry), float(max_retry)
        self._probe_fn = probe
        self._delay = self.retry
        self._retry_at = 0.0
        self._probing: Future | None = None
        self._busy: Future | None = None  # the call the thread is running (maybe past its budget)
        self._starting: Future | None = None  # the connection being made (``start``)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mlxkv-store-{name}")

    def _next(self) -> str:
        return f"; skipped until it answers again (next try in {self._delay:.1f} s)"

    @property
    def open(self) -> bool:
        return self.failing_since is not None

    def _admit(self) -> None:
        """Raise TierUnavailable while open; start a probe when one is due."""
        if self.failing_since is None:
            return
        self.probe_if_due()
        self.skipped()
        raise TierUnavailable(f"the {self.name} tier is failing ({self.last_error}): skipped")

    def probe_if_due(self) -> None:
        """While open, start a probe on the breaker's thread if its retry is due (and none
        runs): a store skipping a failing tier's writes calls this, so the tier is seen to
        recover whether or not lookups reach it."""
        if self.failing_since is None:
            return
        now = self._clock()
        with self._lock:
            due = now >= self._retry_at and (self._probing is None or self._probing.done())
            if due:
                self._probing = self._pool.submit(self._probe)

    def _probe(self) -> None:
        try:
            self._probe_fn()
        except Exception as e:
            with self._lock:
                self._delay = min(self.max_retry, self._delay * 2)
                self._retry_at = self._clock() + self._delay
                self.last_error = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._delay = self.retry
        self.recovered()

    def failed(self, error) -> None:
        with self._lock:
            if self.failing_since is None:
                self._delay = self.retry
            self._retry_at = self._clock() + self._delay
        super().failed(error)

    def start(self, fn) -> None:
        """Run ``fn()`` (making the tier's connection) on the breaker's thread now, without
        waiting. A call made meanwhile waits for it within its budget (and is skipped, not
        failed, if it is still running then); if ``fn`` raises, the tier is failing and
        probed as after any failure."""

        def run():
            try:
                fn()
            except Exception as e:
                self.failed(e)

        self._starting = self._pool.submit(run)

    def call(self, fn, *args):
        """``fn(*args)`` on the breaker's thread, waited for at most ``budget`` seconds."""
        self._admit()
        t0 = time.monotonic()
        starting = self._starting
        if starting is not None and not starting.done():
            try:
                starting.result(timeout=self.budget)
            except FutureTimeout:
                self.skipped()
                raise TierUnavailable(f"the {self.name} tier is still connecting: skipped") from None
            self._admit()  # it may have failed
        with self._lock:
            busy = self._busy is not None and not self._busy.done()
        if busy:  # a call past its budget still holds the thread: do not queue behind it
            self.skipped()
            raise TierUnavailable(f"the {self.name} tier is still answering an earlier call: skipped")
        future = self._busy = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=max(0.0, self.budget - (time.monotonic() - t0)))
        except FutureTimeout:
            self.failed(f"no answer within {self.budget:g} s")
            raise TierUnavailable(f"the {self.name} tier did not answer within {self.budget:g} s") from None
        except Exception as e:
            self.failed(e)
            raise

    def run(self, fn, *args):
        """``fn(*args)`` on the calling thread (which may wait up to the tier's timeouts)."""
        self._admit()
        try:
            return fn(*args)
        except Exception as e:
            self.failed(e)
            raise

    def snapshot(self) -> dict:
        """``Health.snapshot`` and ``breaker``: ``"open"`` while calls are skipped, else ``"closed"``."""
        return {**super().snapshot(), "breaker": "open" if self.open else "closed"}

    def close(self) -> None:
        """Stop the breaker's thread (without waiting for a call stuck in a hung tier)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
