"""Seeded damaged and crafted mlx-bun cache files (the mlx-bun half of the fuzz suite).

The same scheme as tests/fuzzing.py, over the files of ``fixtures/mlx-bun`` (every kind
mlx-bun persists, formats 3, 4 with attachments, 5 with blocks, a generation checkpoint of a
seeded llama). Case ``i`` of seed ``s`` is a deterministic function of ``(s, i)``: a base
file and one mutation:

- ``bitflip``: 1-4 bits flipped, half of them in the prefix and the JSON header;
- ``truncate``: the file cut short; ``append``: bytes added at the end;
- ``header-edit``: a valid-JSON edit of the header, its hash left as it was;
- ``crafted``: a valid-JSON edit of the header with its hash recomputed (half of them re-laid
  out: offsets, ``dataStart`` and tensor hashes recomputed);
- ``hostile``: one bound a reader must check broken (dtype codes, shapes, ``bytes``,
  ``off``, ``dataStart``, hash formats, block references, versions, provider, kinds, tokens,
  attachments ...), every hash recomputed;
- ``json-bomb``: header text no I-JSON reader takes (nesting, numbers no double holds,
  ``NaN``, duplicate keys, lone surrogates, bad UTF-8), its hash recomputed;
- ``block-damage`` (format 5): a block flipped, cut, grown or removed.

``run_case`` (tests/fuzzing.py) reads each with ``read_header``, ``verify``, ``load`` (and
``Session.restore`` for the file of a seeded model) and classifies the outcome.
"""

import json
import os
import random
import shutil
import struct

from fuzzing import (
    _edit_json,
    _get,
    _nodes,
    append_junk,
    deep,
    digest,
    dumps,
    flip_bits,
    m_truncate,
    run_case,
    seeded_model,
)

import mlxkv
from mlxkv.io.mlxbun import MAGIC, PREFIX, PREFIX_LEN, align_up
from mlxkv.io.wyhash import hex16, wyhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUN = os.path.join(ROOT, "fixtures", "mlx-bun")
MUTATIONS = ("bitflip", "truncate", "append", "header-edit", "crafted", "hostile", "json-bomb", "block-damage")
WEIGHTS = (20, 8, 4, 6, 22, 25, 8, 7)


class BunParts:
    """An mlx-bun file taken apart: prefix fields, the JSON header, every stored tensor's bytes."""

    def __init__(self, data: bytes):
        _, header_len, self.data_start, _ = PREFIX.unpack(data[:PREFIX_LEN])
        self.header = json.loads(data[PREFIX_LEN : PREFIX_LEN + header_len])
        self.tensors = {}  # "caches.i.j" -> bytes (formats 3, 4)
        if self.header["formatVersion"] != 5:
            for name, record in records(self.header):
                at = self.data_start + record["off"]
                self.tensors[name] = bytearray(data[at : at + record["bytes"]])

    def build(self, relayout=True, tensor_hashes=True, header_hash=True, data_start=None, text=None) -> bytes:
        """The file again. ``relayout``: every tensor record naming a stored tensor gets mlx-bun's
        offsets for the bytes it has, and ``dataStart`` follows the header; else offsets and
        ``dataStart`` stay. ``text`` replaces the header JSON (its hash still recomputed
        unless ``header_hash`` is False)."""
        h = self.header
        five = isinstance(h, dict) and h.get("formatVersion") == 5
        placed = [(name, s) for name, s in records(h) if name in self.tensors]
        if relayout:
            cursor = 0
            for name, s in placed:
                s["off"] = align_up(cursor)
                cursor = s["off"] + len(self.tensors[name])
        if tensor_hashes:
            for name, s in placed:
                if isinstance(s.get("hash"), str):
                    s["hash"] = hex16(wyhash(bytes(self.tensors[name])))
        raw = text if text is not None else dumps(h).encode()
        if data_start is None:
            data_start = (
                PREFIX_LEN + len(raw) if five else (align_up(PREFIX_LEN + len(raw)) if relayout else self.data_start)
            )
        head = PREFIX.pack(MAGIC, len(raw), data_start, wyhash(raw) if header_hash else self.stored_hash(raw)) + raw
        out = bytearray(head)
        for name, s in placed:
            off = s.get("off")
            if type(off) is int and 0 <= off < 1 << 26 and len(head) <= data_start + off < 1 << 26:
                at = data_start + off
                end = at + len(self.tensors[name])
                if len(out) < end:
                    out.extend(bytes(end - len(out)))
                out[at:end] = self.tensors[name]
        if not five and len(out) < data_start < 1 << 26 and placed:
            out.extend(bytes(data_start - len(out)))
        return bytes(out)

    @staticmethod
    def stored_hash(raw: bytes) -> int:
        return wyhash(raw) ^ 1  # a hash that does not match


