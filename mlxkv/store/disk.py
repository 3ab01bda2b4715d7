"""The disk tier: one mlxkv snapshot file per entry, in a directory of one identity.

Layout: ``<directory>/<identity id>/<entry id>.safetensors`` (the identity id names the model
config fingerprint, tokenizer and scheme; docs/store.md). The directory of an identity is
private (0700, files 0600, as ``mkstemp`` makes them); files are written atomically
(temporary file, fsync, rename, directory fsync) by ``snapshot.write``.

What the tier trusts is the file system's owner: the directory given must belong to this
user (or root) and no one else may write it (unless it is sticky, as ``/tmp`` is); the
identity directory must be a real directory of this user, made private on every open. A
file in it that is not a regular file of this user is skipped, never served. Anyone who can
write as this user can write entries: the disk tier authenticates nothing else.

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
import stat
import time
from array import array
from dataclasses import dataclass, field

from ..errors import FormatVersionError, MLXKVError, SnapshotError, StoreTrustError, UnknownKindError
from ..formats.mlxkv import read, write
from ..formats.table import read_header
from ..io import temporaries
from ..state.identity import FIELDS, SERVES, Identity
from ..state.reuse import probe
from .entry import Entry
from .health import Health
from .tier import Found, LocalTier, Opened, Written

SUFFIX = ".safetensors"
QUARANTINE = "quarantine"
STALE_SECONDS = 3600


@dataclass
class OpenReport:
    indexed: int = 0
    skipped: list[str] = field(default_factory=list)  # kept: another identity, a newer format
    quarantined: list[str] = field(default_factory=list)
    untrusted: list[str] = field(default_factory=list)  # links, other users' files: never read
    removed_temporaries: list[str] = field(default_factory=list)


def check_directory(directory: str) -> None:
    """Refuse a store directory the store cannot use or trust (before anything is opened):
    not a directory, or one another user owns or may write (unless sticky)."""
    try:
        st = os.stat(directory)
    except (FileNotFoundError, NotADirectoryError):
        _check_makeable(directory)
        return
    except OSError as e:
        raise MLXKVError(f"the store directory {directory!r} cannot be used: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MLXKVError(
            f"the store directory {directory!r} is not a directory: give a directory (it is made if missing)"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise MLXKVError(f"the store directory {directory!r} is not writable by this user: give one that is")
    if st.st_uid not in (os.geteuid(), 0):
        raise StoreTrustError(
            f"the store directory {directory!r} belongs to user {st.st_uid}, not to this user ({os.geteuid()}): "
            "its owner could replace its entries; give a directory of your own"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StoreTrustError(
            f"the store directory {directory!r} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"they could replace its entries; `chmod go-w {directory}` or give a private directory"
        )


def _check_makeable(directory: str) -> None:
    """A missing store directory is made with its missing parents: its nearest existing
    ancestor must be a directory (a path under a regular file cannot be made)."""
    ancestor = os.path.dirname(os.path.abspath(directory))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise MLXKVError(
            f"the store directory {directory!r} cannot be made: {ancestor!r} is a file, not a directory; "
            "give a directory (it is made if missing) whose parents are directories"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise MLXKVError(f"the store directory {directory!r} cannot be made: {ancestor!r} is not writable by this user")


def _private_directory(path: str) -> None:
    """Make ``path`` (or find it) a real directory of this user, mode 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else f"user {st.st_uid}'s"
        raise StoreTrustError(
            f"{path!r} is not a directory of this user ({what}): the store will not read entries another user "
            "could have written; remove it"
        )
    os.chmod(path, 0o700)  # an identity directory is private, whatever made it


