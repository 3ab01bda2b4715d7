"""``convert`` carries each file's layers (entries and arrays) from its reader to the target
format's writer without building a cache; what it writes is byte for byte what ``save``
writes from the caches a load of the same file restores (the path conversion took before it
carried layers): every kind of every format mlxkv reads, into each format it writes.

Refusals are the same refusals (the same exception type), raised before anything is written.
"""

import glob
import json
import os
import shutil

import mlx.core as mx
import pytest
from helpers import rewrite_header
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.families import known_persisted_kinds
from mlxkv.formats.mlxlm import read_prompt_cache
from mlxkv.formats.table import convert, writer
from mlxkv.state.identity import Identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = sorted(glob.glob(f"{ROOT}/fixtures/valid/*.safetensors")) + sorted(
    glob.glob(f"{ROOT}/fixtures/mlx-bun/*.mlxkv")
)
TARGETS = ("mlxkv", "mlx-bun", "mlx-lm")


def _arrays(shape, n):
    return [mx.random.normal(shape) for _ in range(n)]


def _mlx_lm_files(out):
    """mlx-lm's own prompt-cache files: a ring with more rows than its window (a long
    prefill), kv, quantized and recurrent state at one offset; two rings not yet full whose
    buffers grew past their offset (the unwritten tail)."""
    mx.random.seed(3)
    long_ring = mlx_cache.RotatingKVCache(max_size=8, keep=0)
    long_ring.update_and_fetch(*_arrays((1, 2, 12, 16), 2))
    assert long_ring.keys.shape[2] > long_ring.max_size
    kv = mlx_cache.KVCache()
    kv.update_and_fetch(*_arrays((1, 2, 12, 16), 2))
    quantized = mlx_cache.QuantizedKVCache(group_size=32, bits=4)
    quantized.update_and_fetch(*_arrays((1, 2, 12, 64), 2))
    arrays = mlx_cache.ArraysCache(2)
    arrays[0], arrays[1] = mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 4, 4))
    mixed = f"{out}/mlx-lm-mixed.safetensors"
    mlx_cache.save_prompt_cache(mixed, [long_ring, kv, quantized, arrays], {"tokens": json.dumps(list(range(12)))})
    rings = []
    for _ in range(2):
        ring = mlx_cache.RotatingKVCache(max_size=32, keep=0)
        ring.update_and_fetch(*_arrays((1, 2, 5, 16), 2))
        for _ in range(3):
            ring.update_and_fetch(*_arrays((1, 2, 1, 16), 2))
        rings.append(ring)
    growing = f"{out}/mlx-lm-growing-rings.safetensors"
    mlx_cache.save_prompt_cache(growing, rings, {"tokens": json.dumps(list(range(8)))})
    return [mixed, growing]


def _due_pending(out):
    """A pending bf16-first file whose conversion is already due at its offset (an mlxkv
    that converted one append later wrote it): its restore converts, and so does its
    conversion."""
    path = f"{out}/pending-due.safetensors"
    shutil.copy(f"{ROOT}/fixtures/valid/pending-kv4-start32-hybrid.safetensors", path)

    def due(header):
        for entry in header["caches"]:
            if "pendingConversion" in entry:
                entry["pendingConversion"]["start"] = 4

    rewrite_header(path, due)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = tmp_path_factory.mktemp("sources")
    made = _mlx_lm_files(out) + [_due_pending(out)]
    for src in FIXTURES:  # every fixture mlx-lm's files can hold, as one (an mlx-lm source)
        dst = f"{out}/mlx-lm-of-{os.path.basename(src)}.safetensors"
        try:
            convert(src, dst, to="mlx-lm")
        except mlxkv.MLXKVError:
            continue
        made.append(dst)
    return FIXTURES + made


def _restored(src):
    """(caches, tokens, identity, checkpoint, attachments, created_at) as a load restores
    them: what conversion carried before it carried layers."""
    try:
        snap = mlxkv.load(src)
    except mlxkv.SnapshotError as e:
        if "not an mlxkv snapshot" not in str(e):
            raise
        pc = read_prompt_cache(src)
        return pc.caches, pc.tokens, Identity.from_header({"modelId": pc.metadata.get("model", "")}), None, None
    return snap.caches, snap.tokens, Identity.from_header(snap.header), snap.generation_checkpoint, snap.attachments


def _written_time(header):
    return header.get("createdAt")  # an mlxkv header's ISO time, an mlx-bun header's milliseconds


@pytest.mark.parametrize("to", TARGETS)
def test_conversion_writes_what_save_writes_from_the_restored_caches(sources, to, tmp_path):
    written = refused = 0
    for i, src in enumerate(sources):
        name = os.path.basename(src)
        dst, ref = str(tmp_path / f"{i}.out"), str(tmp_path / f"{i}.ref")
        caches, tokens, identity, checkpoint, attachments = _restored(src)
        try:
            header = convert(src, dst, to=to)
        except mlxkv.MLXKVError as e:
            with pytest.raises(type(e)):
                writer(to).save(
                    ref, caches, tokens, identity=identity, generation_checkpoint=checkpoint, attachments=attachments
                )
            assert not os.path.exists(dst), name
            refused += 1
            continue
        writer(to).save(
            ref,
            caches,
            tokens,
            identity=identity,
            generation_checkpoint=checkpoint,
            attachments=attachments,
            created_at=_written_time(header),
        )
        with open(dst, "rb") as a, open(ref, "rb") as b:
            assert a.read() == b.read(), f"{name} -> {to}: the converted file differs from the saved one"
        written += 1
    assert written >= 10 and refused >= 1, (written, refused)


def test_the_sources_cover_every_kind(sources):
    """The comparison above sees every persisted kind, rings with more rows than their window
    and with an unwritten tail, pending and due bf16-first entries, attachments and checkpoints."""
    kinds, pending, due = set(), False, False
    for src in sources:
        try:
            header = mlxkv.read_header(src)
        except mlxkv.SnapshotError:
            continue
        for e in header["caches"]:
            kinds.add(e["kind"])
            if "pendingConversion" in e:
                pending = True
                due = due or e["offset"] >= e["pendingConversion"]["start"]
    assert kinds == set(known_persisted_kinds()), kinds
    assert pending and due
    assert any("mlx-lm-mixed" in s for s in sources) and any("growing-rings" in s for s in sources)
