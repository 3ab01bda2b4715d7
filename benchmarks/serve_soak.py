"""A soak of ``mlxkv serve`` with every tier, under real faults: N streaming clients for M
minutes, Redis frozen (SIGSTOP), then killed (SIGKILL) and restarted empty, then the disk
filled, while the server's memory, its streams' inter-token gaps and its answers are
measured.

The server is the ``mlxkv serve`` command (a process of its own) on the seeded llama
(``mlxkv.models.seeded``: small, so a thousand requests fit in minutes), with a RAM cap
(``--prompt-cache-bytes``), ``--store`` capped as an operator caps it (``--store-disk-bytes``:
the directory's index lives in memory, about 3 KiB an entry, so an uncapped directory's
index grows with the run) on a tmpfs of its own (mounted here; where mount is
not permitted, a plain directory, and the disk-full phase is skipped and says so) and
``--redis`` on a private ``redis-server``. Every request is distinct: one of four shared
system prompts (longer than a store block, so Redis and the disk have prefixes to serve)
and a suffix of its own; each is streamed over raw HTTP. The run's time is split into
phases: healthy, Redis frozen, healthy, Redis killed (restarted empty at the phase's
end), healthy, disk full (a filler file takes the tmpfs' free space; removed at the
phase's end), healthy.

Measured: the server's RSS over time (every second, with the requests done by then);
p50/p99 of the gaps between a stream's tokens, healthy against Redis frozen; requests
failed (not 200, or an error event in the stream); wrong answers (each answer is compared
with a cold start after the run: mlx-lm's ``batch_generate`` on fresh caches, then, where
they differ, ``mlx_lm.generate`` serially, and the answer resuming the prefix the server
said it reused; wrong if it differs from all of them); durable entries lost (the server's
last line says how many entries its store reported durable when it stopped; the directory is opened again and must index
that many). Targets (issue 21): RSS growth within the RAM cap + 64 MiB over 1,000
requests, p99 gap with Redis frozen within 2x healthy, 0 wrong answers, 0 durable entries
lost.

Run: ``nice -n 5 python -m benchmarks.serve_soak [--minutes 10] [--clients 8]
[--max-tokens 16] [--out PATH]``; ``--quick`` (a few seconds, what the test suite runs so
the script does not rot). Writes benchmarks/results/serve_soak.json.
"""

import argparse
import contextlib
import errno
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' private redis-server and prompt words

from serve_helpers import words  # noqa: E402
from store_helpers import RedisServer  # noqa: E402

from benchmarks.common import write_result  # noqa: E402

SECRET = "serve-soak-deployment-secret"
SCHEME = "bf16"
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 96  # more than one block of the store's index (64 tokens)
#: (phase, start as a fraction of the run); each lasts until the next one starts
PHASES = [
    ("healthy", 0.0),
    ("redis-frozen", 0.2),
    ("healthy", 0.4),
    ("redis-killed", 0.5),
    ("healthy", 0.6),
    ("disk-full", 0.7),
    ("healthy", 0.85),
]


@dataclass
class Answer:
    index: int
    tokens: list
    status: int = 0
    text: str = ""
    cached: int = 0
    times: list = field(default_factory=list)  # monotonic time of each token received
    error: str = ""


def request_prompt(index: int) -> list:
    from mlxkv.models.seeded import prompt

    system = prompt(SYSTEM_TOKENS, seed=index % SYSTEM_PROMPTS + 1)
    return system + prompt(8 + (index * 7) % 40, seed=10_000 + index)


