"""Hardening of the snapshot reader and writer (issue 10): every case a hostile tester found,
each built from a real damaged or crafted file."""

import json
import os
import subprocess
import sys
import weakref

import mlx.core as mx
import numpy as np
import pytest
from fuzzing import Parts, deep, join
from generation import run
from helpers import data_start, read_raw, replace_before_tensors
from stress import killed_writers

import mlxkv
from mlxkv.errors import CorruptSnapshotError, IdentityMismatchError, SnapshotError
from mlxkv.io import temporaries, tensor_reader
from mlxkv.io.safetensors import array_buffer
from mlxkv.models.seeded import build_model, prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- building files -----------------------------------------------------------------------------


DEEP = deep(3000)  # a value json.dumps would recurse on; fuzzing.dumps writes it


def write_parts(path, outer, body: bytes, raw: bytes | None = None):
    with open(path, "wb") as f:
        f.write(join(outer, body, raw))


def craft(path, edit_header=None, edit_outer=None, tensors=None):
    """Rewrite ``path`` with ``edit_header(mlxkv header)`` / ``edit_outer(safetensors doc)``
    applied and tensor bytes replaced from ``tensors`` (name -> bytes); byte ranges are
    re-laid out and every checksum recomputed: a consistent, crafted file."""
    parts = Parts(open(path, "rb").read())
    parts.tensors.update({k: bytearray(v) for k, v in (tensors or {}).items()})
    if edit_header:
        edit_header(parts.inner)
    if edit_outer:
        edit_outer(parts.outer)
    with open(path, "wb") as f:
        f.write(parts.build())


def refused_everywhere(path, error=SnapshotError, match=None, header_too=True):
    """read_header (when the header is at fault), verify and load all refuse with ours."""
    calls = [mlxkv.load, mlxkv.verify] + ([mlxkv.read_header] if header_too else [])
    for call in calls:
        with pytest.raises(error, match=match):
            call(path)


@pytest.fixture
def llama_file(models, tmp_path):
    model = models("llama")
    caches = mlxkv.make_cache(model, "bf16")
    tokens = prompt(12)
    run(model, caches, tokens)
    path = str(tmp_path / "s.safetensors")
    mlxkv.save(path, caches, tokens, model=model)
    return path


def _file_of(models, tmp_path, arch, scheme, n=12, **options):
    model = models(arch)
    caches = mlxkv.make_cache(model, scheme, **options)
    tokens = prompt(n)
    run(model, caches, tokens)
    path = str(tmp_path / f"{arch}-{scheme}.safetensors")
    mlxkv.save(path, caches, tokens, model=model)
    return path


# -- 1. the header checksum cannot be switched off --------------------------------------------


def test_a_flipped_bit_in_the_checksum_key_and_one_in_tokens_is_refused(llama_file):
    data = bytearray(open(llama_file, "rb").read())
    at = data.index(b'"mlxkv.crc32"') + len('"mlxkv.crc3')  # the "2": one bit makes it "3"
    data[at] ^= 0x01
    at = data.index(b'\\"tokens\\":[') + len(b'\\"tokens\\":[')
    while chr(data[at + 1]).isdigit():
        at += 1
    data[at] ^= 0x01  # the last digit of the first token id: still a digit, another token
    open(llama_file, "wb").write(bytes(data))
    refused_everywhere(llama_file, CorruptSnapshotError, "has no checksum")


@pytest.mark.parametrize("key", ["mlxkw.crc32", "mlxkv.crc33", "Mlxkv.crc32", "mlxkv.note"])
def test_a_metadata_key_that_looks_like_a_damaged_mlxkv_key_is_refused(llama_file, key):
    outer, body = read_raw(llama_file)
    outer["__metadata__"][key] = outer["__metadata__"]["mlxkv.crc32"]
    write_parts(llama_file, outer, body)
    refused_everywhere(llama_file, CorruptSnapshotError, "looks like a damaged mlxkv key")


def test_other_metadata_keys_are_ignored(llama_file):
    outer, body = read_raw(llama_file)
    outer["__metadata__"]["format"] = "pt"
    write_parts(llama_file, outer, body)
    assert mlxkv.load(llama_file).tokens == prompt(12)


def test_a_checksum_that_is_not_eight_lowercase_hex_digits_is_refused(llama_file):
    outer, body = read_raw(llama_file)
    outer["__metadata__"]["mlxkv.crc32"] = outer["__metadata__"]["mlxkv.crc32"].upper() + " "
    write_parts(llama_file, outer, body)
    refused_everywhere(llama_file, CorruptSnapshotError, "checksum mismatch in the snapshot header")


