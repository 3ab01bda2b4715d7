"""The ``mlxkv serve`` command: start the server, print its banner, serve until SIGINT
(Ctrl-C) or SIGTERM, then close the prompt store (its queued writes written) and exit.

Both signals stop it however it was started: a shell that starts a job in the background
without job control (``nohup``, ``cmd &`` in a script) makes the job ignore SIGINT, and
Python then installs no handler for it, so the handler is installed here explicitly. Once
the stop began, a second signal is logged and ignored: the shutdown is bounded already (the
store's writers get its ``close_timeout``, each tier on its own writer, so a hung Redis
does not hold the disk's writes), and cutting it short would lose writes the store is
finishing. The last line says what became of the entries put since the start.

Exit status: 0 after a stop, 2 for options that cannot be served (nothing was loaded), 1
for a model that does not load, a store that does not open or a port that cannot be bound.
"""

import logging
import os
import signal
import sys

from ..errors import MLXKVError
from .options import FlagError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum, frame):
    for sig in STOP_SIGNALS:  # from now on, a stop signal must not interrupt the stop
        signal.signal(sig, _stopping)
    raise KeyboardInterrupt


def _stopping(signum, frame):
    name = signal.Signals(signum).name
    # os.write, not print: the main thread may be inside a print to stderr right now
    os.write(2, f"mlxkv serve: {name} ignored: already stopping (the prompt store is writing its queue)\n".encode())


def run(args) -> int:
    from .server import start

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        server = start(args)
    except FlagError as e:
        print(f"mlxkv serve: error: {e}", file=sys.stderr)
        return 2
    except MLXKVError as e:
        print(f"mlxkv serve: error: {e}", file=sys.stderr)
        return 1
    for sig in STOP_SIGNALS:  # a service manager's stop, Ctrl-C, a kill from a script, also one
        signal.signal(sig, _interrupt)  # sent as soon as the banner is read
    try:
        for line in server.banner():
            print(line, file=sys.stderr)
        sys.stderr.flush()
        server.serve_forever()
    except KeyboardInterrupt:
        pass  # stopped before serving began
    for sig in STOP_SIGNALS:  # (serve_forever may also have ended without a signal)
        signal.signal(sig, _stopping)
    print("mlxkv serve: stopping", file=sys.stderr)
    report = server.shutdown()  # the prompt store's queued writes are written first
    if report is not None:
        print(f"mlxkv serve: prompt store closed: {summary(report)}", file=sys.stderr)
    # Everything is stopped and joined. Leave without interpreter finalization: MLX aborts
    # there ("terminate called without an active exception") once a thread other than the
    # main one has run MLX work, which mlx-lm's generation thread does (plain mlx_lm.server
    # ends the same way on Ctrl-C).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def summary(report) -> str:
    """A ``FlushReport`` in one line: how many entries ended each way."""
    counts = {k: len(getattr(report, k)) + report.unlisted.get(k, 0) for k in ("durable", "uploaded", "evicted")}
    counts["superseded"] = len(report.superseded) + report.unlisted.get("superseded", 0)
    failed = len(report.failed) + report.unlisted.get("failed", 0)
    text = ", ".join(f"{n} {k}" for k, n in counts.items()) + f", {failed} failed"
    if report.failed:
        text += f" (first: {report.failed[0][2]})"
    return text
