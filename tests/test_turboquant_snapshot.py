"""TurboQuant snapshots: the persisted kind, bit-exact resume, refusal of inconsistent headers."""

import mlx.core as mx
import numpy as np
import pytest
from generation import greedy, run
from helpers import rewrite_header
from safetensors.numpy import load_file

import mlxkv
from mlxkv import CorruptSnapshotError, TurboQuantKVCache
from mlxkv.caches.masks import ForwardMasks
from mlxkv.caches.schemes import make_cache
from mlxkv.codecs.base import check_entry
from mlxkv.io.tensor_reader import TensorReader
from mlxkv.math import turboquant as tq
from mlxkv.models.seeded import prompt

SLOTS = ["kIdx", "kScales", "kZeros", "vPacked", "vScales"]


def turbo(model, kb, vb):
    masks = ForwardMasks()
    caches = [TurboQuantKVCache(kb, vb) for _ in model.layers]
    for c in caches:
        c.masks = masks
    return caches


def resume_matches(model, caches, tokens, path, steps=3):
    """Save, load, and continue both: logits bit-identical to never having stopped."""
    header = mlxkv.save(path, caches, tokens, model_id=model.mlxkv_model_id)
    snap = mlxkv.load(path, model=model, model_id=model.mlxkv_model_id)
    assert snap.tokens == tokens
    ta, la = greedy(model, caches, tokens[-1], steps)
    tb, lb = greedy(model, snap.caches, tokens[-1], steps)
    assert ta == tb and all(mx.array_equal(x, y) for x, y in zip(la, lb))
    assert [c.kind for c in caches] == [c.kind for c in snap.caches]
    assert [c.minimum_reusable_offset for c in caches] == [c.minimum_reusable_offset for c in snap.caches]
    return header, snap


