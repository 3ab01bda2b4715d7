"""Seeded damaged and crafted snapshots, and what loading each one does (the fuzz suite).

Case ``i`` of seed ``s`` is a deterministic function of ``(s, i)``: a base snapshot from
``fixtures/valid`` (every persisted kind, the three seeded architectures) and one mutation:

- ``bitflip``: 1-4 bits flipped, half of them in the header;
- ``truncate``: the file cut short; ``append``: bytes added at the end;
- ``outer-edit``: a valid-JSON edit of the safetensors header (the mlxkv string untouched);
- ``inner-edit``: a valid-JSON edit of the mlxkv header, its checksum left as it was;
- ``crafted``: a valid-JSON edit of the mlxkv header with its checksum recomputed and the
  file re-laid out to stay consistent (shapes, offsets, tensor checksums);
- ``hostile``: crafted files that break one bound a reader must check (sizes, element
  counts, tokens against offsets, minimumReusableOffset, eviction positions, a header
  checksum switched off by a renamed key, ...), all checksums recomputed.

``run_case`` reads the file with ``read_header``, ``verify`` and ``load`` (and, for files of
a seeded model, ``Session.restore`` on that model) and classifies the outcome:

- ``refused``: every refusal was an mlxkv ``SnapshotError``;
- ``equal``: it loaded, and what loaded equals the original snapshot;
- ``loaded-crafted``: a crafted (fully checksummed) file that is valid loaded;
- defects: ``foreign-exception`` (any other exception), ``silent-damage`` (a damaged file
  loaded different data), ``accepted-invalid`` (a hostile file loaded), ``hang`` (the
  watchdog fired); ``crash`` (the process died) is seen by the parent of a worker process
  (tests/fuzz_campaign.py).
"""

import contextlib
import copy
import functools
import hashlib
import json
import os
import random
import signal
import struct
import warnings

import mlx.core as mx
import numpy as np

import mlxkv
from mlxkv.errors import SnapshotError
from mlxkv.io.safetensors import crc32_hex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "fixtures")
CORPUS = (
    "kv-llama",
    "qkv-4-g64-llama",
    "qkv-3-g32-hybrid",
    "rotating-gemma3",
    "rotating-wrapped-llama",
    "rotating-qkv-wrapped-llama",
    "ssm-hybrid",
    "pending-kv4-start32-hybrid",
    "converted-kv4-start4-hybrid",
    "turboquant-k4v3-llama",
    "turboquant-k8v2-hybrid",
    "turboquant-constant-groups",
    "pending-turbo-k4v2-start16-hybrid",
    "tova-b6-s2-llama",
    "qfilters-b6-s2-r2-prefreeze-llama",
    "qfilters-b6-s2-r2-llama",
)
MUTATIONS = ("bitflip", "truncate", "append", "outer-edit", "inner-edit", "crafted", "hostile")
WEIGHTS = (25, 8, 5, 15, 7, 25, 15)
OUTCOMES = ("refused", "equal", "loaded-crafted")
DEFECTS = ("foreign-exception", "silent-damage", "accepted-invalid", "hang", "crash")
HANG_SECONDS = 10.0

HOSTILE_VALUES = (
    -1,
    0,
    1,
    2,
    7,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    1.5,
    -0.0,
    1e308,
    True,
    False,
    None,
    "",
    "x",
    "\ud800",
    "kv",
    "0",
    [],
    {},
    [0] * 3,
    [2**32, 2**32],
    {"a": 1},
    "A" * 5000,
)


# -- the file, taken apart and put back together ---------------------------------------------