# -- 2. every refusal is ours -------------------------------------------------------------------

FOREIGN = {  # what each raised on main before: RecursionError, OverflowError, TypeError, ...
    "deep nesting in the safetensors header": (None, lambda o: o.update({"x": DEEP})),
    "deep nesting in the mlxkv header": (lambda h: h.update(attachments={"x": DEEP}), None),
    "a float shape": (None, lambda o: o["caches.0.keys"].update(shape=[1.0, 2, 12, 64])),
    "an infinite number": (lambda h: h["caches"][0].update(offset=1e400), None),
    "an integer beyond 2**53": (lambda h: h["caches"][0].update(offset=2**64), None),
    "a list as a tensor name": (lambda h: h["caches"][0]["tensors"][0].update(name=["caches.0.keys"]), None),
    "a list as a slot": (lambda h: h["caches"][0]["tensors"][0].update(slot=["keys"]), None),
    "a dict as a kind": (lambda h: h["caches"][0].update(kind={"kv": 1}), None),
    "a lone surrogate in the mlxkv header": (lambda h: h.update(modelId="\ud800"), None),
    "a lone surrogate in the metadata": (None, lambda o: o["__metadata__"].update(note="\udc00")),
    "a pendingConversion naming no scheme": (
        lambda h: h["caches"][0].update(pendingConversion={"scheme": "kv99", "start": 4}),
        None,
    ),
    "a pendingConversion with a negative start": (
        lambda h: h["caches"][0].update(pendingConversion={"scheme": "kv4", "start": -1}),
        None,
    ),
    "NaN in the mlxkv header": (lambda h: h.update(createdAt=float("nan")), None),
    "a bool offset": (lambda h: h["caches"][0].update(offset=True), None),
    "a float offset": (lambda h: h["caches"][0].update(offset=12.0), None),
    "an unknown persisted kind": (lambda h: h["caches"][0].update(kind="kv-from-the-future"), None),
    "an identity field of another type": (lambda h: h.update(ns=["a"]), None),
}


@pytest.mark.parametrize("case", list(FOREIGN), ids=list(FOREIGN))
def test_malformed_headers_are_refused_with_our_errors(llama_file, case):
    edit_header, edit_outer = FOREIGN[case]
    if edit_outer is not None and edit_header is None:  # the safetensors header: no checksum to fix
        outer, body = read_raw(llama_file)
        edit_outer(outer)
        write_parts(llama_file, outer, body)
    else:
        craft(llama_file, edit_header, edit_outer)
    refused_everywhere(llama_file)


def test_an_unknown_kind_is_both_an_unknown_kind_and_a_snapshot_error(llama_file):
    craft(llama_file, lambda h: h["caches"][1].update(kind="kv-from-the-future"))
    with pytest.raises(mlxkv.UnknownKindError) as e:
        mlxkv.load(llama_file)
    assert isinstance(e.value, SnapshotError)


def test_duplicate_keys_are_refused(llama_file):
    outer, body = read_raw(llama_file)
    raw = json.dumps(outer, separators=(",", ":"))
    entry = '"caches.0.values":' + json.dumps(outer["caches.0.values"], separators=(",", ":"))
    write_parts(llama_file, outer, body, raw.replace(entry, entry + "," + entry, 1).encode())
    refused_everywhere(llama_file, CorruptSnapshotError, "appears twice")


# -- 3. every field bounded, with exact arithmetic ------------------------------------------------


def test_an_element_count_beyond_64_bits_in_zero_bytes_is_refused(llama_file):
    """[2**30, 2**30, 16] BF16 is 2**65 bytes; a wrapping int64 product says 0. The
    safetensors package refuses it too."""
    shape = [2**30, 2**30, 16]

    def both(h=None, o=None):
        if h is not None:
            h["caches"][0]["tensors"][0]["shape"] = shape
        if o is not None:
            o["caches.0.keys"]["shape"] = shape

    craft(llama_file, lambda h: both(h=h), lambda o: both(o=o), tensors={"caches.0.keys": b""})
    refused_everywhere(llama_file, CorruptSnapshotError, r"does not hold shape \[1073741824, 1073741824, 16\]")
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError):
        safe_open(llama_file, "numpy")


