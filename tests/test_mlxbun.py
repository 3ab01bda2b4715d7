"""mlx-bun's cache files (docs/mlx-bun.md): the fixtures built byte for byte from the notes,
mlxkv's reader and writer against them, round trips, refusals, the command line."""

import base64
import filecmp
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from generation import run

import mlxkv
from mlxkv import errors
from mlxkv.caches.codes_window import CodesWindow
from mlxkv.cli import main as cli
from mlxkv.formats.mlxbun import MlxBunSnapshot, save_mlx_bun
from mlxkv.io import mlxbun as container
from mlxkv.state.generation_key import generation_key
from mlxkv.state.identity import Identity

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
BUN = ROOT / "mlx-bun"
MANIFEST = json.loads((BUN / "manifest.json").read_text())
FIXTURES = MANIFEST["fixtures"]
MAIN = json.loads((ROOT / "manifest.json").read_text())
BF16_STEP = 2.0**-7


@functools.cache
def generator():
    spec = importlib.util.spec_from_file_location("mlxkv_mlx_bun_generator", BUN / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def source(name: str):
    """The generator's spec (its live caches) for fixture ``name``."""
    return next(s for s in generator().specs() if s.name == name)


def _want(a: dict) -> np.ndarray:
    if a["dtype"] == "i32":
        return np.array(a["values"], np.int64).reshape(a["shape"])
    return np.frombuffer(base64.b64decode(a["base64"]), "<f4").reshape(a["shape"])


def _f32(a) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.float32))


def _bits(a: mx.array) -> bytes:
    return bytes(container.array_buffer(a))


def _stored(kind: str, c) -> list:
    """The arrays a restored cache holds, as stored (plain KV without its slack rows)."""
    if kind == "kv":
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return generator().persisted(kind, c)


def _save_like(spec, path, **kw):
    return save_mlx_bun(
        str(path),
        [layer.cache for layer in spec.layers],
        spec.tokens,
        identity=Identity.from_header(spec.identity),
        generation_checkpoint=spec.checkpoint,
        attachments=spec.attachments,
        created_at=MANIFEST["createdAtMs"],
        layout="blocks" if spec.blocks else "whole",
        block_bytes=MANIFEST["blockBytes"],
        fsync=False,
        **kw,
    )


# -- the fixtures -------------------------------------------------------------------------------


def test_generator_rewrites_the_committed_files_byte_for_byte(tmp_path):
    generator().generate(str(tmp_path), log=lambda *a: None)
    assert generator().compare(str(BUN), str(tmp_path)) == [], "run `python fixtures/mlx-bun/generate.py`, commit"


def test_fixtures_cover_every_mlx_bun_kind_and_version():
    kinds = {layer["kind"] for f in FIXTURES for layer in f["layers"]}
    assert kinds == {"kv", "qkv", "rotating", "rotating-qkv", "ssm", "turboquant"}
    assert {f["formatVersion"] for f in FIXTURES} == {3, 4, 5}
    rings = [
        (e["idx"], e["offset"], t["shape"][2])
        for f in FIXTURES
        for e in f["header"]["caches"]
        if e["kind"] == "rotating"
        for t in e["tensors"][:1]
    ]
    assert any(idx < rows for idx, _, rows in rings), "a wrapped ring"
    assert any(off < rows for _, off, rows in rings), "a ring with its unwritten tail"
    sizes = [
        (e["maxSize"], t["shape"][2])
        for f in FIXTURES
        for e in f["header"]["caches"]
        if "maxSize" in e
        for t in e["tensors"][:1]
    ]
    assert any(rows > size for size, rows in sizes), "a ring holding more rows than its window"
    floors = [
        ("minimumReusableOffset" in e) for f in FIXTURES for e in f["header"]["caches"] if e["kind"] == "turboquant"
    ]
    assert set(floors) == {True, False}
    offs = [s["off"] for f in FIXTURES for a in f["attachments"] for s in a["tensors"]]
    assert any(o % container.ALIGN for o in offs), "an unaligned attachment tensor"


def test_mlx_bun_fixtures_stay_small():
    total = sum(p.stat().st_size for p in BUN.rglob("*") if p.is_file())
    assert total < 1_800_000, f"fixtures/mlx-bun takes {total} bytes (mostly 16 KiB alignment zeros)"


