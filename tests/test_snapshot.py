"""Snapshots of the serial family: round trips, bit-exact resume, damaged files, atomicity."""

import json
import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from generation import greedy, run
from helpers import data_start, flip_bit, read_raw, rewrite_header
from safetensors import safe_open

import mlxkv
from mlxkv.caches.schemes import make_cache
from mlxkv.formats.mlxkv_header import FORMAT_VERSION
from mlxkv.models.seeded import prompt

SLOTS = {
    "kv": ["keys", "values"],
    "qkv": ["kPacked", "kScales", "kBiases", "vPacked", "vScales", "vBiases"],
    "rotating": ["keys", "values"],
    "rotating-qkv": ["kPacked", "kScales", "kBiases", "vPacked", "vScales", "vBiases"],
    "ssm": ["0"],
}

CASES = [  # (arch, scheme, make_cache options, prompt length, prefill chunk)
    ("llama", "bf16", {}, 37, 16),
    ("llama", "kv4", {}, 37, 16),
    ("llama", "kv8-g32", {}, 37, 16),
    ("llama", "kv4-start16", {}, 12, 12),  # saved before its conversion
    ("llama", "kv4-start16", {}, 37, 16),  # and after
    ("llama", "bf16", {"max_kv_size": 24}, 50, 7),  # wrapped rings with keep=4
    ("llama", "kv8", {"max_kv_size": 24}, 50, 7),  # wrapped rotating-quantized rings
    ("gemma3", "bf16", {}, 45, 16),  # sliding layers wrapped (window 32)
    ("gemma3", "kv4", {}, 45, 45),
    ("hybrid", "bf16", {}, 21, 8),
    ("hybrid", "kv8-g32", {}, 21, 8),
]


def _ids(case):
    arch, scheme, opts, n, _ = case
    return f"{arch}-{scheme}-{n}" + ("-ring" if opts else "")


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_resume_is_bit_exact(models, tmp_path, case):
    arch, scheme, opts, n, chunk = case
    model = models(arch)
    caches = make_cache(model, scheme, **opts)
    tokens = prompt(n)
    run(model, caches, tokens, chunk)
    path = str(tmp_path / "s.safetensors")
    header = mlxkv.save(path, caches, tokens, model_id=model.mlxkv_model_id)
    snap = mlxkv.load(path, model=model, model_id=model.mlxkv_model_id)
    assert snap.tokens == tokens
    for c, r in zip(caches, snap.caches):
        assert (r.kind, r.offset, r.minimum_reusable_offset) == (c.kind, c.offset, c.minimum_reusable_offset)
    a_toks, a_logits = greedy(model, caches, 7, 12)
    b_toks, b_logits = greedy(model, snap.caches, 7, 12)
    assert a_toks == b_toks
    assert all(mx.array_equal(x, y) for x, y in zip(a_logits, b_logits))
    assert [c.kind for c in caches] == [c.kind for c in snap.caches]
    for entry in header["caches"]:
        assert [t["slot"] for t in entry["tensors"]] == SLOTS[entry["kind"]][: len(entry["tensors"])]


def test_header_fields_slots_and_dtypes(models, tmp_path):
    model = models("gemma3")
    caches = make_cache(model, "kv4")
    tokens = prompt(40)
    run(model, caches, tokens, 16)
    path = str(tmp_path / "g.safetensors")
    mlxkv.save(path, caches, tokens, model_id="m", config_fingerprint="cf", tokenizer_hash="th", ns="lora-a")
    h = mlxkv.read_header(path)
    assert h["formatVersion"] == FORMAT_VERSION and h["codecProvider"] == "mlxkv" and h["tokens"] == tokens
    assert (h["modelId"], h["configFingerprint"], h["tokenizerHash"], h["ns"]) == ("m", "cf", "th", "lora-a")
    ring, quant = h["caches"][0], h["caches"][1]
    assert ring["kind"] == "rotating" and ring["maxSize"] == 32 and ring["keep"] == 0
    assert ring["offset"] == 40 and ring["idx"] == caches[0]._idx
    assert [t["dtype"] for t in ring["tensors"]] == ["BF16", "BF16"]
    assert quant["kind"] == "qkv" and (quant["bits"], quant["groupSize"], quant["offset"]) == (4, 64, 40)
    assert [t["dtype"] for t in quant["tensors"]] == ["U32", "BF16", "BF16"] * 2
    assert quant["tensors"][0]["shape"] == [1, 2, 40, 8] and quant["tensors"][1]["shape"] == [1, 2, 40, 1]
    assert all(len(t["crc32"]) == 8 for e in h["caches"] for t in e["tensors"])
    with safe_open(path, "numpy") as f:  # the safetensors package reads our files
        assert set(f.keys()) == {t["name"] for e in h["caches"] for t in e["tensors"]}
        assert json.loads(f.metadata()["mlxkv"]) == h


