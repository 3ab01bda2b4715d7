"""Hardening of the mlx-bun reader: the rules of mlxkv's own snapshots (tests/test_hardening.py,
tests/test_fuzz.py, tests/test_stress.py) for mlx-bun cache files. Crafted and damaged
files are refused with mlxkv's own errors before anything is allocated, a file is read
through one descriptor whatever is renamed over its path, and a seeded fuzz finds no defect
(docs/mlx-bun.md section 8)."""

import collections
import os
import shutil
import tracemalloc

import mlx.core as mx
import pytest
from fuzzing import DEFECTS, deep, dumps
from fuzzing_mlxbun import MUTATIONS, BunCorpus, BunParts, make_case, records, run_bun_case
from helpers import replace_before_tensors
from test_stress import stress

import mlxkv
from mlxkv.errors import CorruptSnapshotError, SnapshotError
from mlxkv.formats.mlxbun import save_mlx_bun
from mlxkv.io import mlxbun as container
from mlxkv.io import tensor_reader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUN = os.path.join(ROOT, "fixtures", "mlx-bun")
CASES = 3000


def _base(tmp_path, name: str) -> str:
    """A copy of fixture ``name`` in ``tmp_path``, its blocks next to it."""
    shutil.copytree(os.path.join(BUN, "blocks"), tmp_path / "blocks", dirs_exist_ok=True)
    path = str(tmp_path / f"{name}.mlxkv")
    shutil.copy(os.path.join(BUN, f"{name}.mlxkv"), path)
    return path


def _craft(path: str, edit=None, text=None, **build) -> None:
    """Rewrite ``path`` with ``edit(header)`` applied (or the header text replaced), every
    hash recomputed: a consistent, crafted file."""
    parts = BunParts(open(path, "rb").read())
    if edit is not None:
        edit(parts.header)
    data = parts.build(text=text(parts.header).encode() if text else None, **build)
    with open(path, "wb") as f:
        f.write(data)


def _record(h, i=0, j=0):
    return h["caches"][i]["tensors"][j]


# -- 1. crafted headers: each refused with ours, before a tensor is read ------------------------

