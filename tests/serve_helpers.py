"""Shared by the server tests: prompts as words the seeded tokenizer reads, and the
``mlxkv serve`` command started as a user starts it."""

import os
import re
import subprocess
import sys


def words(tokens):
    """Text the seeded tokenizer encodes to exactly ``tokens``."""
    return " ".join(f"<{t:02x}>" for t in tokens)


def serve_process(*argv):
    """``python -m mlxkv.cli serve ARGV --port 0`` started; returns (process, port) once it
    printed its address."""
    cmd = [sys.executable, "-m", "mlxkv.cli", "serve", *argv, "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stderr:
        found = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
        if found:
            return proc, int(found.group(1))
    proc.wait(30)
    raise AssertionError(f"the server did not report its address (exit code {proc.returncode})")