def records(header):
    """(name, tensor record dict) of every tensor record of a header, whatever an edit made of it."""
    out = []
    if not isinstance(header, dict):
        return out
    for key in ("caches", "attachments"):
        group = header.get(key)
        for i, entry in enumerate(group if isinstance(group, list) else []):
            tensors = entry.get("tensors") if isinstance(entry, dict) else None
            for j, s in enumerate(tensors if isinstance(tensors, list) else []):
                if isinstance(s, dict):
                    out.append((f"{key}.{i}.{j}", s))
    return out


# -- mutations: (data, expectation, block edits) ------------------------------------------------


def _header_end(data: bytes) -> int:
    return PREFIX_LEN + struct.unpack("<I", data[10:14])[0]


def m_bitflip(rng, data, parts):
    return flip_bits(rng, data, _header_end(data)), "damaged"


def m_append(rng, data, parts):
    return append_junk(rng, data, (1, 7, 16384)), "damaged"


def m_header_edit(rng, data, parts):
    parts.header = _edit_json(rng, parts.header)
    return parts.build(relayout=False, tensor_hashes=False, header_hash=False), "damaged"


def m_crafted(rng, data, parts):
    parts.header = _edit_json(rng, parts.header)
    relayout = rng.random() < 0.5
    if relayout and parts.tensors and rng.random() < 0.4:  # a shape changed with its bytes, consistently
        name, s = rng.choice([(n, s) for n, s in records(parts.header) if n in parts.tensors] or [(None, None)])
        shape = s.get("shape") if s else None
        if isinstance(shape, list) and shape and all(type(d) is int and 0 <= d < 2**16 for d in shape):
            old, raw = max(1, _prod(shape)), parts.tensors[name]
            item = len(raw) // old if _prod(shape) else 2
            shape[rng.randrange(len(shape))] += rng.choice((-1, 1)) if min(shape) > 0 else 1
            n = _prod(shape) * max(1, item)
            parts.tensors[name] = bytearray((raw * 2 + bytes(n))[:n])
            s["bytes"] = n
    return parts.build(relayout=relayout), "crafted"


def _prod(shape):
    p = 1
    for d in shape:
        p *= d
    return p


def _a_record(rng, parts, stored=True):
    named = [
        (n, s)
        for n, s in records(parts.header)
        if not stored or n in parts.tensors or parts.header["formatVersion"] == 5
    ]
    return rng.choice(named)


