"""Batched rows (docs/batched.md): a batch of rows decodes as each row alone would, and
rows join, leave and come back out as owned serial caches that save and continue exactly."""

import os

import mlx.core as mx
import numpy as np
import pytest

import mlxkv
from mlxkv.caches.schemes import make_cache
from mlxkv.families import families, family_of_batched_kind, family_of_kind
from mlxkv.models.seeded import prompt

# (arch, scheme, make_cache options, serial kinds of the rows once settled)
CASES = {
    "plain": ("llama", "bf16", {}, {"kv:plain"}),
    "quant": ("llama", "kv4", {}, {"kv:quant:4:64"}),
    "ring-sliding": ("gemma3", "bf16", {}, {"kv:rotating-plain", "kv:plain"}),
    "ring-keep": ("llama", "bf16", {"max_kv_size": 16}, {"kv:rotating-plain"}),
    "ring-quant": ("llama", "kv8-g32", {"max_kv_size": 16}, {"kv:rotating-quant:8:32"}),
    "ssm": ("hybrid", "bf16", {}, {"ssm", "kv:plain"}),
    # bf16-first: a row joins after its prefill, when its next append converts it
    "turboquant": ("llama", "turbo-k4v3", {}, {"kv:turboquant:4:3"}),
    # bf16-first with rows of both precisions: the 5- and 23-token rows are short of their
    # start when they join (the 23-token row converts at its first append), the 40-token row not
    "quant-bf16-first": ("llama", "kv4-start24", {}, {"kv:quant:4:64"}),
    # budgets below the prompt lengths: rows evict before and while they share a batch
    "tova": ("llama", "tova-b16-s2", {}, {"kv:tova:16:2"}),
    "qfilters-fallback": ("llama", "qfilters-b16-s2-r4", {"calib_tokens": 8}, {"kv:qfilters:16:2:4"}),
    "qfilters-calibrated": ("llama", "qfilters-b16-s2-r4", {"filters": "seeded"}, {"kv:qfilters:16:2:4"}),
}
BATCHED = {
    "kv:plain": "kv:batched-plain",
    "kv:quant:4:64": "kv:batched-quant:4:64",
    "kv:rotating-plain": "kv:batched-rotating-plain",
    "kv:rotating-quant:8:32": "kv:batched-rotating-quant:8:32",
    "ssm": "kv:batched-ssm",
    "kv:turboquant:4:3": "kv:batched-turboquant:4:3",
    "kv:tova:16:2": "kv:batched-tova:16:2",
    "kv:qfilters:16:2:4": "kv:batched-qfilters:16:2:4",
}

LENS = (5, 40, 23)  # rows 1 and 2 have wrapped the 16-position rings before they join
#: logits are bit for bit the serial ones, except the quantized ring's: a wrapped serial ring
#: attends its positions in ring order, the batch in temporal order, and mlx.quantized_matmul's
#: bf16 sum depends on the order (measured 0.06 at most)
RING_QUANT_ATOL = 0.1


def atol(case: str) -> float:
    return RING_QUANT_ATOL if case == "ring-quant" else 0.0


def f32(x):
    return x.astype(mx.float32)


def seeded_filters():
    f = mx.random.normal((2, 64), key=mx.random.key(3))  # [H_kv, D] of the seeded llama
    return f / mx.linalg.norm(f, axis=-1, keepdims=True)


class Requests:
    """Serial references: each request's caches and the tokens they encode."""

    def __init__(self, model, scheme, options):
        if options.get("filters") == "seeded":
            options = {**options, "filters": seeded_filters()}
        self.model, self.scheme, self.options = model, scheme, options

    def fresh(self, tokens):
        caches = make_cache(self.model, self.scheme, **self.options)
        logits = self.model(mx.array(tokens)[None], cache=caches)[:, -1]
        mx.eval(logits)
        return caches, logits