class Parts:
    """A snapshot taken apart: outer JSON, mlxkv header, and every tensor's bytes."""

    def __init__(self, data: bytes):
        (n,) = struct.unpack("<Q", data[:8])
        self.outer = json.loads(data[8 : 8 + n])
        self.inner = json.loads(self.outer["__metadata__"]["mlxkv"])
        start = 8 + n
        self.tensors = {}
        for name, e in self.outer.items():
            if name != "__metadata__":
                b, t = e["data_offsets"]
                self.tensors[name] = bytearray(data[start + b : start + t])

    def build(self, fix_tensor_crcs=True, fix_header_crc=True, outer=None) -> bytes:
        """The file again, laid out from the mlxkv header's tensor references (shapes and
        dtypes taken from them where they name a tensor)."""
        outer = copy.deepcopy(self.outer) if outer is None else outer
        body, at = [], 0
        refs = tensor_refs(self.inner)
        for name, raw in self.tensors.items():
            e = outer.get(name)
            if not isinstance(e, dict):
                continue
            ref = refs.get(name)
            if fix_tensor_crcs and isinstance(ref, dict):
                ref["crc32"] = crc32_hex(bytes(raw))
            e["data_offsets"] = [at, at + len(raw)]
            body.append(bytes(raw))
            at += len(raw)
        text = dumps(self.inner)
        meta = outer.setdefault("__metadata__", {})
        if isinstance(meta, dict):
            meta["mlxkv"] = text
            if fix_header_crc:
                meta["mlxkv.crc32"] = crc32_hex(text.encode("utf-8", "surrogatepass"))
        return join(outer, b"".join(body))


def tensor_refs(inner) -> dict:
    """name -> tensor reference of an mlxkv header, whatever an edit made of it."""
    out = {}
    caches = inner.get("caches") if isinstance(inner, dict) else None
    for entry in caches if isinstance(caches, list) else []:
        tensors = entry.get("tensors") if isinstance(entry, dict) else None
        for t in tensors if isinstance(tensors, list) else []:
            if isinstance(t, dict) and isinstance(t.get("name"), str):
                out[t["name"]] = t
    return out


