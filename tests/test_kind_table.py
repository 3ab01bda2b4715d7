"""The kind table: a family declared in this file alone (a live cache, a codec, one record)
builds from a scheme, generates, saves and loads (as mlxkv and in its mlx-bun form), joins a
batch, comes back out of it and runs a compiled decode step; and every registered family's
codec declares what it writes."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from generation import greedy, run

import mlxkv
from mlxkv.batched.row_format import RowFormat
from mlxkv.caches.decode_step import DecodeStep, Phase, WindowLayout
from mlxkv.codecs.base import BunForm, Codec, expect_slots, same_prefix
from mlxkv.errors import CorruptSnapshotError
from mlxkv.families import COUNT, Scheme, family_of_kind, family_of_persisted
from mlxkv.models.seeded import prompt

# -- the toy family: keys and values stored as float16, attended in the input dtype ---------


class HalfKVCache(mlxkv.KVCache):
    """A plain cache that stores float16 and hands attention the caller's dtype."""

    kind = "kv:toy-half"

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        return k.astype(keys.dtype), v.astype(values.dtype)


class HalfCodec(Codec):
    persisted = "toy-half"
    fields = {"offset": COUNT}
    slots = ("keys", "values")
    bun = BunForm()  # laid out as mlx-bun lays out kv

    def encode(self, cache):
        n = cache.offset
        return {"offset": n}, [("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])]

    def check(self, entry, shapes):
        expect_slots(entry, shapes, self.slots)
        same_prefix(entry, shapes, self.slots)
        if shapes["keys"][2] != entry["offset"]:
            raise CorruptSnapshotError("toy-half entry: rows != offset")

    def decode(self, entry, tensors):
        return HalfKVCache().adopt(tensors["keys"], tensors["values"], entry["offset"])

    def trimmable(self, entry, shapes):
        return True

    def prefix(self, entry, tensors, p):
        return HalfKVCache().adopt(tensors["keys"][..., :p, :], tensors["values"][..., :p, :], p, slack=False)

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]


@dataclass(frozen=True)
class HalfStorage:
    affine = False
    key_fills = value_fills = (0,)

    def encode_keys(self, x):
        return (x.astype(mx.float16),)

    encode_values = encode_keys

    quantized_window = False

    def fetch(self, keys, values, dtype=None):
        return self.decode_keys(keys, dtype), self.decode_values(values, dtype)

    def decode_keys(self, t, dtype=None):
        return t[0].astype(dtype or mx.bfloat16)

    decode_values = decode_keys


@dataclass(frozen=True)
class HalfRows(RowFormat):
    storage = HalfStorage()

    def empty(self):
        return HalfKVCache()

    def read(self, row):
        n = row.offset
        if row.keys is None or n == 0:
            return None, None, 0, {}
        return (row.keys[..., :n, :],), (row.values[..., :n, :],), n, {}

    def restore(self, keys, values, offset, count, dtype, extras):
        row = self.empty()
        return row if keys is None else row.adopt(keys[0], values[0], offset)


@dataclass(frozen=True)
class HalfStore:
    """The toy's compiled-decode store: float16 rows, attended in the new keys' dtype."""

    width = 1
    quantized_window = False  # arrays: mlx-lm's dense kernel

    def join(self, keys, values, k, v, at):
        put = lambda a, x: mx.slice_update(a, x.astype(mx.float16), at, axes=(2,)).astype(x.dtype)
        return put(keys[0], k), put(values[0], v)

    def written(self, wk, wv):
        return wk, wv


def half_decode_step(cache):
    """A window over the buffer (grown outside the graph if full), committed by the cache's
    own append: the decode step API a family implements."""
    n = cache.offset
    rows = -(-(n + 1) // 256) * 256
    fit = lambda a: (
        a[..., :rows, :] if a.shape[2] >= rows else mx.pad(a, [(0, 0), (0, 0), (0, rows - a.shape[2]), (0, 0)])
    )
    layout = WindowLayout(Phase(cache.kind, "window", rows), HalfStore())
    arrays = (mx.array(n, mx.int32), mx.array([n], mx.int32), fit(cache.keys), fit(cache.values))
    return DecodeStep(layout, arrays, lambda new, effects: cache.update_and_fetch(new[0], new[1]))


TOY = mlxkv.Family(
    kind=HalfKVCache.kind,
    codec=HalfCodec(),
    rows=lambda row: HalfRows(),
    decode_step=half_decode_step,
    scheme=(r"toy-half", lambda m, options: Scheme(m.string, lambda i, o: HalfKVCache(), True)),
)


@pytest.fixture
def toy():
    mlxkv.register_family(TOY)
    yield TOY
    mlxkv.unregister_family("toy-half")


def test_a_family_declared_in_one_record_saves_loads_joins_and_decodes(toy, models, tmp_path):
    model = models("llama")
    prompts = [prompt(n, seed=40 + n) for n in (9, 14)]

    # scheme -> live caches -> generation
    refs = []
    for p in prompts:
        caches = mlxkv.make_cache(model, "toy-half")
        assert {c.kind for c in caches} == {"kv:toy-half"}
        first = int(mx.argmax(run(model, caches, p)[0]).item())
        refs.append((first, greedy(model, caches, first, 6)[0]))

    # save and load: the header names the toy kind, the loaded caches continue identically
    caches = mlxkv.make_cache(model, "toy-half")
    first = int(mx.argmax(run(model, caches, prompts[0])[0]).item())
    path = str(tmp_path / "toy.safetensors")
    header = mlxkv.save(path, caches, prompts[0])
    assert {e["kind"] for e in header["caches"]} == {"toy-half"}
    snap = mlxkv.load(path, model=model)
    assert all(isinstance(c, HalfKVCache) and c.keys.dtype == mx.float16 for c in snap.caches)
    assert greedy(model, snap.caches, first, 6)[0] == refs[0][1]

    # a prompt store lends a prefix through the codec (trimmable from the header, cut by prefix)
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path / "store")) as store:
        store.put(prompts[0], caches)
        store.flush()
    with mlxkv.PromptStore(model, cap=1 << 26, directory=str(tmp_path / "store")) as store:
        hit = store.take(prompts[0][:6] + [7])  # from the disk tier: its header said trimmable
    assert (hit.tier, hit.prefix_len) == ("disk", 6) and hit.caches[0].keys.shape[2] == 6
    refill = mlxkv.make_cache(model, "toy-half")
    run(model, refill, prompts[0][:6])
    assert mx.array_equal(run(model, hit.caches, [7]), run(model, refill, [7]))

    # its mlx-bun form: written as the codec's bun form says, read back through the same codec
    bun = str(tmp_path / "toy.mlxkv")
    bun_header = mlxkv.save(bun, caches, prompts[0], format="mlx-bun", fsync=False)
    assert [sorted(e) for e in bun_header["caches"]] == [["kind", "offset", "tensors"]] * len(caches)
    assert mlxkv.read_header(bun)["caches"][0]["kind"] == "toy-half"
    snap = mlxkv.load(bun, model=model)
    assert all(isinstance(c, HalfKVCache) for c in snap.caches)
    assert greedy(model, snap.caches, first, 6)[0] == refs[0][1]

    # rows join one batch and decode as each alone; extracted rows are the serial caches
    rows = []
    for p in prompts:
        caches = mlxkv.make_cache(model, "toy-half")
        run(model, caches, p)
        rows.append(caches)
    batch = mlxkv.merge_model_rows(rows)
    assert {b.kind for b in batch} == {"kv:batched-toy-half"}
    y = mx.array([[first] for first, _ in refs])
    out = [[] for _ in prompts]
    for _ in range(6):
        logits = model(y, cache=batch)[:, -1]
        y = mx.argmax(logits, axis=-1)[:, None]
        for i, t in enumerate(y[:, 0].tolist()):
            out[i].append(t)
    assert out == [toks for _, toks in refs]
    back = mlxkv.extract_model_row(batch, 1)
    assert isinstance(back[0], HalfKVCache) and back[0].offset == len(prompts[1]) + 6

    # compiled decode through the family's decode step equals the eager step
    eager, comp = back, mlxkv.extract_model_row(batch, 1)
    dec = mlxkv.CompiledDecoder(model)
    y = mx.array([[refs[1][1][-1]]])
    for _ in range(4):
        a, b = model(y, cache=eager)[:, -1], dec(y, comp)[:, -1]
        assert mx.array_equal(a, b).item()
        y = mx.argmax(a, axis=-1)[:, None]
    assert dec.traces == 1 and comp[0].offset == eager[0].offset