def serial_greedy(model, caches, first, n):
    toks, logs, y = [], [], first
    for _ in range(n):
        lg = model(mx.array([[y]]), cache=caches)[0, -1]
        mx.eval(lg)
        logs.append(lg)
        y = int(mx.argmax(lg).item())
        toks.append(y)
    return toks, logs


def batched_greedy(model, batch, firsts, n):
    toks, logs, y = [[] for _ in firsts], [[] for _ in firsts], mx.array(firsts)[:, None]
    for _ in range(n):
        lg = model(y, cache=batch)[:, -1]
        mx.eval(lg)
        y = mx.argmax(lg, -1)[:, None]
        for i, t in enumerate(y[:, 0].tolist()):
            toks[i].append(t)
            logs[i].append(lg[i])
    return toks, logs


def close(a, b, case):
    return bool(mx.allclose(f32(a), f32(b), atol=atol(case), rtol=0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_greedy_decode_matches_each_row_alone(models, case):
    arch, scheme, options, serial_kinds = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS)]
    rows, firsts, refs = [], [], []
    for p in prompts:
        caches, logits = req.fresh(p)
        rows.append(caches)
        firsts.append(int(mx.argmax(logits[0]).item()))
        refs.append(serial_greedy(model, req.fresh(p)[0], firsts[-1], 8))
    batch = mlxkv.merge_model_rows(rows)
    assert {b.kind for b in batch} == {BATCHED[k] for k in serial_kinds}
    for b in batch:  # batched layouts have no codec
        with pytest.raises(mlxkv.UnknownKindError, match="extract rows"):
            family_of_kind(b.kind)
    assert [b.offset.tolist() for b in batch if b.kind != "kv:batched-ssm"][0] == list(LENS)
    toks, logs = batched_greedy(model, batch, firsts, 8)
    for i, (ref_toks, ref_logs) in enumerate(refs):
        assert toks[i] == ref_toks, f"row {i}"
        assert all(close(a, b, case) for a, b in zip(logs[i], ref_logs)), f"row {i}"


def teacher_forced(model, batch, serial, live, stream, pos, chunk):
    """Feed the next ``chunk`` tokens of each live request to the batch and to its serial
    reference; returns the largest logit difference."""
    toks = [stream[r][pos[r] : pos[r] + chunk] for r in live]
    lb = model(mx.array(toks), cache=batch)
    worst = 0.0
    for bi, r in enumerate(live):
        ls = model(mx.array(toks[bi])[None], cache=serial[r])
        worst = max(worst, float(mx.abs(f32(lb[bi]) - f32(ls[0])).max()))
        pos[r] += chunk
    return worst


@pytest.mark.parametrize("case", sorted(CASES))
def test_filter_extend_and_multi_token_appends_continue_each_row(models, case):
    arch, scheme, options, _ = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS + (11,))]
    stream = [prompt(30, seed=50 + i) for i in range(4)]
    serial = [req.fresh(p)[0] for p in prompts]
    batch = mlxkv.merge_model_rows([req.fresh(p)[0] for p in prompts[:3]])
    live, pos, worst = [0, 1, 2], [0] * 4, 0.0
    for chunk in (1, 1, 4, 1):
        worst = max(worst, teacher_forced(model, batch, serial, live, stream, pos, chunk))
    mlxkv.filter_model_rows(batch, [2, 0])
    live = [2, 0]
    assert [b.batch_size for b in batch] == [2] * len(batch)
    for chunk in (1, 3):
        worst = max(worst, teacher_forced(model, batch, serial, live, stream, pos, chunk))
    mlxkv.extend_model_rows(batch, req.fresh(prompts[3])[0])
    live = [2, 0, 3]
    for chunk in (1, 1, 2):
        worst = max(worst, teacher_forced(model, batch, serial, live, stream, pos, chunk))
    assert worst <= atol(case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_extracted_row_is_an_owned_serial_cache_that_continues_the_row(models, case):
    arch, scheme, options, serial_kinds = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS)]
    batch = mlxkv.merge_model_rows([req.fresh(p)[0] for p in prompts])
    model(mx.array([[7], [8], [9]]), cache=batch)
    row = mlxkv.extract_model_row(batch, 1)
    assert {c.kind for c in row} == serial_kinds
    assert all(c.offset == LENS[1] + 1 for c in row if c.kind != "ssm")
    assert len({id(c.masks) for c in row}) == 1
    before = [np.array(f32(a)) for c in row for a in _arrays(c)]
    assert before
    # the batch moves on: the extracted row must not change
    lb = model(mx.array([[3], [4], [5]]), cache=batch)
    assert all(np.array_equal(x, np.array(f32(a))) for x, (a) in zip(before, [a for c in row for a in _arrays(c)]))
    # the row continues exactly as the batched row did
    le = model(mx.array([[4]]), cache=row)
    assert close(le[0], lb[1], case)
    # and its own appends never reach the batch: extract again and compare
    again = mlxkv.extract_model_row(batch, 1)
    model(mx.array([[1, 2]]), cache=row)
    l1 = model(mx.array([[6]]), cache=again)
    l2 = model(mx.array([[6], [6], [6]]), cache=batch)
    assert close(l1[0], l2[1], case)