def stream(port: int, answer: Answer, max_tokens: int) -> Answer:
    """One streamed completion over raw HTTP; fills ``answer``."""
    body = {
        "prompt": words(answer.tokens),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer.status = response.status
        if response.status != 200:
            answer.error = response.read()[:300].decode(errors="replace")
            return answer
        parts = []
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                answer.error = json.dumps(event["error"])[:300]
                break
            usage = event.get("usage")
            if usage:
                answer.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    answer.times.append(time.monotonic())
                    parts.append(choice["text"])
        answer.text = "".join(parts)
    except Exception as e:  # a failed request is counted, never the end of the soak
        answer.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return answer


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Disk:
    """The store's directory: a tmpfs of ``mib`` MiB mounted for the run, or (mount not
    permitted) a plain directory, where the disk-full phase is skipped."""

    def __init__(self, root: str, mib: int):
        self.mount = os.path.join(root, "store-fs")
        os.makedirs(self.mount)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", self.mount], capture_output=True, text=True
        )
        self.mounted = done.returncode == 0
        self.why_not = done.stderr.strip()
        self.directory = os.path.join(self.mount, "store")
        self.filler = os.path.join(self.mount, "filler")

    def fill(self) -> int:
        """Take every free byte with a filler file; returns its size."""
        if not self.mounted:
            return 0
        chunk = b"\0" * (1 << 20)
        written = 0
        # unbuffered, and ENOSPC taken wherever it comes: a buffered file raises it again as
        # it closes (flushing what the full file system refused), and a file system the
        # store's own writes filled refuses the open itself
        try:
            with open(self.filler, "wb", buffering=0) as f:
                while True:
                    written += f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.filler)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", self.mount], capture_output=True)


def start_server(model_dir: str, disk: Disk, redis: RedisServer, cap: str, disk_cap: str, clients: int, log: str):
    cmd = [
        sys.executable,
        "-m",
        "mlxkv.cli",
        "serve",
        "--model",
        model_dir,
        "--scheme",
        SCHEME,
        "--store",
        disk.directory,
        "--store-disk-bytes",
        disk_cap,
        "--redis",
        redis.url,
        "--prompt-cache-bytes",
        cap,
        "--decode-concurrency",
        str(max(clients, 1)),
        "--log-level",
        "WARNING",
        "--port",
        "0",
    ]
    env = {**os.environ, "MLXKV_STORE_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:  # the child holds its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"at http://127\.0\.0\.1:(\d+)", Path(log).read_text())
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"mlxkv serve did not start:\n{Path(log).read_text()[-3000:]}")