def _hostile(rng, data, parts):
    """One bound broken, every hash recomputed: a reader must refuse it."""
    h = parts.header
    five = h["formatVersion"] == 5
    name, s = _a_record(rng, parts)
    choice = rng.randrange(16)
    relayout, data_start, tensor_hashes = True, None, True
    if choice == 0:  # a dtype code mlx-c does not have, or mlxkv cannot hold, or not an int
        s["dtype"] = rng.choice((11, 13, 14, 99, -1, 2**40, True, 10.5, "10", None))
    elif choice == 1:  # a shape no reader may allocate, or not a shape
        shape = s["shape"]
        s["shape"] = rng.choice(
            (
                [2**32, 2**32],
                [2**31, 2**31, 2**31, 2**31],
                [1] * rng.choice((9, 65)) + shape,
                [-1] + shape[1:],
                [2**53 - 1],
                [True] * len(shape),
                "shape",
            )
        )
        if rng.random() < 0.5 and all(type(d) is int and d >= 0 for d in s["shape"]) and isinstance(s["shape"], list):
            s["bytes"] = _prod(s["shape"]) * 2  # consistent bytes, far past the end of the file
    elif choice == 2:  # bytes that do not hold the shape, or beyond any file
        s["bytes"] = rng.choice((s["bytes"] + 1, s["bytes"] + 16384, 2**53 - 1, -1, 2**40, 1.0, "1"))
    elif choice == 3:  # an off outside the file or overlapping another tensor
        relayout = False
        stored = [(n, x) for n, x in records(h) if n in parts.tensors and parts.tensors[n]]
        if not five and len(stored) > 1 and rng.random() < 0.4:
            (_, a), (_, b) = rng.sample(stored, 2)
            b["off"] = a["off"] + rng.randrange(max(1, min(a["bytes"], b["bytes"])))
        else:
            s["off"] = rng.choice((2**53 - 1, 2**40, 2**32, -1, 1.5, None, "0")) if not five else rng.choice((-1, None))
    elif choice == 4:  # a hash of the wrong form
        tensor_hashes = False
        s["hash"] = rng.choice(("ABCDEF0123456789", "0" * 15, "0" * 17, 1234, None, "g" * 16)) if not five else "ab"
    elif choice == 5:  # a format version mlxkv does not read
        h["formatVersion"] = rng.choice((2, 6, 1, 0, 2**31, "3", 3.5, None))
    elif choice == 6:  # another codec table
        h["codecProvider"] = rng.choice(("mlx-cache-v4", "", 3, None, ["mlx-cache-v3"]))
    elif choice == 7:  # a dataStart inside the prefix or header, or past the end of the file
        end = PREFIX_LEN + len(dumps(h).encode())
        if five:
            data_start = end + rng.choice((1, -1, 16384))
        elif rng.random() < 0.5:
            data_start = rng.choice((0, 25, end - 1))
        else:
            out = parts.build()
            return out[:14] + struct.pack("<I", len(out) + rng.choice((1, 16384))) + out[18:], "invalid"
    elif choice == 8:  # tokens that no longer match a positional cache's offset
        e = h["caches"][0] if h["caches"] else None
        if e is None or e["kind"] == "ssm":
            return _hostile(rng, data, BunParts(data))
        h["tokens"] = h["tokens"][:-1] if rng.random() < 0.5 else h["tokens"] + [1]
    elif choice == 9:  # a kind mlxkv has no cache for, or none at all
        if not h["caches"]:
            return _hostile(rng, data, BunParts(data))
        h["caches"][0]["kind"] = rng.choice(("paged", "mla", "kv2", "", None, 7))
    elif choice == 10:  # createdAt no ISO time shows
        h["createdAt"] = rng.choice((-1, 2**53 - 1, 253402300800000, "2026", 1.5, None))
    elif choice == 11:  # a tensor record with a key too many or one missing
        relayout = False  # it would add a missing off back
        if rng.random() < 0.5:
            s[rng.choice(("extra", "blocks" if not five else "crc32", "Off"))] = 0
        else:
            del s[rng.choice(("off", "bytes", "shape", "dtype", "hash"))]
    elif choice == 12:  # offsets and reuse floors out of range
        if not h["caches"]:
            return _hostile(rng, data, BunParts(data))
        e = h["caches"][0]
        if rng.random() < 0.5:
            e["offset"] = rng.choice((2**31, 2**40, -1, True, None))
        else:
            e["minimumReusableOffset"] = rng.choice((e["offset"] + 1, -1, 2**31, True))
    elif choice == 13 and five:  # a block reference that is no block of this tensor
        blocks = s["blocks"]
        k = rng.randrange(len(blocks)) if blocks else None
        options = ["list", "extra", "sum"] + (["name", "size", "zero", "drop", "absent"] if blocks else [])
        what = rng.choice(options)
        if what == "list":
            s["blocks"] = rng.choice(({}, "x", None, [[]]))
        elif what == "extra":
            s["blocks"].append({"hash": "a" * 64, "bytes": 1, "extra": 0} if rng.random() < 0.5 else {"hash": "a" * 64})
        elif what == "sum":
            s["bytes"] += 2
        elif what == "name":
            blocks[k]["hash"] = rng.choice(("../" + blocks[k]["hash"][3:], blocks[k]["hash"].upper(), "x", 5))
        elif what == "size":
            blocks[k]["bytes"] += 1
            s["bytes"] += 1
        elif what == "zero":
            blocks[k]["bytes"] = rng.choice((0, -1, 1.0))
        elif what == "drop":
            s["bytes"] -= blocks.pop(k)["bytes"]
        else:  # a well-formed sha256 of bytes that are not there
            blocks[k]["hash"] = format(rng.getrandbits(256), "064x")
    elif choice == 14 and h.get("attachments"):  # a malformed attachment
        a = h["attachments"][0]
        what = rng.randrange(4)
        if what == 0:
            a["metadata"][rng.choice(("k", "n"))] = rng.choice(([], {}, None))
        elif what == 1:
            a["schema"] = rng.choice((1, None, []))
        elif what == 2:
            a["extra"] = 1
        else:
            h["attachments"] = []
    elif choice == 14 and h["formatVersion"] == 3:  # attachments in a format-3 file
        h["attachments"] = [{"schema": "x", "metadata": {}, "tensors": []}]
    elif choice == 15 and any(e.get("kind") in ("rotating", "rotating-qkv") for e in h["caches"]):
        e = next(e for e in h["caches"] if e.get("kind") in ("rotating", "rotating-qkv"))
        rows, offset, bad = e["tensors"][0]["shape"][2], e["offset"], [0, -1, 2**31]
        if rows > offset:  # an unwritten tail past the window
            bad.append(rows - 1)
        if rows < offset:  # fewer rows than the window it has filled
            bad.append(rows + 1)
        e["maxSize"] = rng.choice(bad)
    else:
        return _hostile(rng, data, BunParts(data))
    return parts.build(relayout=relayout, tensor_hashes=tensor_hashes, data_start=data_start), "invalid"