def _arrays(cache):
    """Every array a serial cache stores (what a later write could corrupt)."""
    if cache.kind == "ssm":
        return [a for a in cache.cache if a is not None]
    found = []
    for name in ("keys", "values", "storage", "positions", "scores"):
        x = getattr(cache, name, None)
        found += list(x) if isinstance(x, (tuple, list)) else [x]
    return [a for a in found if a is not None]


@pytest.mark.parametrize("case", sorted(CASES))
def test_extracted_row_saves_loads_and_joins_another_batch_exactly(models, case, tmp_path):
    arch, scheme, options, _ = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS)]
    batch = mlxkv.merge_model_rows([req.fresh(p)[0] for p in prompts])
    firsts = [int(t) for t in mx.argmax(model(mx.array([[7], [8], [9]]), cache=batch)[:, -1], -1).tolist()]
    tokens = prompts[2] + [9]
    path = str(tmp_path / "row.safetensors")
    mlxkv.save(path, mlxkv.extract_model_row(batch, 2), tokens)
    loaded = mlxkv.load(path, model=model)
    assert loaded.tokens == tokens
    # reference: the same request never stopped
    ref_caches, _ = req.fresh(prompts[2])
    model(mx.array([[9]]), cache=ref_caches)
    ref_toks, ref_logs = serial_greedy(model, ref_caches, firsts[2], 6)
    other, lg = req.fresh(prompt(17, seed=99))
    joined = mlxkv.merge_model_rows([other, loaded.caches])
    toks, logs = batched_greedy(model, joined, [int(mx.argmax(lg[0]).item()), firsts[2]], 6)
    assert toks[1] == ref_toks
    assert all(close(a, b, case) for a, b in zip(logs[1], ref_logs))


def test_saving_a_batched_cache_raises_before_writing(models, tmp_path):
    model = models("llama")
    rows = [make_cache(model, "kv4") for _ in range(2)]
    for r in rows:
        model(mx.array(prompt(6))[None], cache=r)
    batch = mlxkv.merge_model_rows(rows)
    path = tmp_path / "batch.safetensors"
    with pytest.raises(mlxkv.UnknownKindError, match="kv:batched-quant:4:64"):
        mlxkv.save(str(path), batch, prompt(6))
    assert not path.exists() and os.listdir(tmp_path) == []


class _Odd:
    kind = "kv:nonsense:1"
    offset = 3


