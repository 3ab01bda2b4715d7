"""mlx-lm's batch-cache protocol on mlxkv's batched layouts, and the row rules a serving engine
relies on: right-padded prefill, deep copies, transactions, per-row trim, projected bytes,
conversion timing, and the options that would replace our caches."""

import copy
import hashlib
import json
import os

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlxkv
from mlxkv.batched.bf16first import Bf16FirstBatch
from mlxkv.caches.schemes import make_cache
from mlxkv.models.seeded import prompt, tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")


def stored(cache):
    """Every array a serial cache stores, cut to what it holds (what equality of rows means)."""
    cache = getattr(cache, "inner", cache)
    if cache.kind == "ssm":
        return [a for a in cache.cache if a is not None]
    if cache.kind.startswith("kv:turboquant"):
        return [] if cache.storage is None else [a[..., : cache.offset, :] for a in cache.storage]
    if hasattr(cache, "_temporal_order"):
        flat = lambda x: list(x) if isinstance(x, (tuple, list)) else [x]
        return (
            []
            if cache.keys is None
            else flat(cache._temporal_order(cache.keys)) + flat(cache._temporal_order(cache.values))
        )
    out = []
    n = cache.keys.shape[2] if hasattr(cache, "positions") and cache.keys is not None else cache.offset
    for name in ("keys", "values", "positions", "scores"):
        x = getattr(cache, name, None)
        for a in x if isinstance(x, (tuple, list)) else [x]:
            if a is not None:
                out.append(a[..., :n, :] if a.ndim == 4 else a[..., :n])
    return out


def same_rows(a, b) -> bool:
    """Two serial caches hold the same kind, position, floor and bytes."""
    if a.kind != b.kind or a.offset != b.offset or a.minimum_reusable_offset != b.minimum_reusable_offset:
        return False
    x, y = stored(a), stored(b)
    return len(x) == len(y) and all(p.dtype == q.dtype and mx.array_equal(p, q).item() for p, q in zip(x, y))


def prefilled(model, scheme, tokens):
    caches = make_cache(model, scheme)
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    return caches


# -- conversion timing: mlx-bun's rule --------------------------------------------------------


def test_a_snapshot_written_before_the_timing_change_still_loads_and_continues_exactly(models):
    """Files written when a due conversion waited for the next append (pendingConversion at
    offset >= start) convert as they load, at the position the old code converted at, and
    continue with the old code's tokens and logits, bit for bit."""
    model = models("llama")
    expected = json.load(open(os.path.join(DATA, "legacy-due.json")))
    for scheme, want in expected.items():
        path = os.path.join(DATA, f"legacy-due-{scheme}-llama.safetensors")
        assert all("pendingConversion" in e for e in mlxkv.read_header(path)["caches"])
        snap = mlxkv.load(path, model=model)
        for c in snap.caches:  # the old code read TurboQuant through the exact read (the decoded window)
            if mlxkv.is_turboquant_cache(getattr(c, "inner", c)):
                c.inner.codes = False
        assert snap.caches[0].kind == want["kind_after"]
        assert snap.caches[0].minimum_reusable_offset == want["minimum_reusable_offset_after"]
        y, toks, h = want["first_input"], [], hashlib.sha256()
        for _ in range(len(want["tokens"])):
            lg = model(mx.array([[y]]), cache=snap.caches)[0, -1]
            mx.eval(lg)
            h.update(np.array(lg.astype(mx.float32)).tobytes())
            y = int(mx.argmax(lg).item())
            toks.append(y)
        assert toks == want["tokens"] and h.hexdigest() == want["logits_sha256"], scheme