def m_hostile(rng, data, parts):
    return _hostile(rng, data, parts)


def m_json_bomb(rng, data, parts):
    """Header text an I-JSON reader refuses, its hash recomputed."""
    h = parts.header
    text = dumps(h)
    what = rng.randrange(8)
    if what == 0:  # nesting deeper than any header needs
        path, _ = rng.choice([(p, v) for p, v in _nodes(h) if p])
        _get(h, path[:-1])[path[-1]] = deep(rng.choice((70, 3000, 100000)))
        text = dumps(h)
    elif what == 1:  # numbers no double holds, or no JSON has
        token = rng.choice(("1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 5000))
        text = text.replace('"createdAt":', '"createdAt":' + token + ',"x":', 1)
    elif what == 2:  # an integer beyond 2**53
        text = text.replace('"createdAt":', '"createdAt":' + str(2**53 + rng.randrange(2**60)) + ',"x":', 1)
    elif what == 3:  # a duplicate key
        key = rng.choice(("formatVersion", "tokens", "caches", "createdAt"))
        text = text[:-1] + f',"{key}":' + json.dumps(h.get(key)) + "}"
    elif what == 4:  # a lone surrogate
        text = (
            text.replace('"modelId":"', '"modelId":"\\ud800', 1)
            if '"modelId":"' in text
            else text[:-1] + ',"a":"\\udfff"}'
        )
    elif what == 5:  # trailing bytes after the object
        text = text + rng.choice((" x", "}", "{}", ","))
    elif what == 6:  # not an object
        text = rng.choice(("[]", "1", '"x"', "null", ""))
    raw = text.encode()
    if what == 7:  # not UTF-8
        raw = raw.replace(b'"ns":"', b'"ns":"\xff\xfe', 1) if b'"ns":"' in raw else raw[:-1] + b',"a":"\xc0"}'
    return parts.build(relayout=True, text=raw), "invalid"


def m_block_damage(rng, data, parts):
    """A format-5 file whose blocks are damaged (block edits travel with the case)."""
    return data, "damaged"


MUTATORS = {
    "bitflip": m_bitflip,
    "truncate": m_truncate,
    "append": m_append,
    "header-edit": m_header_edit,
    "crafted": m_crafted,
    "hostile": m_hostile,
    "json-bomb": m_json_bomb,
    "block-damage": m_block_damage,
}


# -- cases ------------------------------------------------------------------------------------------


class BunCorpus:
    """The base files (every file of fixtures/mlx-bun), what each loads to, and a working
    directory holding a copy of their blocks next to where cases are written."""

    def __init__(self, workdir: str):
        manifest = json.load(open(os.path.join(BUN, "manifest.json")))
        self.names = [f["name"] for f in manifest["fixtures"]]
        files = {f["name"]: os.path.join(BUN, f["file"]) for f in manifest["fixtures"]}
        self.data = {n: open(files[n], "rb").read() for n in self.names}
        self.model = {f["name"]: f.get("model") for f in manifest["fixtures"]}
        self.digest = {n: digest(mlxkv.load(files[n])) for n in self.names}
        self.five = [n for n in self.names if self.data[n][PREFIX_LEN:].find(b'"formatVersion":5') >= 0]
        self.workdir = workdir
        self.blocks = os.path.join(workdir, "blocks")
        shutil.copytree(os.path.join(BUN, "blocks"), self.blocks, dirs_exist_ok=True)
        self.block_names = sorted(os.listdir(self.blocks))

    def model_for(self, name):
        m = self.model[name]
        return None if m is None else seeded_model(m["arch"], m["seed"])


def make_case(corpus: BunCorpus, seed: int, index: int):
    """(base name, mutation, bytes, expectation, block edits: digest -> bytes or None)."""
    rng = random.Random(f"bun:{seed}:{index}")
    mutation = rng.choices(MUTATIONS, WEIGHTS)[0]
    name = rng.choice(corpus.five if mutation == "block-damage" else corpus.names)
    data = corpus.data[name]
    out, expect = MUTATORS[mutation](rng, data, BunParts(data))
    edits = {}
    if mutation == "block-damage":
        used = [d for _, s in records(BunParts(data).header) for d in (b["hash"] for b in s["blocks"])]
        digest_ = rng.choice(used)
        raw = bytearray(open(os.path.join(corpus.blocks, digest_), "rb").read())
        what = rng.randrange(4)
        if what == 0:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif what == 1:
            raw = raw[: rng.randrange(len(raw))]
        elif what == 2:
            raw += b"\x00"
        edits[digest_] = None if what == 3 else bytes(raw)
    return name, mutation, out, expect, edits


def run_bun_case(corpus: BunCorpus, name, data, expect, edits, with_model) -> tuple[str, str]:
    """``run_case`` on the case file in the corpus's working directory, its block edits in
    place for the run and undone after."""
    saved = {}
    for d, raw in edits.items():
        p = os.path.join(corpus.blocks, d)
        saved[d] = open(p, "rb").read()
        os.remove(p)
        if raw is not None:
            with open(p, "wb") as f:
                f.write(raw)
    try:
        return run_case(corpus, os.path.join(corpus.workdir, "case.mlxkv"), name, data, expect, with_model)
    finally:
        for d, raw in saved.items():
            with open(os.path.join(corpus.blocks, d), "wb") as f:
                f.write(raw)