def test_unknown_and_mixed_kinds_raise_naming_them(models):
    with pytest.raises(mlxkv.UnknownKindError, match="kv:nonsense:1"):
        mlxkv.merge_rows([_Odd(), _Odd()])
    with pytest.raises(mlxkv.UnknownKindError, match="kv:nonsense:1"):
        mlxkv.merge_rows([mlxkv.KVCache(), _Odd()])
    with pytest.raises(mlxkv.CacheConfigError, match="kv:quant:4:64"):
        mlxkv.merge_rows([mlxkv.KVCache(), mlxkv.QuantizedKVCache(bits=4)])
    with pytest.raises(mlxkv.CacheConfigError, match="ring size"):
        mlxkv.merge_rows([mlxkv.RotatingKVCache(16), mlxkv.RotatingKVCache(32)])
    with pytest.raises(mlxkv.MLXKVError, match="at least one"):
        mlxkv.merge_rows([])
    batch = mlxkv.merge_rows([mlxkv.KVCache()])
    with pytest.raises(mlxkv.CacheConfigError, match="kv:batched-quant"):
        mlxkv.extend(batch, mlxkv.merge_rows([mlxkv.QuantizedKVCache(bits=4)]))
    with pytest.raises(IndexError):
        mlxkv.extract_row(batch, 3)
    fake = type("FakeBatch", (), {"kind": "kv:batched-wat", "extract_row": lambda self, i: None})()
    with pytest.raises(mlxkv.UnknownKindError, match="kv:batched-wat"):
        mlxkv.extract_row(fake, 0)
    # every family with a row layout is found again from its batched kind
    for f in families():
        assert (
            f.rows is not None
            and family_of_batched_kind(f.batched_kind + ("4:64" if f.kind.endswith(":") else "")) is f
        )


def test_bf16_first_rows_join_before_their_start(models):
    """A row short of its start joins and attends bf16; a converted row attends its codes;
    each converts at its own boundary and comes back out as its serial twin."""
    model = models("llama")
    early, due = make_cache(model, "kv4-start8"), make_cache(model, "kv4-start8")
    model(mx.array(prompt(5))[None], cache=early)
    model(mx.array(prompt(9))[None], cache=due)
    assert early[0].kind == "kv:plain" and due[0].kind == "kv:quant:4:64"  # converted at the end of its prefill
    batch = mlxkv.merge_model_rows([early, due])
    assert batch[0].kind == "kv:batched-quant:4:64" and batch[0].row_minimum_reusable_offsets.tolist() == [0, 9]
    assert early[0].kind == "kv:plain" and early[0].offset == 5  # the caller's rows are untouched
    for step in range(4):  # the early row reaches 8 after three more tokens
        lb = model(mx.array([[5 + step], [6 + step]]), cache=batch)
        l0 = model(mx.array([[5 + step]]), cache=early)
        l1 = model(mx.array([[6 + step]]), cache=due)
        assert mx.array_equal(lb[0], l0[0])  # bf16 while short of its start, then its codes
        assert mx.array_equal(lb[1], l1[0])  # its codes beside bf16 rows: mlx-lm's quantized SDPA
    assert early[0].kind == "kv:quant:4:64" and early[0].minimum_reusable_offset == 8
    for row, twin in zip((mlxkv.extract_model_row(batch, 0), mlxkv.extract_model_row(batch, 1)), (early, due)):
        assert row[0].kind == twin[0].kind and row[0].minimum_reusable_offset == twin[0].minimum_reusable_offset
        pairs = zip(_arrays(row[0].inner), _arrays(twin[0].inner))
        assert all(mx.array_equal(a, b[..., : a.shape[2], :]) for a, b in pairs)


def test_the_layers_of_a_batch_share_one_append_plan_and_offsets(models):
    """The plan and the next offsets are computed once per forward: after a decode step every
    layer holds the same ``Columns`` and offset arrays, and the step gives the tokens of the
    rows' serial caches."""
    model = models("llama")
    rows = [make_cache(model, "bf16") for _ in range(3)]
    for n, r in zip(LENS, rows):
        model(mx.array(prompt(n))[None], cache=r)
    serial = [
        model(mx.array([[7]]), cache=r)[0, -1]
        for r in [mlxkv.extract_model_row(mlxkv.merge_model_rows(rows), i) for i in range(3)]
    ]
    batch = mlxkv.merge_model_rows(rows)
    out = model(mx.array([[7], [7], [7]]), cache=batch)
    for b in batch[1:]:
        assert b.cols is batch[0].cols and b.offsets is batch[0].offsets and b.offset is batch[0].offset
    assert batch[0].offsets.tolist() == [n + 1 for n in LENS]
    for i, s in enumerate(serial):
        assert mx.argmax(out[i, -1]).item() == mx.argmax(s).item()