def test_conversion_happens_once_per_row_at_its_own_start_inside_a_batch(models):
    model = models("hybrid")
    rows = [prefilled(model, "turbo-k4v2-start16", prompt(n, seed=n)) for n in (6, 13, 15)]
    batch = mlxkv.merge_model_rows(rows)
    attn = [b for b in batch if b.kind.startswith("kv:batched-turbo")]
    assert attn and all(b.bf16_rows.tolist() == [0, 1, 2] for b in attn)
    for step in range(3):
        model(mx.array([[1], [2], [3]]), cache=batch)
        # after the append, rows at 16 have converted: 15+1 at step 0, 13+3 at step 2
        left = {0: [0, 1], 1: [0, 1], 2: [0]}[step]
        assert all(b.bf16_rows.tolist() == left for b in attn)
        floors = attn[0].row_minimum_reusable_offsets.tolist()
        assert floors[2] == 16 and floors[1] == (16 if step == 2 else 0) and floors[0] == 0


# -- right-padded prefill -------------------------------------------------------------------

PAD_CASES = [
    ("llama", "bf16"),
    ("llama", "kv4"),
    ("llama", "turbo-k4v2-start16"),
    ("llama", "tova-b32-s4"),  # the long row evicts inside the padded prefill
    ("llama", "qfilters-b32-s4-r8"),
    ("gemma3", "kv8-g32"),  # sliding-window rings of 32: the long row wraps
    ("hybrid", "kv4-start16"),  # recurrent state reads `lengths`
]


@pytest.mark.parametrize("arch,scheme", PAD_CASES)
def test_a_right_padded_prefill_gives_each_row_its_own_prefill(models, arch, scheme):
    """mlx-lm's prepare(lengths=, right_padding=) / finalize(): a row's padding is never
    stored, evicted for, converted on or attended by its tokens."""
    model = models(arch)
    lens = (7, 45, 20)
    ps = [prompt(n, seed=40 + n) for n in lens]
    batch = mlxkv.merge_model_rows([make_cache(model, scheme) for _ in ps])
    L = max(lens)
    for c in batch:
        c.prepare(lengths=list(lens), right_padding=[L - n for n in lens])
    logits = model(mx.array([p + [0] * (L - len(p)) for p in ps]), cache=batch)
    for c in batch:
        c.finalize()
    for i, p in enumerate(ps):
        serial = make_cache(model, scheme)
        ref = model(mx.array(p)[None], cache=serial)
        assert mx.array_equal(logits[i, : len(p)], ref[0]), i
        assert all(same_rows(a, b) for a, b in zip(mlxkv.extract_model_row(batch, i), serial)), i
        nxt = model(mx.array([[9]]), cache=serial)
        assert mx.array_equal(model(mx.array([[9]]), cache=mlxkv.extract_model_row(batch, i))[0], nxt[0])
    assert [int(o) for o in batch[1 if arch == "hybrid" else 0].offset.tolist()] == list(lens)


def test_left_padding_is_refused_with_a_clear_error(models):
    batch = mlxkv.merge_model_rows([make_cache(models("llama"), "bf16")] * 2)
    with pytest.raises(mlxkv.MLXKVError, match="lengths= and right_padding="):
        batch[0].prepare(left_padding=[1, 0])


# -- deep copies ------------------------------------------------------------------------------


def _snapshot_arrays(caches):
    flat = []
    for c in caches:
        for a in stored(c):
            flat.append(np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a))
    return flat


