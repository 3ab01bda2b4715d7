"""The write queue: entries on their way to the lower tiers, written by one thread.

``put`` must not wait for a disk or a network, so writes go to this queue; one writer
thread runs them in order. The queue holds no bytes of its own (a job refers to the entry's
arrays, which MLX never changes), but a job keeps its entry's arrays alive after RAM lets
the entry go, so the store counts the bytes of every job whose entry is no longer in RAM
against its cap: that bound is what keeps RAM from growing while the disk is slow.

A job not yet started can be cancelled (its entry was replaced or superseded before it
reached the disk). The store's lock is the queue's lock: ``done`` is called with it held.
"""

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Job:
    entry: object
    state: str = "queued"  # queued -> running -> done | failed | cancelled
    error: BaseException | None = None
    result: dict = field(default_factory=dict)


class WriteQueue:
    def __init__(self, lock: threading.Condition, run: Callable[[Job], None], done: Callable[[Job], None]):
        """``run(job)`` does the I/O (called without the lock; raises on failure);
        ``done(job)`` records the outcome (called with the lock held)."""
        self._cond = lock
        self._run, self._done = run, done
        self._jobs: deque[Job] = deque()
        self._current: Job | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- called with the lock held --------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self._closed:
            raise RuntimeError("the store is closed")
        self._jobs.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlxkv-store-writer", daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> bool:
        """Cancel a job that has not started; False if it is running or finished."""
        if job.state != "queued":
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

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._cond.wait_for(lambda: self.idle, timeout)

    def close(self) -> None:
        """Let the queued jobs finish, then stop the thread (called with the lock held;
        releases it while waiting)."""
        self._closed = True
        self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            self._cond.wait_for(lambda: self.idle)
            self._cond.release()
            try:
                thread.join()
            finally:
                self._cond.acquire()

    # -- the writer thread ----------------------------------------------------------------

    def _loop(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._current = self._jobs.popleft()
                job.state = "running"
            try:
                self._run(job)
                job.state = "done"
            except BaseException as e:  # a failed write is reported by flush, never raised here
                job.state, job.error = "failed", e
            with self._cond:
                self._current = None
                self._done(job)
                self._cond.notify_all()
