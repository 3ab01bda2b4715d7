"""fixtures/ts/check_written.py, the Python half of the TypeScript writer's check (npm test runs
it on the snapshots the TypeScript side wrote): it accepts correct snapshots and refuses
damaged ones, so a green npm run means Python read every TypeScript-written file."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((ROOT / "manifest.json").read_text())


def _checker():
    spec = importlib.util.spec_from_file_location("mlxkv_check_written", ROOT / "ts" / "check_written.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def out(tmp_path):
    """An output directory as the TypeScript writer leaves it, holding Python's own files."""
    index = []
    for f in MANIFEST["fixtures"]:
        shutil.copy(ROOT / f["file"], tmp_path / f"{f['name']}.safetensors")
        index.append({"name": f["name"], "file": f"{f['name']}.safetensors", "fixture": f["name"], "sources": {}})
    (tmp_path / "index.json").write_text(json.dumps(index))
    return tmp_path


def test_the_checker_accepts_correct_snapshots(out, capsys):
    assert _checker().main([str(out), "--fixtures", str(ROOT)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 * len(MANIFEST["fixtures"]) and all(line.startswith("ok   ") for line in lines)


def test_the_checker_refuses_a_damaged_or_missing_snapshot(out, capsys):
    from helpers import data_start, flip_bit

    path = out / "kv-llama.safetensors"
    flip_bit(str(path), data_start(str(path)) + 100)
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps([e for e in index if e["name"] != "ssm-hybrid"]))
    assert _checker().main([str(out), "--fixtures", str(ROOT)]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert any("ssm-hybrid" in line for line in failed)
    assert any(line.startswith("FAIL kv-llama: mlxkv.verify") and "checksum mismatch" in line for line in failed)
