"""The ``mlxkv`` command as users type it, each in a fresh process: ``python -m mlxkv``,
``--version``, ``--help`` (the public commands only), ``serve --help`` (every default),
``schemes``, ``import mlxkv`` without mlx-lm, and ``inspect``/``verify``/``convert``/
``schemes``/``--help``/``--version`` without mlx-lm or transformers."""

import glob
import os
import re
import subprocess
import sys

import pytest

import mlxkv
from mlxkv.formats.table import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_python_dash_m_mlxkv_and_version():
    r = run("-m", "mlxkv", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mlxkv {mlxkv.__version__}", r.stderr


def test_help_lists_the_public_commands_only():
    r = run("-m", "mlxkv", "--help")
    assert r.returncode == 0, r.stderr
    assert "_resume" not in r.stdout
    for command in ("demo", "fetch-model", "inspect", "verify", "convert", "schemes", "serve"):
        assert re.search(rf"^\s+{command}\s", r.stdout, re.M), command


def test_serve_help_shows_every_default():
    r = run("-m", "mlxkv", "serve", "--help")
    assert r.returncode == 0, r.stderr
    options = re.split(r"\n  (?=--)", r.stdout.split("options:", 1)[1])[1:]
    assert len(options) > 20
    for text in options:
        assert "default" in text or "required" in text, text


def test_schemes_lists_every_form_and_says_where_they_are_described():
    from mlxkv.caches.schemes import parse_scheme

    r = run("-m", "mlxkv", "schemes")
    assert r.returncode == 0, r.stderr
    for form in ("kv<bits>[-g<group>][-start<start>]", "turbo-k<k>v<v>[-start<start>]", "tova-b<budget>-s<sink>"):
        assert form in r.stdout
    examples = re.findall(r"e\.g\. (.+)", r.stdout)
    assert len(examples) == len([f for f in mlxkv.families() if f.scheme is not None])
    for line in examples:
        for scheme in line.split(", "):
            parse_scheme(scheme)  # every example is a valid scheme
    assert "docs/choosing-a-scheme.md" in r.stdout
    assert "mlxkv schemes" in run("-m", "mlxkv", "serve", "--help").stdout


def test_import_mlxkv_imports_neither_mlx_lm_nor_transformers():
    code = (
        "import sys, mlxkv; print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules)); "
        "print(mlxkv.KVCache.kind)"
    )
    r = run("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "kv:plain"]


#: the fixtures each light command runs on: mlxkv snapshots of several families and an
#: mlx-bun file (the container, the translation and every codec's header check)
LIGHT_FIXTURES = (
    "fixtures/valid/kv-llama.safetensors",
    "fixtures/valid/ssm-hybrid.safetensors",
    "fixtures/valid/turboquant-k4v3-llama.safetensors",
    "fixtures/valid/qfilters-b6-s2-r2-llama.safetensors",
    "fixtures/valid/rotating-gemma3.safetensors",
    "fixtures/valid/converted-kv4-start4-hybrid.safetensors",
    "fixtures/valid/pending-kv4-start32-hybrid.safetensors",  # bf16-first, saved before converting
    "fixtures/valid/pending-turbo-k4v2-start16-hybrid.safetensors",
)
#: the command's main in a fresh process, then which of mlx-lm, transformers and numpy it imported
IMPORTED = (
    "import sys\n"
    "from mlxkv.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    "print('imported:', sorted(m for m in ('mlx_lm', 'transformers', 'numpy') if m in sys.modules))\n"
    "sys.exit(code)\n"
)


def light_commands():
    yield ["--version"]
    yield ["--help"]
    yield ["schemes"]
    for path in (*LIGHT_FIXTURES, *sorted(glob.glob("fixtures/mlx-bun/*.mlxkv", root_dir=ROOT))[:2]):
        yield ["inspect", path]
        yield ["verify", path]


@pytest.mark.parametrize("argv", list(light_commands()), ids=" ".join)
def test_header_commands_import_neither_mlx_lm_nor_transformers(argv):
    """inspect, verify, schemes, --help and --version read the kind table (codecs, kinds,
    scheme patterns) and never import a live cache class, so neither mlx-lm nor transformers
    (about 2 s of CPU at startup); nor numpy (0.15 s): headers and checksums are read as
    bytes."""
    r = run("-c", IMPORTED, *argv)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "imported: []", r.stdout[-400:]


#: conversions between the three formats: (source, target); the mlx-lm source is written by
#: the test (``mlx_lm_file``) from an mlx-bun fixture
CONVERSIONS = (
    ("fixtures/valid/kv-llama.safetensors", "mlx-bun"),
    ("fixtures/mlx-bun/qkv-v3.mlxkv", "mlx-lm"),
    ("fixtures/valid/pending-kv4-start32-hybrid.safetensors", "mlxkv"),
    ("fixtures/valid/turboquant-k4v3-llama.safetensors", "mlxkv"),
    ("fixtures/valid/qfilters-b6-s2-r2-llama.safetensors", "mlxkv"),
    ("fixtures/valid/tova-b6-s2-llama.safetensors", "mlxkv"),
    ("fixtures/valid/rotating-wrapped-llama.safetensors", "mlxkv"),
    ("fixtures/valid/ssm-hybrid.safetensors", "mlxkv"),
    ("fixtures/mlx-bun/rotating-v3.mlxkv", "mlxkv"),
    ("fixtures/mlx-bun/rotating-v3.mlxkv", "mlx-lm"),
    ("fixtures/mlx-bun/ssm-v3.mlxkv", "mlx-bun"),
    ("mlx-lm", "mlxkv"),
    ("mlx-lm", "mlx-bun"),
)


@pytest.fixture(scope="module")
def mlx_lm_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mlx-lm") / "prompt-cache.safetensors")
    convert(os.path.join(ROOT, "fixtures/mlx-bun/rotating-prompt-v3.mlxkv"), path, to="mlx-lm")
    return path


@pytest.mark.parametrize(("src", "to"), CONVERSIONS, ids=[f"{s}->{t}" for s, t in CONVERSIONS])
def test_convert_imports_neither_mlx_lm_nor_transformers(src, to, mlx_lm_file, tmp_path):
    """A conversion carries each layer's entry and arrays from the reader to the writer
    (``kinds.entries.Layer``) and builds no cache, so it imports neither."""
    src = mlx_lm_file if src == "mlx-lm" else src
    dst = str(tmp_path / ("out.mlxkv" if to == "mlx-bun" else "out.safetensors"))
    r = run("-c", IMPORTED, "convert", src, dst, "--to", to)
    assert r.returncode == 0, r.stderr
    assert f"wrote {dst} ({to})" in r.stdout
    assert r.stdout.splitlines()[-1] == "imported: ['numpy']", r.stdout[-400:]  # the writer's array bytes