def join(outer, body: bytes, raw_json: bytes | None = None) -> bytes:
    raw = raw_json if raw_json is not None else dumps(outer).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _nodes(value, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nodes(v, path + (i,))


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def deep(depth):
    """A marker that ``dumps`` writes as ``depth`` nested arrays (json.dumps would recurse)."""
    return f"@@deep{depth}@@"


def dumps(value) -> str:
    text = json.dumps(value, separators=(",", ":"))
    while "@@deep" in text:
        i = text.index('"@@deep')
        j = text.index('@@"', i + 7)
        depth = int(text[i + 7 : j])
        text = text[:i] + "[" * depth + "0" + "]" * depth + text[j + 3 :]
    return text


def _edit_json(rng: random.Random, tree):
    """One random valid-JSON edit of ``tree`` (in place where possible); returns the tree."""
    nodes = list(_nodes(tree))
    path, value = rng.choice(nodes)
    op = rng.randrange(7)
    if not path or op == 0:  # replace a leaf or a subtree with a hostile value
        if not path:
            return rng.choice([[], "x", 1, {"caches": []}, deep(rng.choice((70, 3000)))])
        new = rng.choice(HOSTILE_VALUES + (deep(rng.choice((10, 70, 3000))),))
    elif op == 1 and isinstance(value, (int, float)) and not isinstance(value, bool):
        new = rng.choice([value + 1, value - 1, value * 2, -value, 0, value + 2**32])
    elif op == 2:  # delete it
        parent = _get(tree, path[:-1])
        del parent[path[-1]]
        return tree
    elif op == 3 and isinstance(value, dict):  # an unknown key
        value[rng.choice(["extra", "mlxkv.note", "offset2", "x" * 20])] = rng.choice(HOSTILE_VALUES)
        return tree
    elif op == 4 and isinstance(value, list) and len(value) > 1:
        i, j = rng.sample(range(len(value)), 2)
        value[i], value[j] = value[j], value[i]
        return tree
    elif op == 5 and isinstance(value, list):
        value.append(copy.deepcopy(rng.choice(value)) if value else 0)
        return tree
    elif op == 6 and isinstance(value, str):
        new = value[:-1] + chr(ord(value[-1]) ^ 1) if value else "\x00"
    else:
        new = rng.choice(HOSTILE_VALUES)
    _get(tree, path[:-1])[path[-1]] = new
    return tree


def _duplicate_key(raw: bytes, rng: random.Random) -> bytes:
    """The JSON text with one object key repeated (json.dumps cannot write that)."""
    text = raw.decode()
    starts = [i for i, c in enumerate(text) if c == "{" and text[i + 1 : i + 2] == '"']
    if not starts:
        return raw
    i = rng.choice(starts)
    end = text.index(",", i) if "," in text[i:] else -1
    colon = text.index(":", i)
    if end < 0 or end < colon:
        return raw
    pair = text[i + 1 : end]
    return (text[: i + 1] + pair + "," + text[i + 1 :]).encode()


# -- mutations: (data, expectation) -------------------------------------------------------------
# expectation: "damaged" (refuse, or load equal), "crafted" (anything but a defect), "invalid"
# (must be refused)


def flip_bits(rng, data: bytes, header_end: int) -> bytes:
    """1-4 bits flipped, each in the header (its first ``header_end`` bytes) half the time."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(header_end) if rng.random() < 0.5 else rng.randrange(len(out))
        out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def append_junk(rng, data: bytes, sizes) -> bytes:
    return data + bytes(rng.randrange(256) for _ in range(rng.choice(sizes)))


def m_bitflip(rng, data, parts):
    return flip_bits(rng, data, 8 + struct.unpack("<Q", data[:8])[0]), "damaged"


def m_truncate(rng, data, parts):
    return data[: rng.randrange(len(data))], "damaged"


def m_append(rng, data, parts):
    return append_junk(rng, data, (1, 7, 8, 64)), "damaged"


def m_outer_edit(rng, data, parts):
    (n,) = struct.unpack("<Q", data[:8])
    outer = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    if rng.random() < 0.15:
        return join(None, body, _duplicate_key(dumps(outer).encode(), rng)), "damaged"
    meta = outer.get("__metadata__", {})
    target = outer
    if rng.random() < 0.3 and isinstance(meta, dict):  # the metadata itself (not the mlxkv string)
        key = rng.choice(["mlxkv.crc32", "mlxkv"])
        if key in meta and rng.random() < 0.5:  # rename a key by one bit, as damage does
            k2 = key[:-1] + chr(ord(key[-1]) ^ (1 << rng.randrange(6)))
            meta[k2] = meta.pop(key)
            return join(outer, body), "damaged"
        target = meta
    if target is meta and rng.random() < 0.5:
        meta[rng.choice(["note", "format", "mlxkv2", "mlxkv.crc3"])] = "x"
        return join(outer, body), "damaged"
    tree = _edit_json(rng, target)
    if target is outer:
        outer = tree
    return join(outer, body), "damaged"


def m_inner_edit(rng, data, parts):
    parts.inner = _edit_json(rng, parts.inner)
    return parts.build(fix_tensor_crcs=False, fix_header_crc=False), "damaged"


def m_crafted(rng, data, parts):
    parts.inner = _edit_json(rng, parts.inner)
    if rng.random() < 0.3:  # a tensor's shape or dtype changed in both headers, bytes re-laid out
        name = rng.choice(list(parts.tensors))
        t = tensor_refs(parts.inner).get(name)
        shape = t.get("shape") if t is not None else None
        if isinstance(shape, list) and shape and all(type(d) is int and 0 <= d < 2**20 for d in shape):
            axis = rng.randrange(len(shape))
            old = parts.outer[name]["shape"]
            shape[axis] = max(0, shape[axis] + rng.choice((-1, 1)))
            count = int(np.prod(shape))
            item = len(parts.tensors[name]) // max(1, int(np.prod(old)) if old else 1)
            raw = parts.tensors[name]
            parts.tensors[name] = (raw * 2)[: count * item] if count * item > len(raw) else raw[: count * item]
            parts.outer[name]["shape"] = list(shape)
    return parts.build(), "crafted"


def _entry(parts, kinds=None):
    entries = [(i, e) for i, e in enumerate(parts.inner["caches"]) if kinds is None or e["kind"] in kinds]
    return entries[0] if entries else (None, None)


def _hostile(rng, data, parts):
    """One bound broken, every checksum recomputed: a reader must refuse it."""
    h = parts.inner
    i, entry = _entry(parts)
    choice = rng.randrange(12)
    if choice == 0:  # tokens no longer match the offsets
        h["tokens"] = h["tokens"][:-1] if rng.random() < 0.5 else h["tokens"] + [1]
        if "generationCheckpoint" in h:
            cp = h["generationCheckpoint"]
            cp["generatedTokens"] = len(h["tokens"]) - cp["originalPromptTokens"]  # the checkpoint stays consistent
    elif choice == 1:  # minimumReusableOffset out of range or a bool
        entry["minimumReusableOffset"] = rng.choice((-1, entry["offset"] + 1, True, 2**40))
    elif choice == 2:  # an ssm entry asking for a huge state list
        j, ssm = _entry(parts, ("ssm",))
        if ssm is None:
            return _hostile(rng, data, parts)
        ssm["size"] = rng.choice((2**31, 2**31 - 1, 10**6, 257))
    elif choice == 3:  # an element count that overflows 64 bits in zero bytes
        name = entry["tensors"][0]["name"]
        shape = rng.choice(([2**32, 2**32, 0], [2**32, 2**32], [2**62, 4, 0], [0, 2**31, 2**31, 2**31]))
        entry["tensors"][0]["shape"] = parts.outer[name]["shape"] = shape
        parts.tensors[name] = bytearray() if 0 in shape else parts.tensors[name]
    elif choice == 4:  # a rank MLX and numpy cannot hold
        j, ssm = _entry(parts, ("ssm",))
        e = ssm if ssm is not None else entry
        t = e["tensors"][0]
        shape = [1] * rng.choice((9, 65, 1003)) + list(parts.outer[t["name"]]["shape"])
        t["shape"] = parts.outer[t["name"]]["shape"] = shape
    elif choice == 5:  # eviction positions out of range, or not increasing
        j, ev = _entry(parts, ("tova", "qfilters"))
        if ev is None:
            return _hostile(rng, data, parts)
        name = next(t["name"] for t in ev["tensors"] if t["slot"] == "positions")
        pos = np.frombuffer(bytes(parts.tensors[name]), dtype=np.int32).copy()
        k = rng.randrange(len(pos))
        pos[k] = rng.choice(
            (-1, ev["offset"], ev["offset"] + 5, 2**31 - 1, pos[k - 1] if k else pos[min(1, len(pos) - 1)])
        )
        if len(pos) > 1 and rng.random() < 0.3:
            pos[0], pos[1] = pos[1], pos[0]
        parts.tensors[name] = bytearray(pos.tobytes())
    elif choice == 6:  # the header checksum switched off by renaming its key, then a field changed
        h["tokens"] = [t ^ 1 for t in h["tokens"]]
        out = parts.build()
        return out.replace(
            b'"mlxkv.crc32"', rng.choice((b'"mlxkv.crc33"', b'"mlxkv.crc22"', b'"mlxkw.crc32"'))
        ), "invalid"
    elif choice == 7:  # a checksum-less header (another writer) or a malformed checksum
        out = parts.build()
        (n,) = struct.unpack("<Q", out[:8])
        outer = json.loads(out[8 : 8 + n])
        if rng.random() < 0.5:
            del outer["__metadata__"]["mlxkv.crc32"]
        else:
            outer["__metadata__"]["mlxkv.crc32"] = outer["__metadata__"]["mlxkv.crc32"].upper() + ""
            if outer["__metadata__"]["mlxkv.crc32"].islower() or outer["__metadata__"]["mlxkv.crc32"].isdigit():
                outer["__metadata__"]["mlxkv.crc32"] = " " + outer["__metadata__"]["mlxkv.crc32"][1:]
        return join(outer, out[8 + n :]), "invalid"
    elif choice == 8:  # pendingConversion naming nothing
        entry["pendingConversion"] = rng.choice(
            (
                {"scheme": "kv99", "start": 4},
                {"scheme": "kv4", "start": -1},
                {"scheme": 4, "start": 4},
                [],
                {"scheme": "kv4"},
            )
        )
    elif choice == 9:  # an offset, field or shape beyond int32 in a consistent file
        entry["offset"] = rng.choice((2**31, 2**40, -1))
    elif choice == 10:  # identity strings of the wrong type
        h[rng.choice(("modelId", "configFingerprint", "tokenizerHash", "ns", "createdAt"))] = rng.choice(
            (1, None, [], {})
        )
    else:  # token ids out of range
        h["tokens"][rng.randrange(len(h["tokens"]))] = rng.choice((-1, 2**31, 2**63, True))
    return parts.build(), "invalid"


def m_hostile(rng, data, parts):
    return _hostile(rng, data, parts)


MUTATORS = {
    "bitflip": m_bitflip,
    "truncate": m_truncate,
    "append": m_append,
    "outer-edit": m_outer_edit,
    "inner-edit": m_inner_edit,
    "crafted": m_crafted,
    "hostile": m_hostile,
}


# -- cases and outcomes -------------------------------------------------------------------------


class Corpus:
    """The base snapshots, their manifest entries and digests of what each loads to."""

    def __init__(self, names=CORPUS):
        manifest = json.load(open(os.path.join(FIXTURES, "manifest.json")))
        by_name = {f["name"]: f for f in manifest["fixtures"]}
        self.names = [n for n in names if n in by_name]
        self.data = {n: open(os.path.join(FIXTURES, by_name[n]["file"]), "rb").read() for n in self.names}
        self.model = {n: by_name[n]["model"] for n in self.names}
        self.digest = {n: digest(mlxkv.load(os.path.join(FIXTURES, by_name[n]["file"]))) for n in self.names}

    def model_for(self, name):
        """The seeded model fixture ``name`` was saved from (None for a model-less fixture)."""
        m = self.model[name]
        return None if m is None else seeded_model(m["arch"], m["seed"])


@functools.cache
def seeded_model(arch: str, seed: int):
    from mlxkv.models.seeded import build_model

    return build_model(arch, seed=seed)


def make_case(corpus: Corpus, seed: int, index: int):
    """(base name, mutation, bytes, expectation) of case ``index``."""
    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(corpus.names)
    mutation = rng.choices(MUTATIONS, WEIGHTS)[0]
    data = corpus.data[name]
    out, expect = MUTATORS[mutation](rng, data, Parts(data))
    return name, mutation, out, expect


def digest(snap) -> str:
    """A hash of everything a load gives: the header and every array's bytes."""
    h = hashlib.sha256(json.dumps(snap.header, sort_keys=True).encode())
    for c in snap.caches:
        inner = getattr(c, "inner", c)
        h.update(type(c).__name__.encode() + type(inner).__name__.encode())
        h.update(repr((c.kind, c.offset, c.minimum_reusable_offset)).encode())
        for a in inner.state if not isinstance(inner.state, mx.array) else [inner.state]:
            if a is None:
                h.update(b"none")
                continue
            if isinstance(a, mx.array):
                raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                h.update(f"{a.dtype}{a.shape}".encode())
                h.update(np.ascontiguousarray(np.asarray(raw.reshape(-1))).tobytes())
            else:
                h.update(repr(a).encode())
    return h.hexdigest()


class Hang(BaseException):
    pass


@contextlib.contextmanager
def watchdog(seconds=HANG_SECONDS):
    def fire(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(corpus: Corpus, path: str, name: str, data: bytes, expect: str, with_model: bool) -> tuple[str, str]:
    """(outcome, detail) of reading ``data`` (written to ``path``)."""
    with open(path, "wb") as f:
        f.write(data)
    refused, loaded = [], None
    calls = [("read_header", lambda: mlxkv.read_header(path)), ("verify", lambda: mlxkv.verify(path))]
    calls.append(("load", lambda: mlxkv.load(path)))
    model = corpus.model_for(name) if with_model else None
    if model is not None:
        calls.append(("restore", lambda: mlxkv.Session.restore(path, model)))
    results = {}
    try:
        with watchdog(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for what, call in calls:
                try:
                    results[what] = call()
                except SnapshotError as e:
                    refused.append(f"{what}: {type(e).__name__}")
                except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
                    return "foreign-exception", f"{what}: {type(e).__name__}: {str(e)[:300]}"
    except Hang:
        return "hang", f"no answer within {HANG_SECONDS} s"
    loaded = results.get("load")
    if loaded is None:
        return "refused", refused[0] if refused else ""
    if expect == "invalid":
        return "accepted-invalid", "a file breaking a bound loaded"
    if digest(loaded) == corpus.digest[name]:
        return "equal", ""
    if expect == "damaged":
        return "silent-damage", "a damaged file loaded different data"
    return "loaded-crafted", ""
