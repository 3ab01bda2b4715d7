"""Killed writers, concurrent savers and loaders, and fresh interpreters (tests/stress.py)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def stress(*args):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "stress.py"), *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_killed_writers_always_leave_a_whole_snapshot_and_at_most_one_temporary(tmp_path):
    """100 writers SIGKILLed at random moments of a save (before, during, after the write and
    the rename): the path always holds a whole snapshot, the previous one or the new one,
    and each save removes the temporaries of the writers killed before it."""
    r = stress("crash", tmp_path, "--kills", 100)
    assert r["kills"] == 100 and r["whole"] == 100 and r["torn"] == 0, r["problems"]
    assert r["old"] > 0 and r["new"] > 0  # kills landed both before and after renames
    assert r["max_temporaries"] <= 1 and r["temporaries_left"] <= 1


def test_concurrent_savers_and_loaders_see_no_damage_and_no_mix(tmp_path):
    """Two processes save to one path while two load from it: a whole snapshot is always
    there, so no load may be refused, and none may mix two saves."""
    r = stress("concurrency", tmp_path, "--savers", 2, "--loaders", 2, "--seconds", 5)
    assert r["loads"] > 50 and r["child_failures"] == 0
    assert r["refused"] == 0 and r["mixed"] == 0 and r["whole"] == r["loads"], r["examples"]


def test_fresh_interpreters_exit_cleanly_after_loads_and_refusals(tmp_path):
    """51 fresh interpreters, 2 at a time, each loading a snapshot, or being refused after its
    tensor bytes were read (a damaged tensor; an mlx-lm file converted without tokens):
    MLX's loader thread used to free the Python stream during interpreter shutdown and abort
    1 to 6 processes in 10."""
    r = stress("fresh", tmp_path, "--processes", 51, "--parallel", 2)
    assert r["processes"] == 51 and r["abnormal"] == 0, r["errors"]
