"""What the commands print: tables, byte sizes, a progress bar for long file transfers."""

import sys
import time
from collections import Counter

from ..formats.snapshot import human_bytes

LARGE_FILE = 64 << 20  # progress is shown for files this large even when stderr is not a tty


def print_table(headers: list[str], rows: list[list[str]], out=sys.stdout) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    print(line(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


class Progress:
    """A ``progress(done, total)`` callback drawing a bar on stderr when stderr is a
    terminal or the transfer is large; silent otherwise."""

    def __init__(self, label: str, stream=None, force: bool | None = None, interval: float = 0.1):
        self.label, self.stream = label, stream or sys.stderr
        self.force, self.interval = force, interval
        self.shown = False
        self._last = 0.0

    def _enabled(self, total: int) -> bool:
        if self.force is not None:
            return self.force
        isatty = getattr(self.stream, "isatty", lambda: False)()
        return isatty or total >= LARGE_FILE

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled(total):
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {pct:5.1f}% ({human_bytes(done)} of {human_bytes(total)})")
        self.shown = True
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def layers_by_kind(kinds: list[str]) -> str:
    """``["kv:plain", "ssm", "kv:plain"]`` -> ``"2 kv:plain + 1 ssm"`` (first-seen order)."""
    counts = Counter(kinds)
    return " + ".join(f"{counts[k]} {k}" for k in dict.fromkeys(kinds))
