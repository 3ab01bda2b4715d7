"""Temporary files of atomic writes: recognisable names, a lock held while writing, and the
removal of the ones whose writer is provably dead.

A write goes to ``.<name>.mlxkv-tmp.<pid>.<random>`` beside its target and holds an
exclusive ``flock`` on it until the rename. A writer killed before the rename leaves that
file behind; :func:`remove_stale` removes it once it can prove the writer dead: the lock is
free (the kernel drops a dead process's locks) **and** no process with that pid runs here
(which covers the instant between creating the file and locking it). A temporary whose pid
is alive, or that is locked, is never touched, so a live writer never loses its file.

Limits: the pid test sees this host (and this pid namespace) only, and ``flock`` on a
network file system may be local to one client. A temporary written by another host that
looks dead from here is only removed if the lock test, too, says so; if the file system
lies about locks, the cost is a failed rename on the other host, which leaves its target
unchanged (``SnapshotWriteError``), never a damaged snapshot.
"""

import contextlib
import fcntl
import os
import re
import secrets
import stat
import time

MARK = ".mlxkv-tmp."
#: a directory is scanned at most this often per process by writers (listing a directory of
#: 10,000 snapshots takes about 12 ms; a store scan calls remove_stale directly)
SCAN_INTERVAL = 60.0
_scanned: dict[str, float] = {}
_NAME = re.compile(r"\..*" + re.escape(MARK) + r"(\d+)\.[0-9a-f]{16}")
_MAX_BASE = 180  # keeps the name under the usual 255-byte limit


def create(path: str) -> tuple[int, str]:
    """A new, locked temporary file beside ``path``: (descriptor, temporary path). The
    lock lasts as long as the descriptor is open."""
    directory, base = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, f".{base[:_MAX_BASE]}{MARK}{os.getpid()}.{secrets.token_hex(8)}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # pragma: no cover - 64 random bits
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return fd, tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's live process; or not a pid
        return True
    return True


def _remove_if_dead(path: str, pid: int) -> bool:
    if _pid_alive(pid):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a writer holds it: alive after all
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            return False  # the name was reused meanwhile
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_stale_now_and_then(directory: str) -> list[str]:
    """:func:`remove_stale`, unless this process scanned ``directory`` in the last
    :data:`SCAN_INTERVAL` seconds (what a writer calls on every save)."""
    now = time.monotonic()
    if now - _scanned.get(directory, -SCAN_INTERVAL) < SCAN_INTERVAL:
        return []
    _scanned[directory] = now
    return remove_stale(directory)


def remove_stale(directory: str) -> list[str]:
    """Remove the temporaries in ``directory`` whose writer is provably dead; returns their
    paths. Best effort: anything it cannot prove or do is left alone, silently."""
    removed = []
    try:
        entries = os.scandir(directory)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            name = entry.name
            if name[:1] != "." or MARK not in name:
                continue
            m = _NAME.fullmatch(name)
            if m and _remove_if_dead(entry.path, int(m.group(1))):
                removed.append(entry.path)
    return removed