def test_a_huge_ssm_size_is_refused_before_anything_is_built(models, tmp_path):
    path = _file_of(models, tmp_path, "hybrid", "bf16")
    for size in (2**31, 2**31 - 1, 257):
        craft(path, lambda h, s=size: next(e for e in h["caches"] if e["kind"] == "ssm").update(size=s))
        refused_everywhere(path, CorruptSnapshotError, "size")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["tokens"].pop(), "is at offset 12 but the snapshot has 11 tokens"),
        (lambda h: h["tokens"].append(1), "is at offset 12 but the snapshot has 13 tokens"),
        (lambda h: h["caches"][0].update(minimumReusableOffset=-1), "minimumReusableOffset must be"),
        (lambda h: h["caches"][0].update(minimumReusableOffset=13), "minimumReusableOffset 13 is beyond its offset"),
        (lambda h: h["caches"][0].update(minimumReusableOffset=True), "minimumReusableOffset must be"),
        (lambda h: h["tokens"].__setitem__(0, -1), "tokens must be a list of token ids"),
        (lambda h: h["tokens"].__setitem__(0, 2**31), "tokens must be a list of token ids"),
        (lambda h: h["tokens"].__setitem__(5, True), "tokens must be a list of token ids"),
        (lambda h: h["tokens"].__setitem__(5, 3.0), "tokens must be a list of token ids"),
        (lambda h: h.update(tokens={"0": 1}), "tokens must be a list of token ids"),
        (lambda h: h["caches"][0]["tensors"][1]["shape"].__setitem__(0, True), "header says BF16 \\[True"),
    ],
)
def test_tokens_offsets_and_reuse_floors_are_bounded(llama_file, edit, match):
    craft(llama_file, edit)
    refused_everywhere(llama_file, CorruptSnapshotError, match)


@pytest.mark.parametrize("damage", ["out of range", "negative", "not increasing", "sinks moved"])
@pytest.mark.parametrize("scheme", ["tova-b6-s2", "qfilters-b6-s2-r2"])
def test_eviction_positions_are_checked_after_their_checksum(models, tmp_path, scheme, damage):
    path = _file_of(models, tmp_path, "llama", scheme, n=10, **({"calib_tokens": 4} if "qf" in scheme else {}))
    outer, body = read_raw(path)
    b, t = outer["caches.0.positions"]["data_offsets"]
    pos = np.frombuffer(body[b:t], dtype="<i4").copy().reshape(outer["caches.0.positions"]["shape"])
    if damage == "out of range":
        pos[0, 0, -1] = 10
    elif damage == "negative":
        pos[0, 1, 3] = -5
    elif damage == "not increasing":
        pos[0, 0, 2], pos[0, 0, 3] = pos[0, 0, 3], pos[0, 0, 2]
    else:
        pos[0, 0, 0] = 1
    craft(path, tensors={"caches.0.positions": pos.tobytes()})
    mlxkv.verify(path)  # every checksum holds: only the data rule can tell
    with pytest.raises(CorruptSnapshotError, match="kept positions are not increasing"):
        mlxkv.load(path)


def test_tensors_of_too_many_dimensions_are_refused(models, tmp_path):
    path = _file_of(models, tmp_path, "hybrid", "bf16")
    name = next(n for n in read_raw(path)[0] if n.startswith("caches.0."))

    def deeper(o):
        o[name]["shape"] = [1] * 1003 + o[name]["shape"]

    craft(path, lambda h: deeper({name: h["caches"][0]["tensors"][0]}), deeper)
    refused_everywhere(path, CorruptSnapshotError, "at most 8")


SAVE_1003 = r"""
import mlx.core as mx, mlxkv
c = mlxkv.ArraysCache(1)
c.adopt([mx.zeros([1] * 1003, mx.bfloat16)], 1)
try:
    mlxkv.save(__import__("sys").argv[1], [c], [0])
except mlxkv.SnapshotError as e:
    print("refused:", e)
"""


def test_saving_a_1003_dimensional_state_is_refused_not_an_abort(tmp_path):
    """It aborted the process: numpy's buffer export of >64 dimensions fails inside
    nanobind. The writer now exports one flat dimension and refuses ranks above 8."""
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_1003, str(tmp_path / "s.safetensors")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arrays of 1003 dimensions cannot be stored" in proc.stdout
    assert not os.listdir(tmp_path)


def test_array_bytes_are_exported_flat_whatever_the_rank():
    """numpy gave a 0-d object for 65 dimensions: the writer wrote 8 wrong bytes."""
    a = mx.arange(6, dtype=mx.float16).reshape([1] * 63 + [2, 3])
    assert a.ndim == 65
    assert bytes(array_buffer(a)) == np.arange(6, dtype=np.float16).tobytes()