def percentile(values, q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_soak(args) -> dict:
    import mlx_lm

    import mlxkv
    from mlxkv.models.seeded import save_model_dir

    root = tempfile.mkdtemp(prefix="mlxkv-soak-")
    model_dir = save_model_dir("llama", os.path.join(root, "model"))
    disk = Disk(root, args.disk_mib)
    try:
        redis = RedisServer()
        log = os.path.join(root, "server.log")
        proc, port = start_server(model_dir, disk, redis, args.cache_bytes, args.disk_bytes, args.clients, log)
        seconds = args.minutes * 60
        answers: list[Answer] = []
        rss: list[tuple[float, int, int]] = []  # (seconds since the start, bytes, requests done)
        events: list[tuple[float, str]] = []
        lock = threading.Lock()
        counter = iter(range(10**9))
        t_start = time.monotonic()
        deadline = t_start + seconds

        def client():
            while time.monotonic() < deadline:
                with lock:
                    index = next(counter)
                done = stream(port, Answer(index, request_prompt(index)), args.max_tokens)
                with lock:
                    answers.append(done)

        def sample():
            while proc.poll() is None and time.monotonic() < deadline + 5:
                with lock:
                    n = len(answers)
                rss.append((time.monotonic() - t_start, rss_bytes(proc.pid), n))
                time.sleep(1.0)

        try:
            rss.append((0.0, rss_bytes(proc.pid), 0))
            threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
            threads.append(threading.Thread(target=sample, daemon=True))
            for t in threads:
                t.start()
            phases = [(name, t_start + at * seconds) for name, at in PHASES]
            for i, (name, at) in enumerate(phases):
                time.sleep(max(0.0, at - time.monotonic()))
                previous = phases[i - 1][0] if i else None
                if previous == "redis-frozen":
                    os.kill(redis.proc.pid, signal.SIGCONT)
                elif previous == "redis-killed":
                    redis.restart()
                elif previous == "disk-full":
                    disk.free()
                if name == "redis-frozen":
                    os.kill(redis.proc.pid, signal.SIGSTOP)
                elif name == "redis-killed":
                    redis.proc.kill()
                    redis.proc.wait()
                elif name == "disk-full":
                    filled = disk.fill()
                    name = f"disk-full ({filled >> 20} MiB filler)" if disk.mounted else "disk-full (skipped: no mount)"
                events.append((time.monotonic() - t_start, name))
            for t in threads[:-1]:
                t.join()
            health = _get(port, "/health")
            metrics = _get(port, "/metrics")
            t_stop = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
            stop_seconds = time.monotonic() - t_stop
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.kill(redis.proc.pid, signal.SIGCONT)
            redis.stop()
        text = Path(log).read_text()
        closed = re.search(r"prompt store closed: (\d+) durable.*", text)
        durable = int(closed.group(1)) if closed else None
        model, tokenizer = mlx_lm.load(model_dir)
        with mlxkv.PromptStore(model, tokenizer, cap=1 << 26, directory=disk.directory, scheme=SCHEME) as reopened:
            indexed = reopened.opened.indexed
    finally:
        disk.close()
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "settings": {
            "minutes": args.minutes,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "prompt_cache_bytes": args.cache_bytes,
            "store_disk_bytes": args.disk_bytes,
            "disk": f"tmpfs of {args.disk_mib} MiB" if disk.mounted else f"a plain directory ({disk.why_not})",
            "scheme": SCHEME,
            "model": "seeded llama (mlxkv.models.seeded)",
        },
        "events": events,
        "exit_status": rc,
        "stop_seconds": round(stop_seconds, 2),
        "last_line": closed.group(0) if closed else None,
        "health_at_end": json.loads(health) if health else None,
    }
    result.update(measured(answers, rss, events, t_start, args, durable, indexed, metrics))
    write_result("serve_soak", result, args.out)  # the measurements, before the slow check of the answers
    result.update(check_answers(answers, model, tokenizer, args.max_tokens))
    result["targets"]["no_wrong_answers"] = not result["wrong_answers"]
    return result


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    except Exception:
        return ""
    finally:
        conn.close()


def phase_at(events, t: float) -> str:
    name = "healthy"
    for at, what in events:
        if at <= t:
            name = what.split(" ")[0]
    return name