@pytest.mark.parametrize("kb", tq.K_BITS)
@pytest.mark.parametrize("vb", tq.V_BITS)
def test_save_load_continue_is_bit_identical(models, tmp_path, kb, vb):
    model = models("llama")  # 2 kv heads, head_dim 64
    caches, tokens = turbo(model, kb, vb), prompt(6)
    run(model, caches, tokens)
    header, snap = resume_matches(model, caches, tokens, str(tmp_path / "t.safetensors"), steps=2)
    entry = header["caches"][0]
    assert entry["kind"] == "turboquant"
    assert (entry["offset"], entry["kBits"], entry["vBits"], entry["headDim"]) == (6, kb, vb, 64)
    assert [t["slot"] for t in entry["tensors"]] == SLOTS
    kdt = "I8" if kb == 8 else "U8"
    kw = 64 if kb == 8 else 64 * kb // 8
    assert [(t["dtype"], t["shape"]) for t in entry["tensors"]] == [
        (kdt, [1, 2, 6, kw]),
        ("F16", [1, 2, 6, 2]),
        ("F16", [1, 2, 6, 2]),
        ("U8", [1, 2, 6, 64 * vb // 8]),
        ("F16", [1, 2, 6, 2]),
    ]


def test_the_file_is_plain_safetensors_with_the_stored_bytes(models, tmp_path):
    model = models("llama")
    caches, tokens = turbo(model, 8, 3), prompt(5)
    run(model, caches, tokens)
    path = str(tmp_path / "t.safetensors")
    mlxkv.save(path, caches, tokens)
    raw = load_file(path)
    for slot, a in zip(SLOTS, caches[2].state):
        assert raw[f"caches.2.{slot}"].tobytes() == np.array(a).tobytes()
    assert raw["caches.2.kIdx"].dtype == np.int8 and raw["caches.2.vScales"].dtype == np.float16


def test_bf16_first_saved_before_its_conversion_converts_at_the_same_position(models, tmp_path):
    model = models("llama")
    caches, tokens = make_cache(model, "turbo-k4v2-start16"), prompt(12)
    run(model, caches, tokens)
    assert caches[0].kind == "kv:plain"
    path = str(tmp_path / "b.safetensors")
    header, snap = resume_matches(model, caches, tokens, path, steps=6)
    entry = header["caches"][0]
    assert entry["kind"] == "kv" and entry["pendingConversion"] == {"scheme": "turbo-k4v2", "start": 16}
    assert snap.caches[0].kind == caches[0].kind == "kv:turboquant:4:2"
    assert snap.caches[0].offset == 18 and snap.caches[0].minimum_reusable_offset == 16


def test_a_snapshot_right_after_the_prefill_is_compact(models, tmp_path):
    """mlx-bun's timing: turbo-k8v3 (start 0) converts at the end of the prefill, so the file
    holds TurboQuant codes, not the bf16 prompt."""
    model = models("llama")
    caches, tokens = make_cache(model, "turbo-k8v3"), prompt(9)
    run(model, caches, tokens)
    header, snap = resume_matches(model, caches, tokens, str(tmp_path / "c.safetensors"), steps=3)
    entry = header["caches"][0]
    assert entry["kind"] == "turboquant" and "pendingConversion" not in entry


def test_bf16_first_saved_after_its_conversion(models, tmp_path):
    model = models("llama")
    caches, tokens = make_cache(model, "turbo-k4v2-start16"), prompt(20)
    run(model, caches, tokens[:18])
    run(model, caches, tokens[18:])  # converts at 18
    assert caches[0].kind == "kv:turboquant:4:2" and caches[0].minimum_reusable_offset == 18
    header, snap = resume_matches(model, caches, tokens, str(tmp_path / "a.safetensors"))
    entry = header["caches"][0]
    assert entry["kind"] == "turboquant" and entry["minimumReusableOffset"] == 18
    assert "pendingConversion" not in entry
    assert isinstance(snap.caches[0], TurboQuantKVCache) and snap.caches[0].minimum_reusable_offset == 18


# -- refusals -----------------------------------------------------------------------------


@pytest.fixture
def saved(models, tmp_path):
    model = models("llama")
    caches, tokens = turbo(model, 8, 3), prompt(5)
    run(model, caches, tokens)
    path = str(tmp_path / "r.safetensors")
    mlxkv.save(path, caches, tokens)
    return path


@pytest.fixture
def no_tensor_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a tensor was read before the header was refused")

    monkeypatch.setattr(TensorReader, "read_all", refuse)


def edit_entry(path, **changes):
    def edit(header):
        entry = header["caches"][1]
        for key, value in changes.items():
            if value is None:
                del entry[key]
            else:
                entry[key] = value

    rewrite_header(path, edit)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"headDim": None}, "headDim"),
        ({"vBits": 2}, "vPacked is 24 wide"),  # packed width inconsistent with vBits
        ({"vBits": 5}, "vPacked is 24 wide"),
        ({"headDim": 128}, "kIdx is 64 wide"),  # widths inconsistent with headDim
        ({"kBits": 4}, "kIdx is 64 wide"),
        ({"kBits": 3}, r"kBits must be one of \(2, 4, 5, 8\)"),
        ({"headDim": 96}, r"head_dim in \(64, 128, 256, 512\)"),
        ({"offset": 4}, "offset is 4"),
    ],
)
def test_inconsistent_headers_are_refused_before_any_tensor_is_read(saved, no_tensor_reads, changes, message):
    edit_entry(saved, **changes)
    with pytest.raises(CorruptSnapshotError, match=message):
        mlxkv.load(saved)
    with pytest.raises(CorruptSnapshotError, match=message):
        mlxkv.read_header(saved)


def test_a_slot_of_the_wrong_dtype_is_refused(saved):
    """The file's own dtype table must agree with the slot (the snapshot layer checks that the
    header and the file agree; the codec checks that both are what the slot stores)."""

    entry = mlxkv.read_header(saved)["caches"][1]
    shapes = {t["slot"]: t["shape"] for t in entry["tensors"]}
    check_entry(entry, shapes)  # as written: accepted
    entry["tensors"][0]["dtype"] = "U8"
    with pytest.raises(CorruptSnapshotError, match="kIdx has dtype U8, expected I8"):
        check_entry(entry, shapes)
    entry["tensors"][0]["dtype"] = "I8"
    shapes["vScales"] = [1, 2, 5, 2, 1]
    with pytest.raises(CorruptSnapshotError, match="rank 5"):
        check_entry(entry, shapes)