@pytest.mark.parametrize(
    "scheme", ["bf16", "kv4", "kv4-start16", "turbo-k8v3", "turbo-k4v2-start16", "qfilters-b32-s4-r8"]
)
def test_deepcopy_gives_independent_serial_and_batched_caches(models, scheme):
    model = models("hybrid")
    fresh = make_cache(model, scheme)
    before = copy.deepcopy(fresh)  # before any append (and before a bf16-first conversion)
    caches = prefilled(model, scheme, prompt(12))  # short of start16; turbo-k8v3 converted
    twin = copy.deepcopy(caches)
    assert len({id(c.masks) for c in twin}) == 1 and twin[0].masks is not caches[0].masks
    kept = _snapshot_arrays(caches)
    model(mx.array([prompt(8, seed=3)]), cache=twin)  # reaches 20: the copy converts, the original not
    assert all(np.array_equal(x, y) for x, y in zip(kept, _snapshot_arrays(caches)))
    assert [c.offset for c in caches if c.kind != "ssm"][0] == 12 and before[1].offset == 0
    batch = mlxkv.merge_model_rows([caches, twin, before])
    copied = copy.deepcopy(batch)
    arrays = lambda: [a for b in batch for a in _batch_arrays(b)]
    kept = [np.array(a.astype(mx.float32)) for a in arrays()]
    model(mx.array([[1], [2], [3]]), cache=copied)
    assert all(np.array_equal(x, np.array(a.astype(mx.float32))) for x, a in zip(kept, arrays()))
    assert [b.batch_size for b in batch] == [3] * len(batch)
    again = copy.deepcopy(batch)  # a copy continues exactly as the original does
    y = mx.array([[4], [5], [6]])
    assert mx.array_equal(model(y, cache=batch), model(y, cache=again))


def _batch_arrays(b):
    if b.kind == "kv:batched-ssm":
        return [a for a in b.cache if a is not None]
    if isinstance(b, Bf16FirstBatch):
        return _batch_arrays(b.target) + ([] if b.bf16 is None else _batch_arrays(b.bf16))
    return list(b.key_arrays or ()) + list(b.value_arrays or ())


# -- transactions -----------------------------------------------------------------------------


def _state(batch):
    return [
        (b.kind, b.offset.tolist(), [np.array(a.astype(mx.float32)).tobytes() for a in _batch_arrays(b)]) for b in batch
    ]


@pytest.mark.parametrize("op", ["extend", "filter", "trim"])
def test_row_changes_apply_to_every_layer_or_to_none(models, monkeypatch, op):
    """A failure in a middle layer leaves every layer as it was; the batch still decodes."""
    model = models("llama")
    rows = [prefilled(model, "turbo-k4v2-start16", prompt(n, seed=n)) for n in (9, 20, 14)]
    batch = mlxkv.merge_model_rows(rows[:2])
    model(mx.array([[1], [2]]), cache=batch)
    before = _state(batch)
    cls = type(batch[2])
    name = {"extend": "extend_rows", "filter": "filter_rows", "trim": "trim_rows"}[op]
    real = getattr(cls, name)

    def failing(self, *a, **k):
        if self is batch[2]:
            raise RuntimeError("injected failure in layer 2")
        return real(self, *a, **k)

    monkeypatch.setattr(cls, name, failing)
    with pytest.raises(RuntimeError, match="injected"):
        if op == "extend":
            mlxkv.extend_model_rows(batch, rows[2])
        elif op == "filter":
            mlxkv.filter_model_rows(batch, [1])
        else:
            mlxkv.trim_model_rows(batch, [2, 1])
    assert _state(batch) == before
    monkeypatch.setattr(cls, name, real)
    ref = [prefilled(model, "turbo-k4v2-start16", prompt(n, seed=n)) for n in (9, 20)]
    for r, y in zip(ref, (1, 2)):
        model(mx.array([[y]]), cache=r)
    lb = model(mx.array([[3], [4]]), cache=batch)
    for i, (r, y) in enumerate(zip(ref, (3, 4))):
        assert mx.array_equal(lb[i], model(mx.array([[y]]), cache=r)[0])


# -- per-row trim (speculative decoding's rollback) -----------------------------------------


