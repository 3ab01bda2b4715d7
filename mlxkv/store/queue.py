"""A tier's write queue: entries on their way to one lower tier, written by that tier's own
thread, so a slow or hung tier (a Redis that stopped answering) never delays another (the
disk).

``put`` must not wait for a disk or a network, so writes go to these queues. A queue holds
no bytes of its own (a job refers to its entry's arrays, which MLX never changes), but a job
keeps its entry's arrays alive after RAM lets the entry go: the store counts those bytes
against its cap. A job not yet started can be cancelled (its entry was replaced, superseded
or evicted first); a job can ask to run again later (``Job.retry_at``: another process holds
the upload's lease). The store's lock is every queue's lock: ``done`` is called with it held.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Job:
    entry: object
    state: str = "queued"  # queued -> running -> done | failed | cancelled (| queued again)
    error: BaseException | None = None
    result: object = None
    retry_at: float = 0.0  # monotonic time before which a queued job does not start
    attempts: int = 0


class WriteQueue:
    def __init__(self, name: str, lock: threading.Condition, run: Callable[[Job], object], done: Callable[[Job], None]):
        """``run(job)`` does the I/O (called without the lock; returns the result or raises;
        sets ``job.retry_at`` and returns to be queued again); ``done(job)`` records the
        outcome (called with the lock held)."""
        self.name = name
        self._cond = lock
        self._run, self._done = run, done
        self._jobs: list[Job] = []
        self._current: Job | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._abandoned = False

    # -- called with the lock held --------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self._closed:
            raise RuntimeError("the store is closed")
        self._jobs.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"mlxkv-store-{self.name}-writer", daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> bool:
        """Cancel a job that has not started; False if it is running or finished."""
        if job.state != "queued" or job not in self._jobs:
            return False
        self._jobs.remove(job)
        job.state = "cancelled"
        self._cond.notify_all()
        return True

    def pending(self) -> list[Job]:
        running = [self._current] if self._current is not None else []
        return running + list(self._jobs)

    @property
    def idle(self) -> bool:
        return self._current is None and not self._jobs

    def wait_idle(self, deadline: float | None = None) -> bool:
        """Wait (releasing the lock) until the queue is empty or the monotonic ``deadline``."""
        while not self.idle:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left if left is None else min(left, 0.1))
        return True

    def close(self, deadline: float | None = None) -> list[Job]:
        """Let the queued jobs finish until ``deadline`` (monotonic; None: all of them), then
        stop: the jobs not started by then are cancelled and returned, a job still running
        is left to its thread (a daemon: it cannot keep the process alive). Called with the
        lock held; releases it while waiting."""
        self._closed = True
        self._cond.notify_all()
        self.wait_idle(deadline)
        left = list(self._jobs)
        for j in left:
            j.state = "cancelled"
        self._jobs.clear()
        self._abandoned = True
        self._cond.notify_all()
        thread = self._thread
        if thread is not None and self._current is None:
            self._cond.release()
            try:
                thread.join(1.0)
            finally:
                self._cond.acquire()
        return left

    # -- the writer thread ----------------------------------------------------------------

    def _next(self) -> Job | None:
        now = time.monotonic()
        for job in self._jobs:
            if job.retry_at <= now:
                self._jobs.remove(job)
                return job
        return None

    def _loop(self):
        while True:
            with self._cond:
                while True:
                    if self._abandoned or (self._closed and not self._jobs):
                        return
                    job = self._next()
                    if job is not None:
                        break
                    wait = min((j.retry_at for j in self._jobs), default=None)
                    self._cond.wait(None if wait is None else max(0.01, wait - time.monotonic()))
                self._current = job
                job.state = "running"
            try:
                job.result = self._run(job)
                job.state = "done"
            except BaseException as e:  # a failed write is reported by flush, never raised here
                job.state, job.error = "failed", e
            with self._cond:
                self._current = None
                if job.state == "done" and job.retry_at > time.monotonic() and not self._abandoned:
                    job.state = "queued"  # asked to run again later
                    self._jobs.append(job)
                else:
                    self._done(job)
                self._cond.notify_all()
