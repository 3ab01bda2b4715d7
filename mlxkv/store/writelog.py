"""The write log: what became of each entry put since the last ``flush``, tier by tier.

A record names its entry by namespace and tokens (never by the entry itself: a log that held
entries would keep every array alive until a flush, and a server never flushes), and keeps
one :class:`Outcome` per lower tier. The log holds at most ``limit`` records: past that, the
oldest settled ones leave the lists and are only counted (``FlushReport.unlisted``), so a
store that is never flushed stays bounded, and a flush still says how many entries ended
each way. An unlisted durable entry keeps its key until the flush: the disk may still evict
it (its cap) or drop it (a covering entry), and the count must say so. Those keys are
bounded by the files the directory holds, as its index is.
"""

import enum
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    QUEUED = "queued"  # waiting for, or being written by, the tier's writer
    WRITTEN = "written"  # on disk (fsync'd) / uploaded (or found present)
    SUPERSEDED = "superseded"  # dropped before it was written: an entry that covers it replaced it
    EVICTED = "evicted"  # written, then removed again to keep the disk under its cap
    FAILED = "failed"  # the write failed or was not attempted (``message`` says why)


@dataclass
class WriteRecord:
    ns: str
    tokens: array  # uint32: 4 bytes a token, not a list's 36
    serial: int  # the put that made the entry
    outcomes: dict = field(default_factory=dict)  # tier name -> Outcome
    messages: dict = field(default_factory=dict)  # tier name -> why it failed

    @property
    def settled(self) -> bool:
        return Outcome.QUEUED not in self.outcomes.values()


@dataclass
class FlushReport:
    """What became of the entries put since the previous flush, each as (ns, tokens).

    ``durable``: on disk (file and directory fsync'd) and still there; ``superseded``: dropped
    before they were written, because an entry that covers them replaced them; ``evicted``:
    written, then removed to keep the directory under ``disk_cap``; ``failed``: (ns, tokens,
    message): the write failed, or a store without a disk tier could not upload it (a later
    flush tries again while the entry is in RAM); ``uploaded``: in the shared tier (present
    there counts). ``unlisted``: how many more entries ended each way than the lists hold
    (the log keeps at most ``log_limit`` records)."""

    durable: list = field(default_factory=list)
    superseded: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (ns, tokens, message)
    uploaded: list = field(default_factory=list)
    unlisted: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.unlisted.get("failed")


class WriteLog:
    def __init__(self, tiers: dict[str, bool], limit: int):
        """``tiers``: each lower tier's name and whether it is durable (the disk)."""
        self.tiers = tiers
        self.limit = int(limit)
        self._records: OrderedDict[str, WriteRecord] = OrderedDict()  # entry key -> record
        self._unlisted: Counter = Counter()
        self._unlisted_durable: set[str] = set()  # keys of shed records that were on disk

    def __len__(self):
        return len(self._records)

    def start(self, key: str, ns: str, tokens: list, serial: int, tiers) -> WriteRecord:
        record = WriteRecord(ns, array("I", tokens), serial, dict.fromkeys(tiers, Outcome.QUEUED))
        self._unlisted_durable.discard(key)  # this put's record says what becomes of the file
        self._records.pop(key, None)
        self._records[key] = record
        if len(self._records) > self.limit:
            self._shed()
        return record

    def get(self, key: str, serial: int) -> WriteRecord | None:
        """The record of the put ``serial`` of ``key`` (None once a newer put replaced it)."""
        r = self._records.get(key)
        return r if r is not None and r.serial == serial else None

    def set(self, key: str, serial: int, tier: str, outcome: Outcome, message: str = "") -> None:
        r = self.get(key, serial)
        if r is not None and tier in r.outcomes:
            r.outcomes[tier] = outcome
            if message:
                r.messages[tier] = message

    def written_away(self, key: str, tier: str, outcome: Outcome) -> None:
        """The tier removed its copy of ``key`` after writing it (disk cap, a covering entry)."""
        r = self._records.get(key)
        if r is not None and r.outcomes.get(tier) is Outcome.WRITTEN:
            r.outcomes[tier] = outcome
        elif r is None and self.tiers.get(tier) and key in self._unlisted_durable:
            self._unlisted_durable.discard(key)
            self._unlisted[outcome.value] += 1

    def _shed(self) -> None:
        for key in [k for k, r in self._records.items() if r.settled]:
            if len(self._records) <= self.limit:
                break
            kinds = self._kinds(self._records.pop(key))
            if "durable" in kinds:
                kinds.remove("durable")
                self._unlisted_durable.add(key)
            self._unlisted.update(kinds)

    def _kinds(self, r: WriteRecord) -> list[str]:
        """The report lists a record belongs to."""
        out = []
        durable = [t for t, d in self.tiers.items() if d and t in r.outcomes]
        shared = [t for t, d in self.tiers.items() if not d and t in r.outcomes]
        outcomes = {r.outcomes[t] for t in durable}
        if Outcome.WRITTEN in outcomes:
            out.append("durable")
        elif Outcome.EVICTED in outcomes:
            out.append("evicted")
        elif Outcome.FAILED in outcomes:
            out.append("failed")
        elif Outcome.SUPERSEDED in outcomes or any(r.outcomes[t] is Outcome.SUPERSEDED for t in shared):
            out.append("superseded")
        elif not durable and any(r.outcomes[t] is Outcome.FAILED for t in shared):
            out.append("failed")
        if any(r.outcomes[t] is Outcome.WRITTEN for t in shared):
            out.append("uploaded")
        return out

    def report(self) -> FlushReport:
        """The report of every record, and a fresh log (records still queued stay)."""
        self._unlisted["durable"] += len(self._unlisted_durable)
        report = FlushReport(unlisted=+self._unlisted)
        kept = OrderedDict()
        for key, r in self._records.items():
            if not r.settled:
                kept[key] = r
                continue
            item = (r.ns, list(r.tokens))
            for kind in self._kinds(r):
                if kind == "failed":
                    report.failed.append((*item, "; ".join(r.messages.values()) or "not written"))
                else:
                    getattr(report, kind).append(item)
        self._records, self._unlisted, self._unlisted_durable = kept, Counter(), set()
        return report