@pytest.mark.parametrize("scheme", ["bf16", "kv4", "kv4-start4", "turbo-k4v2-start16", "qfilters-b32-s4-r8"])
def test_trimming_each_row_by_its_own_count_gives_the_serial_twin(models, scheme):
    model = models("llama")
    lens, drafts, counts = (6, 18, 11), (4, 5, 3), [3, 0, 2]
    serial = [prefilled(model, scheme, prompt(n, seed=n)) for n in lens]
    batch = mlxkv.merge_model_rows([prefilled(model, scheme, prompt(n, seed=n)) for n in lens])
    draft = [prompt(d, seed=60 + i) for i, d in enumerate(drafts)]
    for t in range(max(drafts)):  # each row drafts its tokens (rows with fewer repeat their last)
        toks = [[d[min(t, len(d) - 1)]] for d in draft]
        model(mx.array(toks), cache=batch)
        for s, tok in zip(serial, toks):
            model(mx.array([tok]), cache=s)
    mlxkv.trim_model_rows(batch, counts)
    for s, n in zip(serial, counts):
        for c in s:
            c.trim(n)
    for i, s in enumerate(serial):
        assert all(same_rows(a, b) for a, b in zip(mlxkv.extract_model_row(batch, i), s)), i
    lb = model(mx.array([[7], [8], [9]]), cache=batch)
    for i, (s, y) in enumerate(zip(serial, (7, 8, 9))):
        ls = model(mx.array([[y]]), cache=s)
        assert mx.array_equal(lb[i], ls[0]), i


def test_a_row_that_cannot_trim_refuses_before_anything_changes(models):
    model = models("llama")
    batch = mlxkv.merge_model_rows([prefilled(model, "tova-b8-s2", prompt(n, seed=n)) for n in (5, 12)])
    before = _state(batch)
    with pytest.raises(mlxkv.CacheConfigError, match="row 1 cannot trim 1"):
        mlxkv.trim_model_rows(batch, [1, 1])  # row 1 has evicted
    assert _state(batch) == before
    with pytest.raises(mlxkv.CacheConfigError, match="recurrent state cannot be trimmed"):
        mlxkv.trim_model_rows(mlxkv.merge_model_rows([prefilled(models("hybrid"), "bf16", prompt(5))]), [1])


# -- projected bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["bf16", "kv4", "turbo-k8v3", "kv4-start16", "kv4-start512", "tova-b32-s4"])
def test_projected_bytes_tell_what_a_join_and_a_longer_generation_cost(models, scheme):
    """kv4-start16: every row converts during the generation; kv4-start512: none does."""
    model = models("hybrid")
    batch = mlxkv.merge_model_rows([prefilled(model, scheme, prompt(n, seed=n)) for n in (12, 30)])
    model(mx.array([[1], [2]]), cache=batch)
    joining, tokens = [40, 7], 300
    projected = mlxkv.projected_bytes(batch, rows=joining, tokens=tokens)
    mlxkv.extend_model_rows(batch, [prefilled(model, scheme, prompt(n, seed=n)) for n in joining])
    for _ in range(tokens):
        model(mx.array([[3]] * 4), cache=batch)
    actual = sum(b.nbytes for b in batch)
    step = 0  # one allocation step of every row (of the plain rows too, while they are plain)
    for b in batch:
        t = getattr(b, "target", b)
        if hasattr(t, "_column_bytes"):
            step += t._column_bytes() * t.batch_size * t.step
        if isinstance(b, Bf16FirstBatch):
            step += b._bf16_column_bytes() * t.batch_size * t.step
    assert abs(projected - actual) <= step, (projected, actual, step)
    assert mlxkv.projected_bytes(batch) >= actual - step


# -- options that would replace our caches ------------------------------------------------


@pytest.mark.parametrize("scheme", ["bf16", "turbo-k8v3", "kv4-start16"])
def test_kv_bits_is_refused_instead_of_replacing_the_caches(models, scheme):
    model, tok = models("llama"), tokenizer()
    caches = make_cache(model, scheme)
    kinds = [type(c) for c in caches]
    with pytest.raises(mlxkv.SchemeError, match=r"kv_bits=4 would replace this .*mlxkv.make_cache\(model, 'kv4-g64'\)"):
        mlx_lm.generate(model, tok, prompt(20), max_tokens=3, prompt_cache=caches, kv_bits=4, quantized_kv_start=0)
    assert [type(c) for c in caches] == kinds  # nothing was swapped
    # refused at the first step, far below mlx-lm's default quantized_kv_start (5000)
    with pytest.raises(mlxkv.SchemeError, match="kv_bits=4 would replace"):
        list(generate_step(mx.array(prompt(8)), model, max_tokens=2, prompt_cache=caches, kv_bits=4))
    assert [type(c) for c in caches] == kinds