def check_answers(answers, model, tokenizer, max_tokens: int) -> dict:
    """Each answer served against a cold start: ``batch_generate`` over fresh caches, 32
    prompts at a time; an answer that differs is checked serially, against a cold start
    and against the answer resuming the prefix the server said it reused (``cached``), and
    is wrong if it differs from both."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import batch_generate

    import mlxkv

    served = [a for a in answers if a.status == 200 and not a.error]

    def generate(tokens, cached):
        caches = mlxkv.make_cache(model, SCHEME)
        if cached:
            mx.eval(model(mx.array(tokens[:cached])[None], cache=caches))
        return mlx_lm.generate(model, tokenizer, tokens[cached:], max_tokens=max_tokens, prompt_cache=caches)

    unlike_batched, unlike_cold, wrong = 0, 0, []
    for i in range(0, len(served), 32):
        if i % 320 == 0:
            print(f"serve_soak: checking answers against cold starts, {i} of {len(served)}", file=sys.stderr)
        group = served[i : i + 32]
        cold = batch_generate(model, tokenizer, [a.tokens for a in group], max_tokens=max_tokens).texts
        for a, text in zip(group, cold, strict=True):
            if a.text == text:
                continue
            unlike_batched += 1
            if a.text == generate(a.tokens, 0):
                continue
            unlike_cold += 1
            if a.text != generate(a.tokens, a.cached):
                wrong.append(a.index)
    return {
        "answers_checked": len(served),
        "wrong_answers": len(wrong),
        "wrong": wrong[:20],
        "answers_unlike_a_batched_cold_start_but_equal_to_a_serial_one": unlike_batched - unlike_cold,
        "answers_unlike_cold_start_but_equal_to_the_resumed_prefix": unlike_cold - len(wrong),
    }


def measured(answers, rss, events, t_start, args, durable, indexed, metrics) -> dict:
    failed = [a for a in answers if a.status != 200 or a.error]
    served = [a for a in answers if a.status == 200 and not a.error]
    gaps: dict[str, list[float]] = {}
    for a in served:
        for t0, t1 in zip(a.times, a.times[1:]):
            gaps.setdefault(phase_at(events, t1 - t_start), []).append(t1 - t0)
    start_rss = rss[0][1]
    warm = next((b for _, b, n in rss if n >= max(1, len(answers) // 10)), start_rss)
    peak = max(b for _, b, _ in rss)
    cap = _size(args.cache_bytes)
    healthy, frozen = gaps.get("healthy", []), gaps.get("redis-frozen", [])
    p99h, p99f = percentile(healthy, 0.99), percentile(frozen, 0.99)
    mib = 1 << 20
    summary = {
        "requests": len(answers),
        "requests_failed": len(failed),
        "failures": [f"#{a.index}: {a.status} {a.error}" for a in failed[:10]],
        "durable_reported": durable,
        "entries_indexed_after_restart": indexed,
        "durable_lost": None if durable is None else max(0, durable - indexed),
        "rss_mib": {
            "start": round(start_rss / mib, 1),
            "after_10pct": round(warm / mib, 1),
            "peak": round(peak / mib, 1),
            "end": round(rss[-1][1] / mib, 1),
            "growth_from_start": round((peak - start_rss) / mib, 1),
            "growth_after_10pct": round((peak - warm) / mib, 1),
            "cap_plus_64": round(cap / mib + 64, 1),
        },
        "rss_over_time": [(round(t, 1), round(b / mib, 1), n) for t, b, n in rss[:: max(1, len(rss) // 60)]],
        "gap_ms": {
            name: {
                "p50": round(statistics.median(v) * 1e3, 1),
                "p99": round(percentile(v, 0.99) * 1e3, 1),
                "max": round(max(v) * 1e3, 1),
                "n": len(v),
            }
            for name, v in sorted(gaps.items())
        },
        "store_metrics_at_end": [
            line for line in metrics.splitlines() if line.startswith("mlxkv_store_") and "_total" in line
        ],
    }
    summary["targets"] = {
        "rss_within_cap_plus_64MiB": peak - start_rss <= cap + 64 * mib,
        "p99_frozen_within_2x_healthy": None if p99h is None or p99f is None else p99f <= 2 * p99h,
        "p99_ratio_frozen_to_healthy": None if not p99h or p99f is None else round(p99f / p99h, 2),
        "no_wrong_answers": None,  # check_answers says
        "no_durable_entry_lost": durable is not None and durable <= indexed,
    }
    return summary


def _size(text: str) -> int:
    from mlx_lm.utils import _parse_size

    return _parse_size(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="duration of the load (default: 10)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default: 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (default: 16)")
    p.add_argument("--cache-bytes", default="16MB", help="--prompt-cache-bytes of the server (default: 16MB)")
    p.add_argument(
        "--disk-bytes",
        default="256MB",
        help="--store-disk-bytes of the server, the cap an operator gives the directory (default: 256MB)",
    )
    p.add_argument(
        "--disk-mib",
        type=int,
        default=2048,
        help="size of the store's tmpfs (default: 2048, room for the run's entries until the disk-full phase)",
    )
    p.add_argument("--quick", action="store_true", help="a few seconds with 2 clients (the test suite's smoke run)")
    p.add_argument("--out", help="result file (default: benchmarks/results/serve_soak.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.clients, args.max_tokens, args.disk_mib, args.disk_bytes = 0.12, 2, 4, 32, "16MB"
    result = run_soak(args)
    path = write_result("serve_soak", result, args.out)
    shown = {k: v for k, v in result.items() if k not in ("rss_over_time",)}
    print(json.dumps(shown, indent=1))
    print(f"written to {path}")
    return 0 if all(v is not False for v in result["targets"].values()) and not result["requests_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
