"""The disk tier: one mlxkv snapshot file per entry, in a directory of one identity.

Layout: ``<directory>/<identity id>/<entry id>.safetensors`` (the identity id names the model
config fingerprint, tokenizer and scheme; docs/store.md). The directory of an identity is
private (0700, files 0600, as ``mkstemp`` makes them); files are written atomically
(temporary file, fsync, rename, directory fsync) by ``snapshot.write``.

Opening reads headers only: no tensor byte is read until an entry is taken, and the tensor
checksums are verified then. What opening does with each file:

- a snapshot of this identity: indexed (its reuse terms from its header);
- another identity's, or one written by a newer mlxkv (a format version or kind this one
  does not know): skipped and kept, never deleted, never served;
- damaged (a header that does not check): moved to ``quarantine/``;
- a temporary file no live writer owns: deleted. A store holds a shared lock on the
  directory while open; the one that opens it alone deletes every temporary file, others
  only those older than an hour.
"""

import contextlib
import fcntl
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import FormatVersionError, MLXKVError, SnapshotError, UnknownKindError
from ..io import temporaries
from ..state.reuse import prefix_for, probe
from ..state.snapshot import read, read_header, write
from .entry import Entry
from .index import PrefixIndex, best_prefix

SUFFIX = ".safetensors"
QUARANTINE = "quarantine"
STALE_SECONDS = 3600


@dataclass
class OpenReport:
    indexed: int = 0
    skipped: list[str] = field(default_factory=list)  # kept: another identity, a newer format
    quarantined: list[str] = field(default_factory=list)
    removed_temporaries: list[str] = field(default_factory=list)


class DiskTier:
    def __init__(self, root: str, identity: Identity, block: int, locate):
        """``locate(header) -> (key, space, chain)``: the entry id, space and block chain a
        header's entry is filed under (the store derives them from the identity)."""
        self.root = root
        self.identity = identity
        self._locate = locate
        self._entries: dict[str, Entry] = {}
        self._index = PrefixIndex(block)
        self.nbytes = 0
        self._lock_fd = None

    # -- opening ------------------------------------------------------------------------

    def open(self) -> OpenReport:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)  # an identity directory is private, whatever made it
        report = OpenReport()
        alone = self._lock_directory()
        now = time.time()
        # temporaries of writers killed mid-save, provably dead (io/temporaries.py)
        report.removed_temporaries += [os.path.basename(p) for p in temporaries.remove_stale(self.root)]
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.endswith(".tmp"):  # an older mlxkv's temporary
                with contextlib.suppress(OSError):
                    if alone or now - os.stat(path).st_mtime > STALE_SECONDS:
                        os.unlink(path)
                        report.removed_temporaries.append(name)
                continue
            if not name.endswith(SUFFIX) or not os.path.isfile(path):
                continue
            try:
                header = read_header(path)
            except (FormatVersionError, UnknownKindError):
                report.skipped.append(name)  # a newer mlxkv's file: not ours to judge
                continue
            except SnapshotError:
                self.quarantine(path)
                report.quarantined.append(name)
                continue
            if not self.owns(header):
                report.skipped.append(name)
                continue
            try:
                self.add(self.record(path, header))
            except (MLXKVError, KeyError, TypeError, ValueError):
                self.quarantine(path)
                report.quarantined.append(name)
                continue
            report.indexed += 1
        return report

    def _lock_directory(self) -> bool:
        """Hold a shared lock on the directory; True if no other store has it open."""
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError:
            alone = False
        fcntl.flock(fd, fcntl.LOCK_SH)  # converts an exclusive lock, or waits for none
        self._lock_fd = fd
        return alone

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def owns(self, header: dict) -> bool:
        """Is this snapshot of the store's identity (model config, tokenizer, scheme)?"""
        return self.identity.serves(header)

    def record(self, path: str, header: dict) -> Entry:
        """The index record of a checked file (no tensor read)."""
        key, space, _ = self._locate(header)
        st = os.stat(path)
        return Entry(
            key,
            space,
            list(header["tokens"]),
            probe(header),
            st.st_size,
            header,
            extra={"path": path, "mtime": st.st_mtime},
        )

    def quarantine(self, path: str) -> None:
        qdir = os.path.join(self.root, QUARANTINE)
        with contextlib.suppress(OSError):
            os.makedirs(qdir, mode=0o700, exist_ok=True)
            os.replace(path, os.path.join(qdir, os.path.basename(path)))
            return
        with contextlib.suppress(OSError):  # cannot move it: at least never read it again
            os.unlink(path)

    # -- the index ----------------------------------------------------------------------

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def get(self, key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def add(self, record: Entry) -> None:
        old = self._entries.pop(record.key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[record.key] = record
        self.nbytes += record.nbytes
        if record.checkpoint is None:
            _, _, chain = self._locate(record.header)
            self._index.add(record.key, record.space, record.tokens, chain)

    def remove(self, key, delete: bool = True) -> Entry | None:
        record = self._entries.pop(key, None)
        if record is None:
            return None
        self.nbytes -= record.nbytes
        self._index.remove(key)
        if delete:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record.extra["path"])
        return record

    def find(self, space: str, prompt: Sequence[int], chain: Sequence[bytes]) -> tuple[Entry | None, int]:
        def usable(key, start):
            e = self._entries[key]
            return prefix_for(e.tokens, e.reuse, prompt, start)

        key, p = best_prefix(self._index, space, prompt, chain, usable)
        return (self._entries[key], p) if key is not None else (None, 0)

    def oldest_first(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.extra["mtime"])

    # -- file I/O (called without the store's lock) ---------------------------------------

    def path_of(self, key: str) -> str:
        return os.path.join(self.root, key + SUFFIX)

    def write(self, entry: Entry) -> Entry:
        """Write ``entry`` (durably: fsync'd file and directory); returns its record."""
        path = self.path_of(entry.key)
        header = write(path, entry.header, list(entry.arrays.items()), fsync=True)
        return self.record(path, header)

    def read(self, record: Entry, model=None, verify: bool = True) -> Entry:
        """The entry with its arrays, every checksum verified; raises SnapshotError."""
        path = record.extra["path"]
        header, arrays = read(
            path,
            model,
            verify=verify,
            slack=False,
            config_fingerprint=self.identity.config_fingerprint,
            tokenizer_hash=self.identity.tokenizer_hash,
        )
        if header["tokens"] != record.tokens:
            raise SnapshotError(f"{path} changed since the store was opened")
        with contextlib.suppress(OSError):
            os.utime(path)  # the disk tier's least-recently-used order survives restarts
        record.extra["mtime"] = time.time()
        nbytes = sum(a.nbytes for a in arrays.values())
        return Entry(record.key, record.space, record.tokens, record.reuse, nbytes, header, arrays)