def test_one_mask_per_forward_shared_with_the_rows(models):
    model = models("gemma3")
    rows = [make_cache(model, "bf16") for _ in range(3)]
    for n, r in zip(LENS, rows):
        model(mx.array(prompt(n))[None], cache=r)
    batch = mlxkv.merge_model_rows(rows)
    assert all(b.masks is rows[0][0].masks for b in batch)
    masks = batch[0].masks
    before = masks.builds
    y = mx.array([[1], [2], [3]])
    model(y, cache=batch)
    assert masks.builds - before == 2  # one sliding-window mask, one global mask
    m = batch[1].make_mask(1)
    assert m.shape == (3, 1, 1, max(LENS) + 2) and batch[1].make_mask(1) is m
    # the padding of the short row is hidden, its own positions are not
    assert m[0, 0, 0].tolist() == [False] * (max(LENS) - LENS[0]) + [True] * (LENS[0] + 2)


def test_repacking_after_many_appends_keeps_rows_exact(models, monkeypatch):
    """A tiny slack forces the buffer to be packed again and again (rings evict meanwhile)."""
    from mlxkv.batched.attention import BatchedKVCache

    monkeypatch.setattr(BatchedKVCache, "step", 3)
    for case in ("ring-keep", "plain"):
        arch, scheme, options, _ = CASES[case]
        model = models(arch)
        req = Requests(model, scheme, options)
        prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS)]
        stream = [prompt(30, seed=70 + i) for i in range(3)]
        serial = [req.fresh(p)[0] for p in prompts]
        batch = mlxkv.merge_model_rows([req.fresh(p)[0] for p in prompts])
        pos, worst = [0, 0, 0], 0.0
        for chunk in (1,) * 12 + (2, 1, 1):
            worst = max(worst, teacher_forced(model, batch, serial, [0, 1, 2], stream, pos, chunk))
        assert worst == 0.0
        assert batch[0].capacity <= max(LENS) + 17 + 3