def test_the_table_refuses_overlapping_families(toy):
    with pytest.raises(ValueError, match="registered already"):
        mlxkv.register_family(TOY)
    other = type("OtherCodec", (HalfCodec,), {"persisted": "other"})()
    with pytest.raises(ValueError, match="overlaps"):
        mlxkv.register_family(mlxkv.Family(HalfKVCache.kind, other))


def test_unregistered_family_is_unknown_again(models, tmp_path):
    mlxkv.register_family(TOY)
    model = models("llama")
    caches = mlxkv.make_cache(model, "toy-half")
    run(model, caches, prompt(5))
    path = str(tmp_path / "toy.safetensors")
    mlxkv.save(path, caches, prompt(5))
    mlxkv.unregister_family("toy-half")
    with pytest.raises(mlxkv.UnknownKindError, match="toy-half"):
        mlxkv.load(path)
    with pytest.raises(mlxkv.SchemeError):
        mlxkv.make_cache(model, "toy-half")


# -- every registered family: the record and the codec agree -------------------------------

SAMPLES = {
    "kv": ("llama", "bf16", {}),
    "qkv": ("llama", "kv4", {}),
    "rotating": ("gemma3", "bf16", {}),
    "rotating-qkv": ("llama", "kv8-g32", {"max_kv_size": 8}),
    "ssm": ("hybrid", "bf16", {}),
    "turboquant": ("llama", "turbo-k8v3", {}),
    "tova": ("llama", "tova-b8-s2", {}),
    "qfilters": ("llama", "qfilters-b8-s2-r2", {"calib_tokens": 4}),
}