#: name -> (base fixture, edit of the header, text of the header, build options, error, message)
HEADERS = {
    "objects nested 3000 deep": ("kv-v3", lambda h: h.update(x=deep(3000)), None, {}, "nest deeper"),
    "a duplicate key": ("kv-v3", None, lambda h: dumps(h)[:-1] + ',"tokens":[]}', {}, "appears twice"),
    "NaN": ("kv-v3", None, lambda h: dumps(h)[:-1] + ',"x":NaN}', {}, "NaN is not JSON"),
    "a number no double holds": ("kv-v3", None, lambda h: dumps(h)[:-1] + ',"x":1e400}', {}, "does not fit a double"),
    "an integer beyond 2**53": ("kv-v3", lambda h: h.update(createdAt=2**53 + 1), None, {}, r"beyond \+-\(2\*\*53-1\)"),
    "an integer of 5000 digits": (
        "kv-v3",
        None,
        lambda h: dumps(h)[:-1] + ',"x":' + "9" * 5000 + "}",
        {},
        "not valid JSON",
    ),
    "a lone surrogate": ("kv-v3", lambda h: h.update(modelId="\ud800"), None, {}, "lone UTF-16 surrogate"),
    "not an object": ("kv-v3", None, lambda h: "[]", {}, "not a JSON object"),
    "a shape of 2**64 elements in zero bytes": (
        "kv-v3",
        lambda h: _record(h).update(shape=[2**32, 2**32, 0], bytes=0),
        None,
        {},
        "shape must be a list of at most 8 integers",
    ),
    "a shape of 9 dimensions": (
        "kv-v3",
        lambda h: _record(h).update(shape=[1] * 5 + _record(h)["shape"]),
        None,
        {},
        "at most 8 integers",
    ),
    "a negative dimension": ("kv-v3", lambda h: _record(h)["shape"].__setitem__(0, -1), None, {}, "shape must be"),
    "shape and bytes of 2 GiB, consistent, past the end": (
        "kv-v3",
        lambda h: _record(h).update(shape=[1, 2, 2**23, 64], bytes=2**31),
        None,
        {},
        "truncated: tensor caches.0.0 ends at byte",
    ),
    "bytes that do not hold the shape": (
        "kv-v3",
        lambda h: _record(h).update(bytes=1793),
        None,
        {},
        "do not hold shape",
    ),
    "bytes beyond 2**53": ("kv-v3", lambda h: _record(h).update(bytes=2**53 + 4), None, {}, "beyond"),
    "an off past the end": (
        "kv-v3",
        lambda h: _record(h).update(off=2**53 - 1),
        None,
        {"relayout": False},
        "ends at byte",
    ),
    "a negative off": (
        "kv-v3",
        lambda h: _record(h).update(off=-1),
        None,
        {"relayout": False},
        "must be integers >= 0",
    ),
    "a float off": ("kv-v3", lambda h: _record(h).update(off=0.5), None, {"relayout": False}, "must be integers >= 0"),
    "dtype code float64": ("kv-v3", lambda h: _record(h).update(dtype=11), None, {}, "not a dtype mlxkv holds"),
    "dtype code 99": ("kv-v3", lambda h: _record(h).update(dtype=99), None, {}, "unknown mlx-c dtype code 99"),
    "dtype true": ("kv-v3", lambda h: _record(h).update(dtype=True), None, {}, "is not an mlx-c dtype code"),
    "a hash in capitals": (
        "kv-v3",
        lambda h: _record(h).update(hash=_record(h)["hash"].upper() or "A" * 16),
        None,
        {"tensor_hashes": False},
        "16 lowercase hex digits",
    ),
    "a tensor record with an extra key": ("kv-v3", lambda h: _record(h).update(crc32="00000000"), None, {}, "exactly"),
    "a tensor record without off": ("kv-v3", lambda h: _record(h).pop("off"), None, {"relayout": False}, "exactly"),
    "dataStart inside the header": ("kv-v3", None, None, {"data_start": 30}, "dataStart 30 lies outside"),
    "formatVersion 6": ("kv-v3", lambda h: h.update(formatVersion=6), None, {}, "unsupported formatVersion 6"),
    "formatVersion 3.0": ("kv-v3", lambda h: h.update(formatVersion=3.5), None, {}, "formatVersion 3.5 missing"),
    "createdAt past year 9999": ("kv-v3", lambda h: h.update(createdAt=253402300800000), None, {}, "createdAt"),
    "a token id beyond int32": ("kv-v3", lambda h: h["tokens"].__setitem__(0, 2**31), None, {}, "token ids"),
    "an offset beyond int32": ("kv-v3", lambda h: h["caches"][0].update(offset=2**31), None, {}, "offset 2147483648"),
    "tokens that do not reach the offset": ("kv-v3", lambda h: h["tokens"].pop(), None, {}, "is at offset 7"),
    "an entry with a field of another kind": (
        "kv-v3",
        lambda h: h["caches"][0].update(maxSize=8),
        None,
        {},
        "has exactly kind, offset, tensors",
    ),
    "a ring whose unwritten tail passes its window": (
        "rotating-v3",
        lambda h: h["caches"][0].update(maxSize=7, idx=6),
        None,
        {},
        "a ring of 8 rows at offset 6 with maxSize 7",
    ),
    "attachment metadata holding a list": (
        "attachments-v4",
        lambda h: h["attachments"][0]["metadata"].update(k=[1]),
        None,
        {},
        "not a string, number or boolean",
    ),
    "an attachment with an extra key": (
        "attachments-v4",
        lambda h: h["attachments"][0].update(note="x"),
        None,
        {},
        "exactly schema, metadata, tensors",
    ),
    "format 5: a block name in capitals": (
        "blocks-v5",
        lambda h: _record(h)["blocks"][0].update(hash=_record(h)["blocks"][0]["hash"].upper()),
        None,
        {},
        "invalid KV block reference",
    ),
    "format 5: a block name leaving the blocks directory": (
        "blocks-v5",
        lambda h: _record(h)["blocks"][0].update(hash="../" + _record(h)["blocks"][0]["hash"][3:]),
        None,
        {},
        "invalid KV block reference",
    ),
    "format 5: a block of 0 bytes": (
        "blocks-v5",
        lambda h: _record(h)["blocks"].append({"hash": "a" * 64, "bytes": 0}),
        None,
        {},
        "invalid KV block reference",
    ),
    "format 5: blocks that do not add up": (
        "blocks-v5",
        lambda h: _record(h)["blocks"].append({"hash": "a" * 64, "bytes": 2}),
        None,
        {},
        r"blocks hold \d+ bytes, the tensor",
    ),
    "format 5: a tensor record hash": (
        "blocks-v5",
        lambda h: _record(h).update(hash="0" * 16),
        None,
        {},
        'hash must be ""',
    ),
    "format 5: bytes after the header": ("blocks-v5", None, None, {"data_start": 10**6}, "dataStart"),
}