class DiskTier(LocalTier):
    name = "disk"
    durable = True

    def __init__(self, root: str, identity: Identity, block: int, locate, lock, model=None, verify: bool = True):
        """``locate(header) -> (key, space, chain)``: the entry id, space and block chain a
        header's entry is filed under (the store derives them from the identity); ``lock``:
        the store's, held while the index changes."""
        super().__init__(block)
        self.root = root
        self.identity = identity
        self._locate = locate
        self._lock = lock
        self.model, self.verify = model, verify
        self._lock_fd = None
        self.health = Health("disk", root)
        self.opened = Opened("disk", root, 0)

    # -- opening ------------------------------------------------------------------------

    def open(self) -> OpenReport:
        check_directory(os.path.dirname(self.root))
        _private_directory(self.root)
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
            if not name.endswith(SUFFIX):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                report.untrusted.append(name)  # a link, or another user's: never read
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
        self.opened = Opened(
            "disk",
            self.root,
            report.indexed,
            {
                "skipped": report.skipped,
                "quarantined": report.quarantined,
                "untrusted": report.untrusted,
                "removed temporaries": report.removed_temporaries,
            },
        )
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
        """The index record of a checked file (no tensor read). A prompt entry's record
        keeps of its header only what the index and a take need (the file is read whole
        when taken): a directory of 20k files is not 20k headers in memory."""
        key, space, chain = self._locate(header)
        st = os.stat(path)
        checkpoint = bool(header.get("generationCheckpoint"))
        kept = header if checkpoint else {k: header[k] for k in RECORD_FIELDS if k in header}
        # a prompt entry's tokens as uint32 (4 bytes a token, not a list's 36): the index
        # and the reuse rule need their length and prefixes only
        tokens = list(header["tokens"]) if checkpoint else array("I", header["tokens"])
        record = Entry(
            key,
            space,
            tokens,
            probe(header),
            st.st_size,
            kept,
            extra={"path": path, "mtime": st.st_mtime},
        )
        record.extra["chain"] = chain
        return record

    def quarantine(self, path: str) -> None:
        qdir = os.path.join(self.root, QUARANTINE)
        with contextlib.suppress(OSError):
            os.makedirs(qdir, mode=0o700, exist_ok=True)
            os.replace(path, os.path.join(qdir, os.path.basename(path)))
            return
        with contextlib.suppress(OSError):  # cannot move it: at least never read it again
            os.unlink(path)

    # -- the index ----------------------------------------------------------------------

    def add(self, record: Entry) -> None:
        """Index a record made by :meth:`record`."""
        self._file(record, record.extra.pop("chain"))

    def remove(self, key, delete: bool = True) -> Entry | None:
        record = self._unfile(key)
        if record is None:
            return None
        if delete:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record.extra["path"])
        return record

    def read(self, found: Found) -> Entry | None:
        """The entry with its arrays, every checksum verified; None when its file turned out
        damaged or changed (it is quarantined and forgotten: the store asks again)."""
        record = found.record
        try:
            return self.load(record, self.model, self.verify)
        except SnapshotError as e:
            self.health.refuse(f"a damaged file is quarantined: {e}")
            with self._lock:
                if self._entries.get(record.key) is record:
                    self.remove(record.key, delete=False)
                    if os.path.exists(record.extra["path"]):
                        self.quarantine(record.extra["path"])
            return None
        except OSError as e:
            self.health.failed(e)
            return None

    def oldest_first(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.extra["mtime"])

    # -- file I/O (called without the store's lock) ---------------------------------------

    def path_of(self, key: str) -> str:
        return os.path.join(self.root, key + SUFFIX)

    def write(self, entry: Entry) -> Written:
        """Write ``entry`` durably (fsync'd file and directory); its record is indexed by the
        store once the write is recorded."""
        path = self.path_of(entry.key)
        header = write(path, entry.header, list(entry.arrays.items()), fsync=True)
        record = self.record(path, header)
        self.health.count("writes")
        self.health.count("bytes_written", record.nbytes)
        if not self.health.healthy:
            self.health.recovered()
        return Written(durable=True, record=record, nbytes=record.nbytes)

    def load(self, record: Entry, model=None, verify: bool = True) -> Entry:
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
        if header["tokens"] != list(record.tokens):
            raise SnapshotError(f"{path} changed since the store was opened")
        with contextlib.suppress(OSError):
            os.utime(path)  # the disk tier's least-recently-used order survives restarts
        record.extra["mtime"] = time.time()
        nbytes = sum(a.nbytes for a in arrays.values())
        self.health.count("bytes_read", nbytes)
        return Entry(record.key, record.space, list(header["tokens"]), record.reuse, nbytes, header, arrays)


#: what a prompt entry's record keeps of its header
RECORD_FIELDS = ("ns", "attachments", *(FIELDS[key] for key in SERVES))