def test_trim_and_block_reads_respect_each_row(models):
    model = models("llama")
    rows = [make_cache(model, "bf16") for _ in range(2)]
    for n, r in zip((4, 9), rows):
        model(mx.array(prompt(n))[None], cache=r)
    batch = mlxkv.merge_model_rows(rows)
    b = batch[0]
    assert b.is_trimmable() and b.trim(2) == 2 and b.offset.tolist() == [2, 7]
    assert b.extract_row(0).offset == 2
    k = mx.random.normal((2, 2, 3, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    q = mx.random.normal((2, 4, 3, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    out = b.read_block(k, k).attend(q, 0.125)
    for i in range(2):
        alone = b.extract_row(i).read_block(k[i : i + 1], k[i : i + 1]).attend(q[i : i + 1], 0.125)
        assert mx.allclose(f32(out[i : i + 1]), f32(alone), atol=1e-2)
    assert b.offset.tolist() == [2, 7]  # a block read appends nothing
    ssm = mlxkv.merge_model_rows([make_cache(models("hybrid"), "bf16")])[0]
    assert not ssm.is_trimmable() and ssm.trim(1) == 0


def _in_order(cache):
    """Stored arrays in temporal order (a serial ring keeps its rotated layout)."""
    if not hasattr(cache, "_temporal_order"):
        return _arrays(cache)
    flat = lambda x: list(x) if isinstance(x, tuple) else [x]
    return flat(cache._temporal_order(cache.keys)) + flat(cache._temporal_order(cache.values))


SURGERY_CASES = ["quant", "ring-quant", "turboquant", "tova", "qfilters-fallback"]


@pytest.mark.parametrize("case", SURGERY_CASES)
def test_row_surgery_copies_stored_bytes(models, case):
    """merge -> extend -> filter -> extract hands back each row's stored arrays bit for bit
    (affine triples, TurboQuant codes, kept positions and scores: nothing re-encoded)."""
    arch, scheme, options, _ = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    rows = []
    for i, n in enumerate(LENS):
        caches, _ = req.fresh(prompt(n, seed=10 + i))
        model(mx.array([[3]]), cache=caches)  # bf16-first rows convert now, serially
        rows.append(caches)
    batch = mlxkv.merge_model_rows(rows[:2])
    mlxkv.extend_model_rows(batch, rows[2])
    mlxkv.filter_model_rows(batch, [2, 1])
    for bi, r in ((0, 2), (1, 1)):
        for got, want in zip(mlxkv.extract_model_row(batch, bi), rows[r]):
            a, b = _in_order(got), _in_order(want)
            assert got.kind == want.kind and got.offset == want.offset and len(a) == len(b) > 0
            for x, y in zip(a, b):
                n = x.shape[2]
                assert x.dtype == y.dtype and mx.array_equal(x, y[:, :, :n]), (got.kind, x.dtype)


@pytest.mark.parametrize("case", ["tova", "qfilters-fallback", "qfilters-calibrated"])
def test_eviction_rows_keep_the_serial_kept_sets(models, case):
    """Rows that evict inside the batch keep exactly the rows, positions, scores and filters
    each would keep alone; padding positions are -1 and masked."""
    arch, scheme, options, _ = CASES[case]
    model = models(arch)
    req = Requests(model, scheme, options)
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(LENS)]
    stream = [prompt(40, seed=50 + i) for i in range(3)]
    serial = [req.fresh(p)[0] for p in prompts]
    batch = mlxkv.merge_model_rows([req.fresh(p)[0] for p in prompts])
    pad = np.array(batch[0].key_arrays[1][0, :, : 16 - LENS[0], 0])  # rows 1 and 2 hold the budget
    assert (
        pad.size
        and (pad == -1).all()
        and batch[0].make_mask(1)[0, 0, 0, : pad.shape[1]].tolist() == [False] * pad.shape[1]
    )
    pos = [0, 0, 0]
    for chunk in (1, 1, 5, 1, 1, 3, 1, 1, 1, 1):
        teacher_forced(model, batch, serial, [0, 1, 2], stream, pos, chunk)
    assert all(c.offset == LENS[0] + sum(pos) // 3 for c in serial[0])
    for i in range(3):
        for got, want in zip(mlxkv.extract_model_row(batch, i), serial[i]):
            assert want.rows == 16 and got.offset == want.offset
            assert mx.array_equal(got.positions, want.positions)
            if case.startswith("qfilters"):
                assert mx.array_equal(got.scores, want.scores) and got.calibrated == want.calibrated
                assert mx.array_equal(got.filter, want.filter)


def test_mlx_lm_merge_entry_point_builds_an_mlxkv_layout():
    """mlx-lm batches through ``type(cache).merge``: it must not get a kind-less mlx-lm batch."""
    rows = []
    for n in (3, 5):
        c = mlxkv.KVCache()
        x = mx.ones((1, 2, n, 64), mx.bfloat16)
        c.update_and_fetch(x, x)
        rows.append(c)
    batch = type(rows[0]).merge(rows)
    assert batch.kind == "kv:batched-plain" and batch.offset.tolist() == [3, 5]
    with pytest.raises(mlxkv.RowIndexError):
        mlxkv.extract_row(batch, 2)


def test_mlx_lms_quantized_attention_is_unchanged_for_every_other_cache():
    """mlxkv wraps mlx-lm's quantized SDPA once (``caches.routed_reads``) to route its split
    reads; any other keys (here mlx-lm's own ``QuantizedKVCache``) reach mlx-lm's function
    with the same arguments and give the same bits."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantized

    from mlxkv.caches.routed_reads import install_route

    wrapped = base.quantized_scaled_dot_product_attention
    install_route()
    assert base.quantized_scaled_dot_product_attention is wrapped and wrapped.routes_mlxkv_reads
    cache = MlxLmQuantized(group_size=64, bits=4)
    kv = mx.random.normal((2, 2, 37, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    keys, values = cache.update_and_fetch(kv, kv * 0.5)
    q = mx.random.normal((2, 4, 1, 64), key=mx.random.key(5)).astype(mx.bfloat16)
    # (each call gets its own queries: mlx-lm's quantized SDPA scales them in place)
    got = base.scaled_dot_product_attention(mx.array(q), keys, values, cache=cache, scale=0.125, mask=None)
    want = wrapped.__wrapped__(mx.array(q), keys, values, scale=0.125, mask=None, group_size=64, bits=4)
    assert mx.array_equal(got, want)


def test_a_mixed_bf16_first_batch_splits_its_read_by_precision(models):
    """While rows of both precisions share an affine bf16-first batch, its read is a
    ``PrecisionSplit`` (routed through mlx-lm's quantized SDPA); once every row has converted
    it is the target's affine triples."""
    from mlxkv.batched.bf16first import PrecisionSplit

    model = models("llama")
    rows = [make_cache(model, "kv4-start8") for _ in range(2)]
    model(mx.array(prompt(5))[None], cache=rows[0])
    model(mx.array(prompt(9))[None], cache=rows[1])
    batch = mlxkv.merge_model_rows(rows)
    kv = mx.zeros((2, 2, 1, 64), mx.bfloat16)
    keys, values = batch[0].update_and_fetch(kv, kv)
    assert isinstance(keys, PrecisionSplit) and keys is values and batch[0].bits == 4
    assert batch[0].bf16_rows.tolist() == [0]  # row 0 holds 6 positions: short of 8
    batch[0].update_and_fetch(kv, kv)
    keys, _ = batch[0].update_and_fetch(kv, kv)  # row 0 reaches 8: attended bf16, then converts
    assert isinstance(keys, PrecisionSplit) and batch[0].bf16 is None
    keys, _ = batch[0].update_and_fetch(kv, kv)
    assert isinstance(keys, tuple) and len(keys) == 3


@pytest.mark.parametrize("ring", [None, 4])
def test_a_merged_batch_shows_mlx_lms_merged_keys(ring):
    """``merge`` gives ``keys``/``values`` as mlx-lm's ``BatchKVCache.merge`` (and
    ``BatchRotatingKVCache.merge``) does: one ``[B, H, T, D]`` array, T the longest row's
    stored positions, the same values; the first append then writes into new slack."""
    from mlx_lm.models import cache as mlx_cache

    def rows(mine: bool):
        out = []
        for i, n in enumerate((3, 0, 6)):
            if ring is None:
                c = mlxkv.KVCache() if mine else mlx_cache.KVCache()
            else:
                c = mlxkv.RotatingKVCache(max_size=ring) if mine else mlx_cache.RotatingKVCache(max_size=ring)
            if n:
                k = mx.random.normal((1, 2, n, 64), key=mx.random.key(i)).astype(mx.bfloat16)
                c.update_and_fetch(k, k * 2)
            out.append(c)
        return out

    want_cls = mlx_cache.BatchKVCache if ring is None else mlx_cache.BatchRotatingKVCache
    want, got = want_cls.merge(rows(False)), type(rows(True)[0]).merge(rows(True))
    assert isinstance(got.keys, mx.array) and got.keys.shape == want.keys.shape
    assert got.values.shape == want.values.shape
    assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)
    assert got.keys.shape[2] == want._idx == got.cols.idx
    step = mx.ones((3, 2, 1, 64), mx.bfloat16)
    got.update_and_fetch(step, step)
    assert got.capacity > got.cols.idx  # slack after the first append, as mlx-lm's step allocation