@pytest.mark.parametrize("fx", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_container_matches_the_manifest(fx):
    data = (BUN / fx["file"]).read_bytes()
    assert len(data) == fx["bytes"] and hashlib.sha256(data).hexdigest() == fx["sha256"]
    f = container.read_mlx_bun(str(BUN / fx["file"]))
    assert f.header == fx["header"] and f.version == fx["formatVersion"]
    assert (f.header_len, f.data_start, container.hex16(f.header_hash)) == (
        fx["headerLength"],
        fx["dataStart"],
        fx["headerHash"],
    )
    for group, layer in zip(f.caches, fx["layers"]):
        for s, want in zip(group, layer["slots"]):
            assert (s.info.dtype, s.code, s.info.shape, s.off, s.hash) == (
                want["dtype"],
                want["dtypeCode"],
                want["shape"],
                want["off"],
                want["hash"],
            )


@pytest.mark.parametrize("fx", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_loads_to_the_manifest_values_and_the_source_caches(fx):
    path = str(BUN / fx["file"])
    header = mlxkv.read_header(path)
    assert header["codecProvider"] == "mlx-bun" and header["formatVersion"] == fx["formatVersion"]
    assert header["tokens"] == fx["header"]["tokens"]
    for entry, layer in zip(header["caches"], fx["layers"]):
        assert {k: v for k, v in entry.items() if k != "tensors"} == layer["mlxkv"]
        assert [t["shape"] for t in entry["tensors"]] == [s["mlxkvShape"] for s in layer["slots"]]
    snap = mlxkv.load(path)
    assert isinstance(snap, MlxBunSnapshot) and snap.source == fx["header"]
    spec = source(fx["name"])
    assert len(snap.caches) == len(fx["layers"]) == len(spec.layers)
    for i, (cache, layer, src) in enumerate(zip(snap.caches, fx["layers"], spec.layers)):
        kind, want, where = layer["kind"], layer["decoded"], f"{fx['name']} layer {i}"
        assert cache.offset == layer["mlxkv"]["offset"], where
        assert cache.minimum_reusable_offset == layer["mlxkv"]["minimumReusableOffset"], where
        # exactly the source cache's stored arrays, bit for bit (rings as laid out, tail included)
        for got, exp in zip(_stored(kind, cache), _stored(kind, src.cache)):
            assert got.dtype == exp.dtype and got.shape == exp.shape and _bits(got) == _bits(exp), where
        if kind == "ssm":
            for slot, a in want.items():
                np.testing.assert_array_equal(_f32(cache.cache[int(slot)]), _want(a), err_msg=where)
            continue
        keys, values = cache.dense_window()
        if kind in ("rotating", "rotating-qkv"):
            keys, values = cache._temporal_order(keys), cache._temporal_order(values)
        for got, name in ((keys, "keys"), (values, "values")):
            w = _want(want[name])
            if kind in ("kv", "rotating"):
                np.testing.assert_array_equal(_f32(got), w, err_msg=where)
            else:  # a live read decodes to bf16
                finite = ~np.isnan(w)
                scale = np.abs(w[finite]).max()
                np.testing.assert_allclose(_f32(got)[finite], w[finite], rtol=BF16_STEP, atol=BF16_STEP * scale)
    for att, want in zip(snap.attachments, fx["attachments"]):
        assert (att["schema"], att["metadata"]) == (want["schema"], want["metadata"])
        for t, w in zip(att["tensors"], want["tensors"]):
            np.testing.assert_array_equal(_f32(t) if w["values"]["dtype"] == "f32" else np.array(t), _want(w["values"]))


@pytest.mark.parametrize("fx", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_verifies(fx):
    assert mlxkv.verify(str(BUN / fx["file"]))["tokens"] == fx["header"]["tokens"]


@pytest.mark.parametrize(
    "fx",
    [f for f in FIXTURES if f["name"] != "turboquant-nofloor-v3"],
    ids=[f["name"] for f in FIXTURES if f["name"] != "turboquant-nofloor-v3"],
)
def test_mlxkv_writes_the_same_bytes_from_the_same_caches(fx, tmp_path):
    spec = source(fx["name"])
    out = tmp_path / fx["file"]
    if spec.blocks:
        _save_like(spec, out)
    else:
        mlxkv.save(
            str(out),
            [layer.cache for layer in spec.layers],
            spec.tokens,
            format="mlx-bun",
            model_id=spec.identity.get("modelId", ""),
            config_fingerprint=spec.identity.get("configFingerprint"),
            tokenizer_hash=spec.identity.get("tokenizerHash"),
            ns=spec.identity.get("ns"),
            generation_checkpoint=spec.checkpoint,
            attachments=spec.attachments,
            created_at=MANIFEST["createdAtMs"],
            fsync=False,
        )
    assert filecmp.cmp(out, BUN / fx["file"], shallow=False)
    for digest in fx["blocks"]:
        assert (tmp_path / "blocks" / digest).read_bytes() == (BUN / "blocks" / digest).read_bytes()
    if fx["blocks"]:
        assert sorted(os.listdir(tmp_path / "blocks")) == sorted(fx["blocks"])


def test_an_old_turboquant_file_gains_only_its_implied_floor_when_rewritten(tmp_path):
    fx = next(f for f in FIXTURES if f["name"] == "turboquant-nofloor-v3")
    snap = mlxkv.load(str(BUN / fx["file"]))
    assert [c.minimum_reusable_offset for c in snap.caches] == [c.offset for c in snap.caches] == [7]
    h = fx["header"]
    written = mlxkv.save(
        str(tmp_path / "x.mlxkv"),
        snap.caches,
        snap.tokens,
        format="mlx-bun",
        created_at=h["createdAt"],
        model_id=h["modelId"],
        config_fingerprint=h["configFingerprint"],
        tokenizer_hash=h["tokenizerHash"],
        ns=h["ns"],
        fsync=False,
    )
    want = json.loads(json.dumps(h))
    want["caches"][0]["minimumReusableOffset"] = 7
    assert written.pop("codecProvider") == "mlx-cache-v3"
    assert written == want


def test_loaded_files_rewrite_byte_for_byte(tmp_path):
    """load -> save(format="mlx-bun") keeps everything, the unwritten ring tail included."""
    for fx in FIXTURES:
        if fx["name"] == "turboquant-nofloor-v3" or fx["formatVersion"] == 5:
            continue
        snap = mlxkv.load(str(BUN / fx["file"]))
        h = snap.source
        out = tmp_path / fx["file"]
        mlxkv.save(
            str(out),
            snap.caches,
            snap.tokens,
            format="mlx-bun",
            created_at=h["createdAt"],
            model_id=h["modelId"],
            config_fingerprint=h["configFingerprint"],
            tokenizer_hash=h["tokenizerHash"],
            ns=h["ns"],
            generation_checkpoint=h.get("generationCheckpoint"),
            attachments=snap.attachments,
            fsync=False,
        )
        assert filecmp.cmp(out, BUN / fx["file"], shallow=False), fx["name"]


@pytest.mark.parametrize("bad", MANIFEST["broken"], ids=[b["name"] for b in MANIFEST["broken"]])
def test_broken_file_is_refused(bad):
    error = getattr(errors, bad["error"])
    assert issubclass(error, errors.SnapshotError)
    with pytest.raises(error, match=re.escape(bad["message"])) as e:
        mlxkv.load(str(BUN / bad["file"]))
    assert "mlx-bun" in str(e.value)
    if bad["reason"] not in ("tensor-checksum",):  # found without reading a tensor
        with pytest.raises(error, match=re.escape(bad["message"])):
            mlxkv.read_header(str(BUN / bad["file"])) if "block" not in bad["name"] else mlxkv.verify(
                str(BUN / bad["file"])
            )
    with pytest.raises(error):
        mlxkv.verify(str(BUN / bad["file"]))


def test_unknown_kinds_are_also_unknown_kind_errors():
    with pytest.raises(errors.UnknownKindError, match="paged"):
        mlxkv.read_header(str(BUN / "broken" / "paged-kind.mlxkv"))


def test_a_v1_file_is_refused_naming_mlx_bun(tmp_path):
    p = tmp_path / "old.mlxkv"
    p.write_bytes(b"MLXBUNKV1\n" + struct.pack("<I", 2) + b"{}")
    with pytest.raises(errors.FormatVersionError, match="mlx-bun v1 cache file"):
        mlxkv.load(str(p))


def test_overlapping_tensors_are_refused(tmp_path):
    data = (BUN / "kv-v3.mlxkv").read_bytes()
    bad = generator()._rehash(data, generator()._set(["caches", 0, "tensors", 1, "off"], 1024))
    (tmp_path / "x.mlxkv").write_bytes(bad)
    with pytest.raises(errors.CorruptSnapshotError, match="overlap"):
        mlxkv.read_header(str(tmp_path / "x.mlxkv"))


def test_an_invalid_floor_is_refused(tmp_path):
    data = (BUN / "turboquant-v3.mlxkv").read_bytes()
    bad = generator()._rehash(data, generator()._set(["caches", 0, "minimumReusableOffset"], 8))
    (tmp_path / "x.mlxkv").write_bytes(bad)
    with pytest.raises(errors.CorruptSnapshotError, match="invalid cache minimum reusable offset"):
        mlxkv.load(str(tmp_path / "x.mlxkv"))


def test_load_checks_identity_and_geometry_like_mlxkv_files(models):
    path = str(BUN / "kv-v3.mlxkv")
    assert mlxkv.load(path, model_id="mlx-community/seeded-test", ns="").tokens
    with pytest.raises(errors.IdentityMismatchError, match="modelId"):
        mlxkv.load(path, model_id="another-model")
    with pytest.raises(errors.IdentityMismatchError, match="computed by another model"):
        mlxkv.load(path, model=models("llama"))  # the file records mlx-bun's own fingerprint
    with pytest.raises(errors.GeometryMismatchError):
        mlxkv.load(path, model=models("llama"), allow_other_model=True)


# -- mlxkv snapshots -> mlx-bun -> mlxkv ----------------------------------------------------------

WRITABLE = {"kv", "qkv", "rotating", "rotating-qkv", "ssm", "turboquant"}


def _round_trippable(fx) -> bool:
    h = fx["header"]
    return (
        set(fx["kinds"]) <= WRITABLE
        and not any("pendingConversion" in e for e in h["caches"])
        and all(e.get("keep", 0) == 0 for e in h["caches"])
        and all(e.get("size", 2) == 2 for e in h["caches"])
    )


ROUND = [f for f in MAIN["fixtures"] if _round_trippable(f)]
REFUSED = [f for f in MAIN["fixtures"] if not _round_trippable(f)]


def test_which_mlxkv_fixtures_can_go_to_mlx_bun_whole():
    # the hybrid model's recurrent layers are lfm2's single conv state: mlx-bun's ssm is
    # [conv, recurrent], so those files go layer by layer (below)
    assert len(ROUND) >= 5
    assert {k for f in ROUND for k in f["kinds"]} == {"kv", "qkv", "rotating", "turboquant"}


def _writable_layer(entry) -> bool:
    return (
        entry["kind"] in WRITABLE
        and "pendingConversion" not in entry
        and entry.get("keep", 0) == 0
        and entry.get("size", 2) == 2
    )


LAYERED = [f for f in MAIN["fixtures"] if any(_writable_layer(e) for e in f["header"]["caches"])]


def _refs(ts):
    return [{k: t[k] for k in ("slot", "dtype", "shape", "crc32")} for t in ts]


@pytest.mark.parametrize("fx", LAYERED, ids=[f["name"] for f in LAYERED])
def test_every_layer_mlx_bun_can_hold_goes_there_and_back_exactly(fx, tmp_path):
    snap = mlxkv.load(str(ROOT / fx["file"]))
    keep = [i for i, e in enumerate(fx["header"]["caches"]) if _writable_layer(e)]
    caches = [snap.caches[i] for i in keep]
    mlxkv.save(str(tmp_path / "x.mlxkv"), caches, snap.tokens, format="mlx-bun", fsync=False)
    back = mlxkv.load(str(tmp_path / "x.mlxkv"))
    mlxkv.save(str(tmp_path / "y.safetensors"), back.caches, back.tokens, fsync=False)
    got = mlxkv.read_header(str(tmp_path / "y.safetensors"))["caches"]
    for j, i in enumerate(keep):
        want = fx["header"]["caches"][i]
        assert {k: v for k, v in got[j].items() if k != "tensors"} == {k: v for k, v in want.items() if k != "tensors"}
        assert _refs(got[j]["tensors"]) == _refs(want["tensors"]), f"{fx['name']} layer {i}"


@pytest.mark.parametrize("fx", ROUND, ids=[f["name"] for f in ROUND])
def test_mlxkv_to_mlx_bun_to_mlxkv_is_byte_identical(fx, tmp_path):
    src = ROOT / fx["file"]
    bun, back = tmp_path / "x.mlxkv", tmp_path / "back.safetensors"
    mlxkv.formats.table.convert(str(src), str(bun), to="mlx-bun")
    mlxkv.verify(str(bun))
    mlxkv.formats.table.convert(str(bun), str(back), to="mlxkv")
    if filecmp.cmp(src, back, shallow=False):
        return
    # JSON.stringify has one number type: a checkpoint's 0.0 comes back as 0 (and equal to it);
    # nothing else may differ
    (a, text_a), (b, text_b) = _mlxkv_string(src), _mlxkv_string(back)
    assert a == b  # every tensor byte
    ints = json.loads(text_a, parse_float=lambda x: int(float(x)) if float(x).is_integer() else float(x))
    assert json.dumps(ints, separators=(",", ":")) == text_b


def _mlxkv_string(path):
    """(the data section, the mlxkv header string) of an mlxkv snapshot."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 + n :], json.loads(data[8 : 8 + n])["__metadata__"]["mlxkv"]


@pytest.mark.parametrize("fx", REFUSED, ids=[f["name"] for f in REFUSED])
def test_what_mlx_bun_cannot_hold_is_refused_before_writing(fx, tmp_path):
    out = tmp_path / "x.mlxkv"
    with pytest.raises(errors.UnsupportedKindError, match="nothing was written") as e:
        mlxkv.formats.table.convert(str(ROOT / fx["file"]), str(out), to="mlx-bun")
    assert isinstance(e.value, errors.SnapshotError) and not out.exists() and os.listdir(tmp_path) == []


# -- live caches ------------------------------------------------------------------------------------


def _continue(caches, steps=3, start=50):
    g = generator()
    outs = []
    for t in range(start, start + steps):
        for c in caches:
            if c.kind == "ssm":
                continue
            k, v = c.update_and_fetch(g.ramp(t, 1), g.ramp(t, 1, phase=1.0))
            outs.append((k, v))
    return outs


@pytest.mark.parametrize(
    "name",
    [
        "kv-v3",
        "qkv-v3",
        "rotating-v3",
        "rotating-wrapped-v3",
        "rotating-qkv-wrapped-v3",
        "rotating-prompt-v3",
        "rotating-chunk-v3",
        "turboquant-v3",
    ],
)
def test_restored_caches_continue_exactly_like_the_source(name, tmp_path):
    """mlx-bun's own persistence test: append more tokens to the source and to the restored
    copy; what they return is identical."""
    restored = mlxkv.load(str(BUN / f"{name}.mlxkv")).caches
    fresh = generator().specs()
    src = [layer.cache for layer in next(s for s in fresh if s.name == name).layers]
    arrays = lambda x: x.stored if isinstance(x, CodesWindow) else x if isinstance(x, tuple) else (x,)
    for (ka, va), (kb, vb) in zip(_continue(src), _continue(restored)):
        for a, b in ((ka, kb), (va, vb)):
            assert all(_bits(x) == _bits(y) for x, y in zip(arrays(a), arrays(b), strict=True))


def _mlx_lm_ring(max_size: int, prompt: int, steps: int, chunk: int = 0):
    """mlx-lm's own RotatingKVCache fed what the generator feeds its source ring."""
    from mlx_lm.models.cache import RotatingKVCache as MlxLmRing

    return generator().feed(MlxLmRing(max_size), prompt, steps, chunk)


@pytest.mark.parametrize(
    "name, feed",
    [("rotating-prompt-v3", (9, 0)), ("rotating-chunk-v3", (5, 5, 3)), ("rotating-wrapped-v3", (5, 5))],
)
def test_a_ring_past_its_window_continues_as_mlx_lms_own_ring(name, feed, tmp_path):
    """A ring that holds more rows than its window (``maxSize - 1 + S`` after an ``S``-token
    append, ``S`` after a first one) is the file mlx-lm's RotatingKVCache and mlx-bun's leave:
    the file holds mlx-lm's ring bit for bit, and the restored ring continues it exactly
    (single tokens through the trim and the wrap, and another multi-token append), with the
    same masks; written back as mlx-bun's it is the same file."""
    path = BUN / f"{name}.mlxkv"
    restored = mlxkv.load(str(path)).caches[0]
    theirs = _mlx_lm_ring(8, *feed)
    assert restored._rows() == theirs.keys.shape[2] and (restored.offset, restored._idx) == (theirs.offset, theirs._idx)
    assert _bits(restored.keys) == _bits(theirs.keys) and _bits(restored.values) == _bits(theirs.values)
    mlxkv.save(
        str(tmp_path / "again.mlxkv"),
        [restored],
        mlxkv.read_header(str(path))["tokens"],
        format="mlx-bun",
        created_at=MANIFEST["createdAtMs"],
        fsync=False,
    )
    g, t = generator(), 40
    for n in (1, 1, 4, 1, 1, 9, 1):
        for window in (None, 4):
            assert _mask_bits(restored.make_mask(n, window)) == _mask_bits(theirs.make_mask(n, window)), (n, window)
        ours = restored.update_and_fetch(g.ramp(t, n), g.ramp(t, n, phase=1.0))
        want = theirs.update_and_fetch(g.ramp(t, n), g.ramp(t, n, phase=1.0))
        assert [_bits(a) for a in ours] == [_bits(a) for a in want], (name, t, n)
        assert (restored.offset, restored._idx, restored._rows()) == (theirs.offset, theirs._idx, theirs.keys.shape[2])
        t += n


def _mask_bits(m):
    return m if m is None or isinstance(m, str) else (m.dtype, m.shape, _bits(m))


@pytest.mark.parametrize("fmt", ["mlx-bun", "mlxkv"])
def test_a_gemma3_cache_after_a_long_prompt_is_saved_whole_and_continues_exactly(fmt, tmp_path):
    """The seeded gemma3 after a 40-token prompt (its window is 32, so its rings hold 40 rows):
    mlx-lm's own caches, saved by mlx-lm and converted, and mlxkv's own caches, saved, both in
    each format; every restored set gives mlx-lm's own logits, bit for bit, as all continue."""
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    from mlxkv.models.seeded import build_model, prompt

    model = build_model("gemma3")
    theirs, mine, tokens = make_prompt_cache(model), mlxkv.make_cache(model, "bf16"), prompt(40)
    model(mx.array([tokens]), cache=theirs)
    model(mx.array([tokens]), cache=mine)
    assert {c.keys.shape[2] for c in theirs if type(c).__name__ == "RotatingKVCache"} == {40}
    save_prompt_cache(str(tmp_path / "p.safetensors"), theirs)
    converted, saved = tmp_path / f"converted.{fmt}", tmp_path / f"saved.{fmt}"
    mlxkv.convert_prompt_cache(str(tmp_path / "p.safetensors"), str(converted), tokens=tokens, format=fmt)
    mlxkv.save(str(saved), mine, tokens, model=model, format=fmt, fsync=False)
    restored = []
    for path in (converted, saved):
        rings = [e for e in mlxkv.read_header(str(path))["caches"] if e["kind"] == "rotating"]
        assert rings and all(e["tensors"][0]["shape"][2] == 40 > e["maxSize"] for e in rings)
        restored.append(mlxkv.load(str(path), model).caches)
    step = mx.array([tokens[-5:]])
    for x in (step[:, :1], step[:, 1:2], step, step[:, :1]):
        want = _bits(model(x, cache=theirs))
        assert all(_bits(model(x, cache=caches)) == want for caches in restored)


def test_via_an_mlxkv_snapshot_a_ring_loses_only_its_unwritten_tail(tmp_path):
    spec = source("rotating-v3")
    snap = mlxkv.load(str(BUN / "rotating-v3.mlxkv"))
    mlxkv.save(str(tmp_path / "r.safetensors"), snap.caches, snap.tokens, fsync=False)
    again = mlxkv.load(str(tmp_path / "r.safetensors")).caches[0]
    assert again._rows() == again.offset == 6 < spec.layers[0].cache._rows() == 8
    mlxkv.save(str(tmp_path / "r.mlxkv"), [again], snap.tokens, format="mlx-bun", fsync=False)
    back = mlxkv.load(str(tmp_path / "r.mlxkv")).caches[0]
    src = generator().specs()[2].layers[0].cache
    for (ka, va), (kb, vb) in zip(_continue([src], 4), _continue([back], 4)):  # regrows, wraps identically
        assert _bits(ka) == _bits(kb) and _bits(va) == _bits(vb)


def test_empty_or_inconsistent_caches_are_refused(tmp_path):
    from mlxkv.caches.plain import KVCache

    with pytest.raises(errors.EmptyCacheError, match="holds no tokens"):
        mlxkv.save(str(tmp_path / "x.mlxkv"), [KVCache()], [], format="mlx-bun")
    c = source("kv-v3").layers[0].cache
    with pytest.raises(errors.SnapshotError, match="offset 7 but 3 tokens"):
        mlxkv.save(str(tmp_path / "x.mlxkv"), [c], [1, 2, 3], format="mlx-bun")
    with pytest.raises(errors.SnapshotError, match="unknown snapshot format"):
        mlxkv.save(str(tmp_path / "x.mlxkv"), [c], list(range(7)), format="gguf")
    assert os.listdir(tmp_path) == []


def test_a_pending_conversion_is_refused(tmp_path, models):
    caches = mlxkv.make_cache(models("llama"), "kv4-start32")
    run(models("llama"), caches, list(range(1, 6)))
    with pytest.raises(errors.UnsupportedKindError, match="pending conversion"):
        mlxkv.save(str(tmp_path / "x.mlxkv"), caches, list(range(1, 6)), format="mlx-bun")


# -- the container and its JSON ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "js"),
    [
        (0.5, "0.5"),
        (1.0, "1"),
        (-0.0, "0"),
        (123.456, "123.456"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (2.5e25, "2.5e+25"),
        (1e-7, "1e-7"),
        (1.5e-7, "1.5e-7"),
        (0.000001, "0.000001"),
        (-2.5, "-2.5"),
        (float("nan"), "null"),
        (float("inf"), "null"),
        (1 / 3, "0.3333333333333333"),
        (2**60, "1152921504606847000"),
        (2.0**60, "1152921504606847000"),  # JS: a double's shortest digits
    ],
)
def test_numbers_are_written_as_json_stringify_writes_them(value, js):
    assert container.js_json(value) == js


def test_strings_are_written_as_json_stringify_writes_them():
    assert container.js_json({"a": 'q"\\\n\x01é€😀', "b": [True, None]}) == (
        '{"a":"q\\"\\\\\\n\\u0001é€😀","b":[true,null]}'
    )


def test_block_spans_never_cross_a_plane():
    spans = container.block_spans([1, 2, 7, 64], 2, 512)
    assert spans[:3] == [(0, 256), (256, 192), (448, 256)] and sum(n for _, n in spans) == 2 * 7 * 64
    assert container.block_spans([], 4, 512) == [(0, 1)]
    assert container.block_spans([0, 3], 4, 512) == []


def test_blocks_are_shared_between_files_and_a_write_is_atomic(tmp_path):
    spec = source("blocks-v5")
    _save_like(spec, tmp_path / "a.mlxkv")
    n = len(os.listdir(tmp_path / "blocks"))
    _save_like(
        spec,
        tmp_path / "b.mlxkv",
    )
    assert len(os.listdir(tmp_path / "blocks")) == n  # content-addressed: nothing new
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".tmp")) == []
    shutil.rmtree(tmp_path / "blocks")
    with pytest.raises(errors.CorruptSnapshotError, match="cannot be read"):
        mlxkv.load(str(tmp_path / "a.mlxkv"))


# -- the command line ---------------------------------------------------------------------------------


def test_cli_inspect_and_verify(capsys):
    assert cli(["inspect", str(BUN / "attachments-v4.mlxkv")]) == 0
    out = capsys.readouterr().out
    assert "mlx-bun format v4" in out and "drafter-state-v1" in out and "keys:BF16[1, 2, 7, 64]@0" in out
    assert cli(["inspect", str(BUN / "turboquant-nofloor-v3.mlxkv")]) == 0
    assert "7 (absent)" in capsys.readouterr().out
    assert cli(["verify", str(BUN / "blocks-v5.mlxkv")]) == 0
    assert "ok:" in capsys.readouterr().out
    assert cli(["verify", str(BUN / "broken" / "tensor-bitflip.mlxkv")]) == 1
    assert "tensor hash mismatch" in capsys.readouterr().err


def test_cli_convert_both_ways(tmp_path, capsys):
    st, bun = tmp_path / "kv.safetensors", tmp_path / "kv.mlxkv"
    assert cli(["convert", str(BUN / "ssm-v3.mlxkv"), str(st)]) == 0
    snap = mlxkv.load(str(st))
    assert snap.header["ns"] == "lora-a" and [c.kind for c in snap.caches] == ["kv:plain", "ssm"]
    assert cli(["convert", str(st), str(bun), "--to", "mlx-bun", "--model-id", "other"]) == 0
    assert mlxkv.read_header(str(bun))["modelId"] == "other"
    assert cli(["convert", str(BUN / "attachments-v4.mlxkv"), str(tmp_path / "a.safetensors")]) == 1
    assert "attachments" in capsys.readouterr().err
    assert (
        cli(
            [
                "convert",
                str(ROOT / "valid" / "tova-b6-s2-llama.safetensors"),
                str(tmp_path / "t.mlxkv"),
                "--to",
                "mlx-bun",
            ]
        )
        == 1
    )
    assert "mlx-bun has no codec" in capsys.readouterr().err
    assert not (tmp_path / "t.mlxkv").exists() and not (tmp_path / "a.safetensors").exists()


def test_created_at_milliseconds_survive_mlx_bun_to_mlxkv_and_back(tmp_path):
    snap = mlxkv.load(str(BUN / "kv-v3.mlxkv"))
    bun, st, back = tmp_path / "a.mlxkv", tmp_path / "b.safetensors", tmp_path / "c.mlxkv"
    mlxkv.save(str(bun), snap.caches, snap.tokens, format="mlx-bun", created_at=1767225600123, fsync=False)
    assert cli(["convert", str(bun), str(st)]) == 0
    assert mlxkv.read_header(str(st))["createdAt"] == "2026-01-01T00:00:00.123Z"
    assert cli(["convert", str(st), str(back)]) == 0
    assert mlxkv.load(str(back)).created_at == 1767225600123


def test_cli_convert_to_a_mlxkv_name_writes_mlx_bun_unless_told(tmp_path, capsys):
    """Without ``--to``, a DST ending in ``.mlxkv`` (mlx-bun's extension) is written as an
    mlx-bun file; any other name as an mlxkv snapshot; ``--to`` wins over the name."""
    src = str(ROOT / "valid" / "kv-llama.safetensors")
    assert cli(["convert", src, str(tmp_path / "a.mlxkv")]) == 0
    assert "(mlx-bun)" in capsys.readouterr().out
    assert mlxkv.read_header(str(tmp_path / "a.mlxkv"))["codecProvider"] == "mlx-bun"
    assert cli(["convert", str(tmp_path / "a.mlxkv"), str(tmp_path / "b.safetensors")]) == 0
    assert "(mlxkv)" in capsys.readouterr().out
    assert mlxkv.read_header(str(tmp_path / "b.safetensors"))["codecProvider"] == "mlxkv"
    assert cli(["convert", src, str(tmp_path / "c.mlxkv"), "--to", "mlxkv"]) == 0
    assert mlxkv.read_header(str(tmp_path / "c.mlxkv"))["codecProvider"] == "mlxkv"


# -- layering -------------------------------------------------------------------------------------


# -- generation checkpoints ----------------------------------------------------------------------

CHECKPOINT_FIXTURE = next(f for f in FIXTURES if f["name"] == "checkpoint-llama-v3")


def test_the_fixture_checkpoint_key_is_the_request_key_mlxkv_computes():
    fx = CHECKPOINT_FIXTURE
    key, policy = fx["header"]["generationCheckpoint"]["key"], fx["checkpointPolicy"]
    rest = {k: v for k, v in policy.items() if k not in ("promptIds", "cacheNs")}
    assert generation_key(rest, policy["promptIds"], policy["cacheNs"]) == key
    # the same request described to mlxkv: greedy, stop token 2, 32 tokens at most, no seed, bf16
    assert mlxkv.request_key(policy["promptIds"], mlxkv.Sampler(), stop_tokens=[2], max_tokens=32) == key


def test_an_mlx_bun_checkpoint_resumes_greedily_exact(models, tmp_path):
    fx = CHECKPOINT_FIXTURE
    path = str(BUN / fx["file"])
    model = models(fx["model"]["arch"])
    with pytest.raises(errors.SnapshotError, match="records no sampler state"):
        mlxkv.Session.restore(path, model)
    s = mlxkv.Session.restore(path, model, sampler=mlxkv.Sampler(), stop_tokens=[2], max_tokens=32)
    cp = fx["header"]["generationCheckpoint"]
    assert s.request_key == cp["key"] and (s.seed, s.seed_was_explicit) == (1234, False)
    assert s.prompt_tokens == fx["checkpointPolicy"]["promptIds"] and len(s.generated_tokens) == 3
    assert s.generate(len(fx["nextTokens"])) == fx["nextTokens"]
    # saved back as mlx-bun's: mlx-bun's fields as mlx-bun has them, mlxkv's state beside them
    out = str(tmp_path / "resumed.mlxkv")
    s.save(out, format="mlx-bun")
    saved = mlxkv.load(out).source["generationCheckpoint"]
    assert {k: saved[k] for k in cp} == {**cp, "generatedTokens": 3 + 4, "pendingToken": s.pending_token}
    assert saved["mlxkv"]["policy"]["eosTokenIds"] == [2] and saved["mlxkv"]["policy"]["maxTokens"] == 32
    want = s.generate(3)
    assert mlxkv.Session.restore(out, model).generate(3) == want