def test_file_holds_logical_bytes_only(models, tmp_path):
    model = models("llama")
    caches = make_cache(model, "bf16")
    tokens = prompt(10)
    run(model, caches, tokens)
    path = str(tmp_path / "p.safetensors")
    mlxkv.save(path, caches, tokens)
    logical = 4 * 2 * (1 * 2 * 10 * 64 * 2)  # layers * (K,V) * bytes of 10 positions
    assert os.path.getsize(path) == data_start(path) + logical
    restored = mlxkv.load(path).caches[0]
    assert restored.keys.shape[2] == 256 and restored.offset == 10  # slack restored, not stored


@pytest.fixture
def saved(models, tmp_path):
    model = models("llama")
    caches = make_cache(model, "bf16")
    tokens = prompt(12)
    run(model, caches, tokens)
    path = str(tmp_path / "s.safetensors")
    mlxkv.save(path, caches, tokens, model_id=model.mlxkv_model_id)
    return path, model, caches, tokens


def test_truncated_file(saved):
    path = saved[0]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(mlxkv.CorruptSnapshotError, match="truncated"):
        mlxkv.load(path)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(mlxkv.CorruptSnapshotError, match="truncated"):
        mlxkv.read_header(path)


@pytest.mark.parametrize("content", [b"", b"hello, this is a text file\n", bytes(range(256)) * 4])
def test_a_file_that_is_no_snapshot_is_reported_as_such(tmp_path, content):
    path = tmp_path / "other.bin"
    path.write_bytes(content)
    want = "an empty file, not a snapshot" if not content else "not a snapshot: it has no mlx-bun magic"
    for read in (mlxkv.read_header, mlxkv.load, mlxkv.verify):
        with pytest.raises(mlxkv.CorruptSnapshotError, match=want) as e:
            read(str(path))
        assert "truncated" not in str(e.value)


def test_flipped_bit_in_a_tensor(saved):
    path = saved[0]
    flip_bit(path, data_start(path) + 1000, bit=3)
    mlxkv.read_header(path)  # the header is intact
    with pytest.raises(mlxkv.CorruptSnapshotError, match="checksum mismatch in tensor"):
        mlxkv.load(path)
    with pytest.raises(mlxkv.CorruptSnapshotError, match="checksum mismatch"):
        mlxkv.verify(path)
    assert mlxkv.load(path, verify=False).caches[0].offset == 12  # explicitly unverified


def test_flipped_bit_in_the_header(saved):
    path = saved[0]
    doc, _ = read_raw(path)
    raw = open(path, "rb").read()
    at = raw.index(b'"modelId') + 3  # inside our JSON header text
    flip_bit(path, at, bit=1)
    with pytest.raises(mlxkv.CorruptSnapshotError):
        mlxkv.read_header(path)


def test_unknown_kind_fails_before_any_tensor_is_read(saved, monkeypatch):
    from mlxkv.io.tensor_reader import TensorReader

    path = saved[0]
    rewrite_header(path, lambda h: h["caches"][2].update(kind="kv-from-the-future"))
    reads = []
    monkeypatch.setattr(TensorReader, "read_all", lambda self, *a: reads.append(a))
    with pytest.raises(mlxkv.UnknownKindError, match="kv-from-the-future"):
        mlxkv.load(path)
    assert reads == []


