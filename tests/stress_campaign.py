"""Crash consistency, concurrent replace and clean exits at full size (tests/stress.py).

    python tests/stress_campaign.py [--kills 100] [--savers 4 --loaders 4 --seconds 20]
                                    [--processes 200]

- 100 writers SIGKILLed at random moments of a save: the path must always hold a whole
  snapshot (the old or the new), and at most one temporary may be left;
- 4 processes saving to one path and 4 loading from it for 20 seconds: no load refused, none
  mixing two saves;
- 200 fresh interpreters that load, or are refused after reading tensor bytes, then exit:
  none may end abnormally.
Prints each result and exits 1 if any target is missed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

STRESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stress.py")


def stress(*args) -> dict:
    with tempfile.TemporaryDirectory(prefix="mlxkv-stress-") as d:
        proc = subprocess.run([sys.executable, STRESS, args[0], d, *map(str, args[1:])], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--savers", type=int, default=4)
    p.add_argument("--loaders", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--processes", type=int, default=200)
    args = p.parse_args(argv)

    crash = stress("crash", "--kills", args.kills)
    print(
        f"killed writers: {crash['kills']} kills, {crash['whole']} whole afterwards ({crash['old']} old, "
        f"{crash['new']} new), {crash['torn']} torn; temporaries at most {crash['max_temporaries']}, "
        f"{crash['temporaries_left']} left"
    )
    conc = stress("concurrency", "--savers", args.savers, "--loaders", args.loaders, "--seconds", args.seconds)
    print(
        f"concurrent replace: {conc['savers']} savers + {conc['loaders']} loaders on one path for "
        f"{conc['seconds']:.0f} s: {conc['loads']} loads, {conc['whole']} whole, {conc['refused']} refused, "
        f"{conc['mixed']} mixed" + (f"; e.g. {conc['examples'][0]}" if conc["examples"] else "")
    )
    fresh = stress("fresh", "--processes", args.processes, "--parallel", 2)
    print(
        f"fresh interpreters: {fresh['processes']} processes, {fresh['clean']} clean exits, "
        f"{fresh['abnormal']} abnormal" + (f"; e.g. {fresh['errors'][0]}" if fresh["errors"] else "")
    )
    ok = (
        crash["torn"] == 0
        and crash["temporaries_left"] <= 1
        and conc["refused"] == 0
        and conc["mixed"] == 0
        and fresh["abnormal"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