def test_a_load_that_would_not_fit_in_memory_is_refused_before_allocating(llama_file, monkeypatch):
    monkeypatch.setattr(tensor_reader, "physical_memory", lambda: 1 << 16)
    loads = []
    monkeypatch.setattr(tensor_reader, "_load", lambda *a: loads.append(a))
    with pytest.raises(SnapshotError, match="restoring needs .* bytes of arrays"):
        mlxkv.load(llama_file)
    assert loads == []


# -- 4. a load reads one file, whatever is renamed over the path meanwhile -----------------------


def test_a_snapshot_renamed_over_the_path_mid_load_is_not_mixed_in(models, tmp_path, monkeypatch):
    """The race of concurrent savers, made deterministic: the path is replaced after the
    header was read and before the tensors are."""
    model = models("llama")
    path, other = str(tmp_path / "s.safetensors"), str(tmp_path / "o.safetensors")
    for p, n in ((path, 12), (other, 12)):
        caches = mlxkv.make_cache(model, "bf16")
        run(model, caches, prompt(n, seed=n if p == path else 99))
        mlxkv.save(p, caches, prompt(n, seed=n if p == path else 99))
    want = mlxkv.load(path)
    replace_before_tensors(monkeypatch, other, path)
    got = mlxkv.load(path)
    assert got.tokens == want.tokens
    for a, b in zip(got.caches, want.caches):
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()


# -- 5. no MLX thread outlives a load's Python stream ---------------------------------------------


def test_mlx_has_released_the_stream_when_a_load_returns(llama_file, monkeypatch):
    streams = []
    real_init = tensor_reader._LoadStream.__init__

    def recorded(self, *a, **k):
        real_init(self, *a, **k)
        streams.append(weakref.ref(self))

    monkeypatch.setattr(tensor_reader._LoadStream, "__init__", recorded)
    damaged = llama_file + ".bad"
    data = bytearray(open(llama_file, "rb").read())
    data[-7] ^= 1
    open(damaged, "wb").write(bytes(data))
    for _ in range(100):
        mlxkv.load(llama_file)
        assert streams[-1]() is None
        with pytest.raises(CorruptSnapshotError):
            mlxkv.load(damaged)  # refused after the tensor bytes were read
        assert streams[-1]() is None
    assert len(streams) == 200


# -- 6. temporaries of killed writers are removed -------------------------------------------------


def test_a_save_removes_the_temporaries_of_writers_killed_before(llama_file, monkeypatch):
    directory = os.path.dirname(llama_file)

    left = killed_writers(llama_file, 100)
    assert len(left) == 100 and all(f.startswith(".s.safetensors.mlxkv-tmp.") for f in left)
    snap = mlxkv.load(llama_file)
    monkeypatch.setattr(temporaries, "_scanned", {})  # this process has not listed the directory yet
    mlxkv.save(llama_file, snap.caches, snap.tokens)
    assert [f for f in os.listdir(directory) if temporaries.MARK in f] == []
    # a process lists a directory at most once a minute: the next save within it does not
    assert len(killed_writers(llama_file, 1)) == 1
    mlxkv.save(llama_file, snap.caches, snap.tokens)
    assert len([f for f in os.listdir(directory) if temporaries.MARK in f]) == 1
    monkeypatch.setattr(
        temporaries, "_scanned", {d: t - temporaries.SCAN_INTERVAL for d, t in temporaries._scanned.items()}
    )
    mlxkv.save(llama_file, snap.caches, snap.tokens)
    assert [f for f in os.listdir(directory) if temporaries.MARK in f] == []