# -- what mlx-lm's code reads off a batch ------------------------------------------------------


def test_a_batch_shows_keys_and_values_as_mlx_lms_batch_cache_does(models):
    """mlx-lm's own ``BatchKVCache.merge`` of the same serial caches is the yardstick: one
    ``[B, H, T, D]`` array each, the rows in the same columns, ``keys_and_values()`` the same
    cut. mlx-lm's pipeline-parallel models assign ``cache[-1].keys = mx.depends(cache[-1].keys,
    h)``: the batch then decodes as before (affine rows show and take their triples)."""
    from mlx_lm.models.cache import BatchKVCache

    model = models("llama")
    rows = [prefilled(model, "bf16", prompt(n, seed=n)) for n in (5, 12, 9)]
    ours = mlxkv.merge_rows([r[0] for r in rows])
    theirs = BatchKVCache.merge([r[0] for r in rows])
    for mine, yard in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
        assert isinstance(mine, mx.array) and mine.ndim == 4 and mine.shape[:2] == yard.shape[:2]
        assert mx.array_equal(mine[..., : yard.shape[2], :], yard)
    for mine, yard in zip(ours.keys_and_values(), theirs.keys_and_values()):
        assert mine.shape == yard.shape and mx.array_equal(mine, yard)
    for scheme in ("bf16", "kv4", "kv4-start16"):
        batch, twin = (mlxkv.merge_model_rows([prefilled(model, scheme, prompt(n)) for n in (5, 20)]) for _ in "ab")
        h = mx.ones((1,))
        batch[-1].keys = mx.depends(batch[-1].keys, h)  # as mlx-lm's qwen2 pipeline does
        shown = batch[-1].keys
        assert (len(shown) == 3) if scheme != "bf16" else isinstance(shown, mx.array)
        y = mx.array([[3], [4]])
        assert mx.array_equal(model(y, cache=batch), model(y, cache=twin)), scheme


def test_recurrent_rows_merged_empty_give_mlx_lms_mask_and_join_any_batch():
    """mlx-lm's own test_arrays_cache_extend_with_empty on mlxkv's recurrent rows: rows merged
    before they hold state carry mlx-lm's zero left padding (an all-True ``[B, N]`` mask, not
    None) into every batch they join, and a serial row joins a batch as mlx-lm's does."""
    from mlx_lm.models import cache as mlx_cache

    def row(state):
        c = mlxkv.ArraysCache(2)
        if state:
            c[0], c[1] = mx.zeros((1, 4, 8)), mx.zeros((1, 4))
        return c

    for cls in (mlx_cache.ArraysCache, mlxkv.ArraysCache):  # mlx-lm's, then mlxkv's: the same answers
        make = (lambda s: mlx_cache.ArraysCache(2) if not s else row(True)) if cls is mlx_cache.ArraysCache else row
        empty = cls.merge([make(False), make(False)])
        content = cls.merge([make(True), make(True)])
        content.extend(empty)
        assert content[0].shape == (4, 4, 8) and content[1].shape == (4, 4)
        assert content.make_mask(10).shape == (4, 10) and content.make_mask(10).all().item()
        empty = cls.merge([make(False), make(False)])
        empty.extend(cls.merge([make(True), make(True)]))
        assert empty[0].shape == (4, 4, 8)
        stepwise = cls.merge([make(True)])
        stepwise.extend(make(False))
        stepwise.extend(cls.merge([make(False), make(False)]))
        assert stepwise[0].shape == (4, 4, 8) and stepwise[1].shape == (4, 4)
    assert mlxkv.merge_rows([row(True)]).make_mask(3) is None  # rows with state: no mask, as mlx-lm's