def test_newer_format_version(saved):
    path = saved[0]
    rewrite_header(path, lambda h: h.update(formatVersion=FORMAT_VERSION + 1))
    with pytest.raises(mlxkv.FormatVersionError, match=f"version {FORMAT_VERSION + 1}"):
        mlxkv.read_header(path)


def test_identity_mismatch(saved):
    path, model = saved[0], saved[1]
    with pytest.raises(mlxkv.IdentityMismatchError, match="modelId"):
        mlxkv.load(path, model_id="someone/else")
    with pytest.raises(mlxkv.IdentityMismatchError, match="ns"):
        mlxkv.load(path, ns="adapter-b")
    assert mlxkv.load(path, model_id=model.mlxkv_model_id, ns="").caches


def test_wrong_layer_count_and_head_geometry(saved, models):
    path = saved[0]
    with pytest.raises(mlxkv.GeometryMismatchError, match="3"):
        mlxkv.load(path, model=models("llama", num_hidden_layers=3))
    with pytest.raises(mlxkv.GeometryMismatchError, match="kv heads"):
        mlxkv.load(path, model=models("llama", num_key_value_heads=4))
    with pytest.raises(mlxkv.GeometryMismatchError, match="kv heads"):
        mlxkv.load(path, model=models("hybrid"))


def test_declared_shape_that_disagrees_with_the_file(saved):
    path = saved[0]

    def lie(h):
        h["caches"][0]["offset"] = 13

    rewrite_header(path, lie)
    with pytest.raises(mlxkv.CorruptSnapshotError, match="offset"):
        mlxkv.load(path)


def test_empty_cache_and_bad_tokens_are_refused_before_writing(models, tmp_path):
    path = str(tmp_path / "e.safetensors")
    with pytest.raises(mlxkv.EmptyCacheError, match="holds no tokens"):
        mlxkv.save(path, make_cache(models("llama"), "bf16"), [])
    with pytest.raises(mlxkv.EmptyCacheError):
        mlxkv.save(path, [], [])
    caches = make_cache(models("llama"), "bf16")
    run(models("llama"), caches, prompt(5))
    with pytest.raises(mlxkv.SnapshotError, match="exact prefix"):
        mlxkv.save(path, caches, prompt(4))

    class Stranger(mlxkv.KVCache):
        kind = "kv:stranger"

    odd = Stranger()
    odd.offset = 5
    with pytest.raises(mlxkv.UnknownKindError, match="kv:stranger"):
        mlxkv.save(path, caches[:3] + [odd], prompt(5))
    assert not os.listdir(tmp_path)


def test_failed_save_keeps_the_previous_snapshot(saved):
    path, model, caches, tokens = saved
    before = open(path, "rb").read()

    def boom(done, total):
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        mlxkv.save(path, caches, tokens, progress=boom)
    assert open(path, "rb").read() == before
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # temp file removed


def test_a_write_the_file_system_refuses_is_ours_and_an_oserror(saved, monkeypatch, tmp_path):
    import errno

    path, model, caches, tokens = saved
    with pytest.raises(mlxkv.SnapshotWriteError, match="cannot create a file in") as e:
        mlxkv.save(str(tmp_path / "no-such-dir" / "s.safetensors"), caches, tokens)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOENT

    before = open(path, "rb").read()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(mlxkv.SnapshotWriteError, match="No space left.*unchanged") as e:
        mlxkv.save(path, caches, tokens)
    assert e.value.errno == errno.ENOSPC
    assert open(path, "rb").read() == before
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


WRITER = r"""
import sys, time, mlx.core as mx, mlxkv
caches = []
for _ in range(8):
    c = mlxkv.KVCache()
    c.update_and_fetch(mx.ones((1, 8, 4096, 128), mx.bfloat16), mx.ones((1, 8, 4096, 128), mx.bfloat16))
    caches.append(c)
def slow(done, total):
    print(done, flush=True)
    time.sleep(0.3)
mlxkv.save(sys.argv[1], caches, list(range(4096)), progress=slow)
print("finished", flush=True)
"""