def test_a_live_writers_temporary_is_never_removed(tmp_path):
    target = str(tmp_path / "s.safetensors")
    fd, tmp = temporaries.create(target)  # ours: alive and locked
    try:
        assert temporaries.remove_stale(str(tmp_path)) == []
        assert os.path.exists(tmp)
        # a dead pid in the name, but the lock is held (the file went to another process)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        borrowed = os.path.join(str(tmp_path), f".s.safetensors{temporaries.MARK}{dead.pid}.{'ab' * 8}")
        os.link(tmp, borrowed)
        assert temporaries.remove_stale(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert temporaries.remove_stale(str(tmp_path)) == [borrowed]  # dead pid, lock free now
    assert os.path.exists(tmp)  # our pid is alive: never removed


# -- 7. a snapshot loads only into the model that computed it -------------------------------------


def test_a_llama_snapshot_is_refused_by_a_gemma3_of_the_same_geometry(models, llama_file):
    gemma3 = models("gemma3")
    with pytest.raises(IdentityMismatchError, match="computed by another model.*allow_other_model=True"):
        mlxkv.load(llama_file, model=gemma3)
    with pytest.raises(IdentityMismatchError):
        mlxkv.Session.restore(_session_file(models, llama_file), gemma3)
    snap = mlxkv.load(llama_file, model=gemma3, allow_other_model=True)  # deliberate: geometry agrees
    assert snap.tokens == prompt(12)


def _session_file(models, path):
    s = mlxkv.Session.start(models("llama"), prompt(6))
    s.generate(2)
    out = path + ".session"
    s.save(out)
    return out


def test_another_checkpoint_of_the_same_architecture_is_refused(models, llama_file):
    other = build_model("llama", seed=1)
    with pytest.raises(IdentityMismatchError):
        mlxkv.load(llama_file, model=other)
    assert mlxkv.load(llama_file, model=models("llama")).tokens == prompt(12)


def test_save_records_the_identity_derived_from_the_model(models, tmp_path):
    from mlxkv.state.identity import model_fingerprint

    model = models("llama")
    header = mlxkv.read_header(_file_of(models, tmp_path, "llama", "kv4"))
    assert header["modelId"] == "seeded/llama@0"
    assert header["configFingerprint"] == model_fingerprint(model)
    bare = build_model("llama")
    del bare.mlxkv_model_id
    caches = mlxkv.make_cache(bare, "bf16")
    run(bare, caches, prompt(4))
    h = mlxkv.save(str(tmp_path / "b.safetensors"), caches, prompt(4), model=bare)
    assert h["modelId"] == ""  # never the architecture name
    assert h["configFingerprint"] == model_fingerprint(model)  # same config and weights
    unrecorded = mlxkv.save(str(tmp_path / "u.safetensors"), caches, prompt(4))
    assert unrecorded["configFingerprint"] == ""
    assert mlxkv.load(str(tmp_path / "u.safetensors"), model=models("gemma3")).tokens == prompt(4)  # geometry only


def test_the_fingerprint_ignores_fields_a_newer_mlx_lm_adds_at_their_defaults():
    from dataclasses import dataclass, field

    from mlxkv.state.identity import canonical_config

    @dataclass
    class Old:
        model_type: str = "llama"
        hidden_size: int = 128

    @dataclass
    class New(Old):
        sliding_window: int | None = None
        layer_types: list = field(default_factory=list)

    class M:
        def __init__(self, args):
            self.args = args

    assert canonical_config(M(Old(hidden_size=64))) == canonical_config(M(New(hidden_size=64))) == {"hidden_size": 64}
    assert canonical_config(M(New(hidden_size=64, sliding_window=8)))["sliding_window"] == 8
    assert canonical_config({"a": 1, "_name_or_path": "x", "transformers_version": "4"}) == {"a": 1}


# -- 8. convert never overwrites its source --------------------------------------------------------


def test_convert_refuses_to_write_over_its_source(models, tmp_path):
    from mlx_lm.models import cache as mlx_cache

    model = models("llama")
    caches = mlx_cache.make_prompt_cache(model)
    mx.eval(model(mx.array([prompt(6)]), cache=caches))
    src = str(tmp_path / "p.safetensors")
    mlx_cache.save_prompt_cache(src, caches)
    before = open(src, "rb").read()
    link = str(tmp_path / "link.safetensors")
    os.symlink(src, link)
    for dst in (src, link, str(tmp_path / "." / "p.safetensors")):
        with pytest.raises(SnapshotError, match="is the file being converted"):
            mlxkv.convert_prompt_cache(src, dst, tokens=prompt(6))
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", "convert", src, src, "--tokens", ",".join(map(str, prompt(6)))],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 1 and "is the file being converted" in proc.stderr
    assert open(src, "rb").read() == before


def test_a_truncated_tensor_read_is_ours_even_when_the_file_shrinks_mid_load(llama_file, monkeypatch):
    real = tensor_reader.TensorReader.read_all

    def shrink_first(self, *a, **k):
        with open(llama_file, "r+b") as f:
            f.truncate(data_start(llama_file) + 100)
        return real(self, *a, **k)

    monkeypatch.setattr(tensor_reader.TensorReader, "read_all", shrink_first)
    with pytest.raises(CorruptSnapshotError, match="truncated while loading"):
        mlxkv.load(llama_file)