@pytest.mark.parametrize("persisted", list(SAMPLES))
def test_the_codec_declares_what_it_writes(persisted, models):
    arch, scheme, options = SAMPLES[persisted]
    model = models(arch)
    caches = mlxkv.make_cache(model, scheme, **options)
    run(model, caches, prompt(12))
    run(model, caches, prompt(1))  # a bf16-first cache converts on this append
    family = family_of_persisted(persisted)
    cache = next(c for c in caches if family_of_kind(c.kind) is family)
    cache = getattr(cache, "inner", cache)
    codec = family.codec
    fields, slots = codec.encode(cache)
    assert list(fields) == list(codec.fields) == list(family.fields)
    names = [name for name, _ in slots]
    assert all(isinstance(a, mx.array) for _, a in slots) and np.all(names)
    if codec.slots:  # the declared order, optional slots left out
        assert names == [n for n in codec.slots if n in names]
    if codec.bun is not None:  # mlx-bun's form names the codec's own fields and slots
        assert set(codec.bun.fields(codec)) | set(codec.bun.implied) == set(codec.fields)
        assert codec.bun.slots is None or not codec.slots  # a bun form names slots only where the codec does not


def test_every_deferred_part_of_the_records_names_a_function_of_a_lower_layer():
    """The records name their live parts as ``Deferred("module:name")`` (reading the table
    imports no live cache): each names a function that exists, in the live caches' or the
    batched layouts' layer, below the records."""
    from mlxkv.families import Deferred, _resolved, row_merge
    from mlxkv.kinds import records

    deferred = [row_merge()]
    for family in records.FAMILIES:
        deferred += [family.rows, family.decode_step, family.batched_decode_step]
        deferred += [family.scheme[1]] if family.scheme is not None else []
    assert all(isinstance(d, Deferred) for d in deferred)
    for d in deferred:
        assert d.target.split(":")[0].startswith(("mlxkv.caches.", "mlxkv.batched.")), d.target
        assert callable(_resolved(d.target)), d.target
