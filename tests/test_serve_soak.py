"""The soak benchmark (``benchmarks/serve_soak.py``) run briefly (``--quick``), so the script
does not rot: the real ``mlxkv serve`` with every tier, Redis frozen, killed and restarted,
the disk filled, and every answer, failure and durable entry accounted for."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_soak_runs_and_meets_its_targets_briefly(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "benchmarks.serve_soak", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["requests"] >= 1 and result["requests_failed"] == 0, result["failures"]
    assert result["answers_checked"] == result["requests"]
    assert result["wrong_answers"] == 0 and result["durable_lost"] == 0
    assert result["exit_status"] == 0 and result["durable_reported"] >= 1
    assert [name.split(" ")[0] for _, name in result["events"]] == [
        "healthy",
        "redis-frozen",
        "healthy",
        "redis-killed",
        "healthy",
        "disk-full",
        "healthy",
    ]
    assert set(result["gap_ms"]) <= {"healthy", "redis-frozen", "redis-killed", "disk-full"}
    assert result["rss_mib"]["peak"] > 0 and result["health_at_end"]["status"] in ("ok", "degraded")
