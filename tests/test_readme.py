"""Every Python snippet of the README runs as written (in a fresh process, in a scratch
directory)."""

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
