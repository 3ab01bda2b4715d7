"""The ``mlxkv serve`` command: start the server, print its banner, serve until Ctrl-C or
SIGTERM, then close the prompt store (its queued writes written) and exit.

Exit status: 0 after a stop, 2 for options that cannot be served (nothing was loaded), 1
for a model that does not load, a store that does not open or a port that cannot be bound.
"""

import logging
import os
import signal
import sys

from ..errors import MLXKVError
from .options import FlagError


def _interrupt(signum, frame):
    raise KeyboardInterrupt


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
    # a service manager's stop ends as Ctrl-C does, also one sent as soon as the banner is read
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for line in server.banner():
            print(line, file=sys.stderr)
        sys.stderr.flush()
        server.serve_forever()
    except KeyboardInterrupt:
        pass  # stopped before serving began
    server.shutdown()  # the prompt store's queued writes are written first
    # Everything is stopped and joined. Leave without interpreter finalization: MLX aborts
    # there ("terminate called without an active exception") once a thread other than the
    # main one has run MLX work, which mlx-lm's generation thread does (plain mlx_lm.server
    # ends the same way on Ctrl-C).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