@pytest.mark.parametrize("case", list(HEADERS), ids=list(HEADERS))
def test_crafted_headers_are_refused_with_our_errors_before_a_tensor_is_read(tmp_path, case, monkeypatch):
    base, edit, text, build, match = HEADERS[case]
    path = _base(tmp_path, base)
    _craft(path, edit, text, **build)
    reads = []
    monkeypatch.setattr(tensor_reader, "_load", lambda *a: reads.append(a))
    monkeypatch.setattr(container, "_read_block", lambda *a: reads.append(a))
    for call in (mlxkv.read_header, mlxkv.verify, mlxkv.load):
        with pytest.raises(SnapshotError, match=match) as e:
            call(path)
        assert "mlx-bun" in str(e.value)
    assert reads == []


@pytest.mark.parametrize(
    "case",
    ["a block that is not there", "a block of another size", "a flipped bit in a block", "a directory as block"],
)
def test_damaged_blocks_are_refused_when_read(tmp_path, case):
    path = _base(tmp_path, "blocks-v5")
    digest = BunParts(open(path, "rb").read()).header["caches"][0]["tensors"][0]["blocks"][0]["hash"]
    block = tmp_path / "blocks" / digest
    raw = bytearray(block.read_bytes())
    block.unlink()
    if case == "a block of another size":
        block.write_bytes(raw + b"\0")
    elif case == "a flipped bit in a block":
        raw[len(raw) // 2] ^= 4
        block.write_bytes(raw)
    elif case == "a directory as block":
        block.mkdir()
    mlxkv.read_header(path)  # the header is whole
    match = {"a flipped bit in a block": "KV block hash mismatch", "a block of another size": "holds 513 bytes"}
    for call in (mlxkv.verify, mlxkv.load):
        with pytest.raises(CorruptSnapshotError, match=match.get(case, "cannot be read")):
            call(path)


# -- 2. nothing is allocated for a size only the header claims ------------------------------------


def test_a_format_5_tensor_claiming_gigabytes_allocates_nothing_before_its_blocks_are_found(tmp_path):
    path = _base(tmp_path, "blocks-v5")
    missing = "f" * 64

    def huge_kv(h):  # a kv entry of 2 x 4 GiB in blocks of 1 MiB that are not there; the header checks pass
        h["caches"] = h["caches"][:1]
        for s in h["caches"][0]["tensors"]:
            s.update(shape=[1, 2, 2**14, 2**16], bytes=2**32, dtype=12)
            s["blocks"] = [{"hash": missing, "bytes": 1 << 20}] * 4096
        h["caches"][0]["offset"] = 2**14
        h["tokens"] = [1] * 2**14

    _craft(path, huge_kv)
    for call in (mlxkv.verify, mlxkv.load):
        tracemalloc.start()
        try:
            with pytest.raises(CorruptSnapshotError, match="cannot be read"):
                call(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 256 << 20, f"{call.__name__} allocated {peak} bytes"


def test_an_mlx_bun_load_that_would_not_fit_in_memory_is_refused_before_allocating(tmp_path, monkeypatch):
    path = _base(tmp_path, "kv-v3")
    monkeypatch.setattr(tensor_reader, "physical_memory", lambda: 1 << 10)
    loads = []
    monkeypatch.setattr(tensor_reader, "_load", lambda *a: loads.append(a))
    with pytest.raises(SnapshotError, match="restoring needs .* bytes of arrays"):
        mlxkv.load(path)
    assert loads == []


# -- 3. one descriptor: whatever is renamed over the path, one file is read -----------------------


def _two_files(tmp_path, second_format="mlx-bun"):
    path, other = str(tmp_path / "s.mlxkv"), str(tmp_path / "o.mlxkv")
    for p, g, fmt in ((path, 3, "mlx-bun"), (other, 9, second_format)):
        c = mlxkv.KVCache()
        x = mx.full((1, 2, 8, 16), g, mx.bfloat16)
        c.update_and_fetch(x, x)
        mlxkv.save(p, [c], [g] * 8, format=fmt)
    return path, other


@pytest.mark.parametrize("second", ["mlx-bun", "mlxkv"])
def test_a_file_renamed_over_the_path_mid_load_is_not_mixed_in(tmp_path, monkeypatch, second):
    """The header was read from one file, then the path is replaced (by another mlx-bun file,
    or by an mlxkv snapshot) before the tensors are read: the load is of the first file."""
    path, other = _two_files(tmp_path, second)
    replace_before_tensors(monkeypatch, other, path)
    got = mlxkv.load(path)
    assert got.tokens == [3] * 8 and mx.all(got.caches[0].keys[..., :8, :] == 3).item()


@pytest.mark.parametrize("second", ["mlx-bun", "mlxkv"])
def test_the_container_is_chosen_on_the_descriptor_the_file_is_read_through(tmp_path, monkeypatch, second):
    """The path replaced just after its magic was read: the header and tensors still come
    from the file whose magic chose the container."""
    path, other = _two_files(tmp_path, second)
    real = container.MlxBunFile._read_header

    def replaced_first(self):
        os.replace(other, path)
        return real(self)

    monkeypatch.setattr(container.MlxBunFile, "_read_header", replaced_first)
    for call in (mlxkv.read_header, mlxkv.verify, lambda p: mlxkv.load(p).header):
        _two_files(tmp_path, second)
        assert call(path)["tokens"] == [3] * 8


def test_concurrent_savers_of_both_formats_and_loaders_see_no_damage_and_no_mix(tmp_path):
    """Two processes save mlxkv, mlx-bun (format 3) and mlx-bun (format 5) files in turn to
    one path while two load from it: a whole file is always there, so no load may be
    refused, and none may mix two saves (tests/stress.py)."""
    r = stress("concurrency", tmp_path, "--savers", 2, "--loaders", 2, "--seconds", 5, "--format", "mixed")
    assert r["loads"] > 50 and r["child_failures"] == 0
    assert r["refused"] == 0 and r["mixed"] == 0 and r["whole"] == r["loads"], r["examples"]


# -- 4. the seeded fuzz -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return BunCorpus(str(tmp_path_factory.mktemp("bun-fuzz")))


def test_damaged_and_crafted_mlx_bun_files_are_refused_or_load_whole(corpus):
    outcomes, defects = collections.Counter(), []
    for i in range(CASES):
        name, mutation, data, expect, edits = make_case(corpus, 0, i)
        outcome, detail = run_bun_case(corpus, name, data, expect, edits, with_model=i % 4 == 0)
        outcomes[(mutation, outcome)] += 1
        if outcome in DEFECTS:
            defects.append((i, name, mutation, outcome, detail))
    assert defects == []
    for mutation in MUTATIONS:  # every mutation ran
        assert sum(n for (m, _), n in outcomes.items() if m == mutation) > 0, mutation
    for mutation in ("bitflip", "hostile", "json-bomb", "block-damage"):
        assert outcomes[(mutation, "refused")] > 0, mutation
    assert outcomes[("crafted", "loaded-crafted")] > 0  # crafted files that are valid still load


def test_the_bun_fuzzer_sees_defects(corpus, monkeypatch):
    """The classifier is not blind: a foreign exception, or a hostile file that loads, is caught."""
    name = "kv-v3"
    data = corpus.data[name]
    monkeypatch.setattr(mlxkv, "verify", lambda p: {}.__getitem__("boom"))
    assert run_bun_case(corpus, name, data, "damaged", {}, False)[0] == "foreign-exception"
    monkeypatch.undo()
    assert run_bun_case(corpus, name, data, "invalid", {}, False)[0] == "accepted-invalid"
    assert run_bun_case(corpus, name, data, "damaged", {}, False)[0] == "equal"


def test_the_fuzzers_file_builder_is_faithful(corpus):
    """Taken apart and rebuilt unchanged, every base file loads to what it loaded to: a
    refusal the fuzz sees comes from its mutation."""
    for name in corpus.names:
        parts = BunParts(corpus.data[name])
        assert len(records(parts.header)) > 0
        data = parts.build(relayout=False)
        assert run_bun_case(corpus, name, data, "damaged", {}, False)[0] == "equal", name


def test_save_refuses_what_the_reader_would_refuse(tmp_path):
    c = mlxkv.KVCache()
    x = mx.zeros((1, 2, 4, 8), mx.bfloat16)
    c.update_and_fetch(x, x)
    with pytest.raises(SnapshotError, match="not saved: the file would not read back.*createdAt"):
        save_mlx_bun(str(tmp_path / "x.mlxkv"), [c], [0] * 4, created_at=-1)
    assert not os.path.exists(tmp_path / "x.mlxkv")
