"""The ``mlxkv`` command, run as ``python -m mlxkv.cli`` in a subprocess."""

import io
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers import data_start, flip_bit
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.cli import LARGE_FILE, Progress, layers_by_kind
from mlxkv.models.seeded import prompt
from mlxkv.session import Sampler, Session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlxkv_cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "mlxkv.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.fixture
def snapshot(models, tmp_path):
    s = Session.start(models("gemma3"), prompt(20), "kv4", sampler=Sampler(0.8), seed=4)
    s.generate(20)
    path = str(tmp_path / "gemma3.safetensors")
    s.save(path)
    return path


def test_demo_quick_resumes_identically():
    proc = mlxkv_cli("demo", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["llama"], ["gemma3"], ["hybrid"])
    ]
    assert len(rows) == 9  # 3 architectures x 3 quick schemes
    for row in rows:
        assert row[-2:] == ["yes", "0"], row
    assert "2 kv:rotating-plain + 2 kv:quant:4:64" in proc.stdout
    assert "2 ssm + 2 kv:plain" in proc.stdout


def test_demo_marks_unknown_schemes_not_available():
    proc = mlxkv_cli("demo", "--quick", "--archs", "llama", "--schemes", "bf16,nosuch-k9")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "nosuch-k9" in x)
    assert "not available" in line


def test_inspect_prints_the_header_without_reading_tensors(snapshot):
    flip_bit(snapshot, data_start(snapshot) + 5)  # damaged tensor bytes: inspect must not care
    proc = mlxkv_cli("inspect", snapshot)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "seeded/gemma3@0" in out
    assert "tokens" in out and "40 [" in out
    assert "prompt 20 + generated 20 tokens" in out and "seed 4 (explicit)" in out
    assert "(= the recorded policy's)" in out and '"temperature":0.8' in out and "finishReason" in out
    for kind in ("rotating", "qkv"):
        assert kind in out
    assert "kPacked:U32[1, 2, 40, 8]" in out
    assert "maxSize=32" in out


def test_verify_good_and_damaged(snapshot):
    ok = mlxkv_cli("verify", snapshot)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:") and "every checksum matches" in ok.stdout
    flip_bit(snapshot, data_start(snapshot) + 100, bit=3)
    bad = mlxkv_cli("verify", snapshot)
    assert bad.returncode == 1
    assert "checksum mismatch" in bad.stderr and "damaged" in bad.stderr
    assert bad.stdout == ""


def test_verify_truncated_and_missing(snapshot, tmp_path):
    with open(snapshot, "r+b") as f:
        f.truncate(os.path.getsize(snapshot) - 7)
    bad = mlxkv_cli("verify", snapshot)
    assert bad.returncode == 1 and "truncated" in bad.stderr
    missing = mlxkv_cli("verify", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr


def test_convert_mlx_lm_file(models, tmp_path):
    model = models("hybrid")
    caches = mlx_cache.make_prompt_cache(model)
    tokens = prompt(14)
    mx.eval(model(mx.array([tokens]), cache=caches))
    src, dst = str(tmp_path / "mlx.safetensors"), str(tmp_path / "out.safetensors")
    mlx_cache.save_prompt_cache(src, caches, {"model": "mlx-community/some-model"})

    refused = mlxkv_cli("convert", src, dst)
    assert refused.returncode == 1
    assert "--tokens" in refused.stderr and "14 positions" in refused.stderr
    assert not os.path.exists(dst)

    proc = mlxkv_cli("convert", src, dst, "--tokens", ",".join(map(str, tokens)), "--ns", "adapter-a")
    assert proc.returncode == 0, proc.stderr
    assert "2 ssm + 2 kv" in proc.stdout and "14 tokens" in proc.stdout
    snap = mlxkv.load(dst, model=model, ns="adapter-a")
    assert snap.tokens == tokens
    assert snap.header["modelId"] == "mlx-community/some-model"
    assert mlxkv_cli("verify", dst).returncode == 0


def test_unknown_command_is_a_usage_error():
    proc = mlxkv_cli("frobnicate")
    assert proc.returncode == 2


def test_progress_shows_on_a_terminal_or_for_large_files():
    quiet = io.StringIO()
    Progress("saving", stream=quiet)(10, 100)
    assert quiet.getvalue() == ""
    large = io.StringIO()
    p = Progress("saving", stream=large, interval=0)
    p(LARGE_FILE // 2, LARGE_FILE)
    p(LARGE_FILE, LARGE_FILE)
    assert "saving:  50.0%" in large.getvalue() and large.getvalue().endswith("100.0% (64.0 MiB of 64.0 MiB)\n")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    Progress("loading", stream=tty)(1, 2)
    assert "loading" in tty.getvalue()


def test_layers_by_kind():
    assert layers_by_kind(["kv:plain", "kv:plain", "ssm", "kv:plain"]) == "3 kv:plain + 1 ssm"