def test_save_killed_mid_write_leaves_the_previous_snapshot(saved):
    path = saved[0]
    before = open(path, "rb").read()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # one tensor of sixteen is on disk
    assert line.strip().isdigit()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert open(path, "rb").read() == before
    assert mlxkv.load(path).tokens == saved[3]
    leftovers = [f for f in os.listdir(os.path.dirname(path)) if f != os.path.basename(path)]
    assert all(f.startswith(".s.safetensors.mlxkv-tmp.") for f in leftovers)


def test_peak_extra_memory_saving_one_tensor_loading_none(tmp_path):
    """A save holds one contiguous copy of a tensor at most (the caches' slices past their
    slack are strided: numpy copies them, one at a time), counted with MLX's and numpy's own
    allocations; caches not yet computed are evaluated a group of tensors at a time."""
    import tracemalloc

    from mlxkv.io.safetensors import EVAL_GROUP

    def caches(evaluated):
        out = []
        for _ in range(8):
            c = mlxkv.KVCache()
            x = mx.random.normal((1, 8, 1000, 128)).astype(mx.bfloat16)
            c.update_and_fetch(x, x)
            out.append(c)
        mx.eval([c.state if evaluated else c.keys for c in out])
        return out

    tensor = 1 * 8 * 1000 * 128 * 2
    total = 16 * tensor
    path = str(tmp_path / "m.safetensors")

    def save_extra(cs):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        tracemalloc.start()
        mlxkv.save(path, cs, list(range(1000)))
        numpy_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return max(mx.get_peak_memory() - base, 0) + numpy_peak

    assert save_extra(caches(True)) < 2 * tensor < total / 4
    assert save_extra(caches(False)) < EVAL_GROUP + 2 * tensor  # the values computed a group at a time
    mx.clear_cache()
    mx.reset_peak_memory()
    snap = mlxkv.load(path)
    load_extra = mx.get_peak_memory() - mx.get_active_memory()
    assert snap.caches[7].offset == 1000
    assert load_extra < tensor / 8  # arrays are read into in place: nothing beside them


def test_slots_of_the_wrong_rank_are_refused(saved):
    """Consistent but rank-2 shapes in both headers: a clear error, not an IndexError."""
    import struct

    from mlxkv.io.safetensors import crc32_hex

    path = saved[0]
    doc, body = read_raw(path)
    header = json.loads(doc["__metadata__"]["mlxkv"])
    for t in header["caches"][0]["tensors"]:
        B, H, T, D = t["shape"]
        t["shape"] = doc[t["name"]]["shape"] = [B * H * T, D]
    text = json.dumps(header, separators=(",", ":"))
    doc["__metadata__"] = {"mlxkv": text, "mlxkv.crc32": crc32_hex(text.encode())}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)
    with pytest.raises(mlxkv.CorruptSnapshotError, match=r"expected \[B, H, T, X\]"):
        mlxkv.load(path)


def test_identity_is_derived_from_config_and_weights(models):
    from mlxkv.models.seeded import build_model
    from mlxkv.state.identity import Identity, canonical_config, model_fingerprint, model_identity

    llama = models("llama")
    assert model_fingerprint(llama) == model_fingerprint(models("llama"))  # cached, and stable
    assert model_fingerprint(llama) != model_fingerprint(models("llama", num_hidden_layers=3))
    other_weights = build_model("llama", seed=1)  # same architecture and config
    assert canonical_config(other_weights) == canonical_config(llama)
    assert model_fingerprint(other_weights) != model_fingerprint(llama)
    assert model_identity(llama) == Identity(model_id="seeded/llama@0", config_fingerprint=model_fingerprint(llama))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
def test_the_layer_count_a_load_checks_is_the_models_own(arch, models):
    """``load(..., model=)`` counts the caches the model asks for (its own template, else its
    layers) without building mlxkv caches; it is what make_cache builds."""
    from mlxkv.caches.schemes import layer_count, make_cache
    from mlxkv.state.identity import model_geometry

    model = models(arch)
    assert model_geometry(model).layers == layer_count(model) == len(make_cache(model, "bf16"))
    bare = type("Bare", (), {"layers": model.layers})()  # no template of its own: one cache per layer
    assert layer_count(bare) == len(model.layers)
