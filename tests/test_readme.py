"""Every Python snippet of the README, and docs/serving.md's batch snippet, runs as written
(in a fresh process, in a scratch directory)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_readme_python_snippets_run_as_written(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "the README has no Python snippet"
    for i, code in enumerate(blocks):
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"README snippet {i} failed:\n{code}\n{done.stderr[-3000:]}"


def test_the_serving_batch_snippet_runs_as_written(tmp_path):
    with open(os.path.join(ROOT, "docs", "serving.md"), encoding="utf-8") as f:
        code = re.findall(r"```python\n(.*?)```", f.read(), re.S)[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"docs/serving.md's batch snippet failed:\n{done.stderr[-3000:]}"
    assert (tmp_path / "row0.safetensors").exists()
