"""Eviction caches through snapshots: save at any point, load, continue exactly.

Persisted kinds ``tova`` and ``qfilters`` with the slots of docs/format.md (the contract
docs/format.md and the TypeScript reader follow).
"""

import mlx.core as mx
import pytest

import mlxkv
from mlxkv.caches.qfilters_calibration import calibrate
from mlxkv.codecs.base import check_entry
from mlxkv.errors import CorruptSnapshotError, GeometryMismatchError
from mlxkv.models.seeded import build_model, prompt

N_TOKENS = 70


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


@pytest.fixture(scope="module")
def llama_cal(llama):
    return calibrate(llama, [prompt(48, 7)], model_id="seeded/llama@0")


def caches_for(model, which, cal):
    if which == "tova":
        return mlxkv.make_cache(model, "tova-b16-s2")
    if which == "qfilters-calibrated":
        return mlxkv.make_cache(model, "qfilters-b16-s2-r4", qfilters_calibration=cal)
    return mlxkv.make_cache(model, "qfilters-b16-s2-r4", calib_tokens=24, sign=-1)


def forward(model, caches, tokens, blocks):
    """Feed ``tokens`` in blocks; the logits of every call."""
    out, t = [], 0
    for n in blocks:
        out.append(model(mx.array(tokens[t : t + n])[None], cache=caches))
        t += n
    mx.eval(out)
    return out


def snapshot_state(caches):
    return [
        (c.offset, c.rows, c.positions, c.keys, c.values, getattr(c, "scores", None), getattr(c, "filter", None))
        for c in caches
    ]


def same_state(a, b):
    for x, y in zip(a, b):
        assert x[:2] == y[:2]
        for p, q in zip(x[2:], y[2:]):
            assert (p is None and q is None) or mx.array_equal(p, q)


CASES = [
    ("tova", 10, "before the first eviction"),
    ("tova", 41, "mid-stream"),
    ("qfilters-calibrated", 12, "before the first eviction"),
    ("qfilters-calibrated", 41, "mid-stream"),
    ("qfilters-fallback", 20, "before the fallback froze its filter"),
    ("qfilters-fallback", 41, "mid-stream, filter frozen"),
]


@pytest.mark.parametrize("which,cut,when", CASES)
def test_save_load_and_continue_is_identical_to_never_stopping(tmp_path, llama, llama_cal, which, cut, when):
    toks = prompt(N_TOKENS, 3)
    live = caches_for(llama, which, llama_cal)
    forward(llama, live, toks, [cut - 3, 1, 1, 1])
    assert all(c.has_evicted == (when.startswith("mid-stream")) for c in live)
    if which == "qfilters-fallback":
        assert all(c.frozen == ("frozen" in when) for c in live)
    path = str(tmp_path / "s.safetensors")
    mlxkv.save(path, live, toks[:cut], model_id="seeded/llama@0")
    snap = mlxkv.load(path, model=llama, model_id="seeded/llama@0")
    restored = snap.caches
    assert snap.tokens == toks[:cut]
    same_state(snapshot_state(live), snapshot_state(restored))
    assert [c.kind for c in restored] == [c.kind for c in live]
    assert [c.is_trimmable() for c in restored] == [c.is_trimmable() for c in live]
    rest = [7, 1, 1, 5, 1, 1, 1, 1, 1, 1, N_TOKENS - cut - 20]
    a = forward(llama, live, toks[cut:], rest)
    b = forward(llama, restored, toks[cut:], rest)
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))  # logits, bit for bit
    same_state(snapshot_state(live), snapshot_state(restored))
    assert all(c.offset == N_TOKENS and c.rows == 16 for c in restored)


def entry_of(path, layer=0):
    return mlxkv.read_header(path)["caches"][layer]


def slots(entry):
    return [(t["slot"], t["dtype"], t["shape"]) for t in entry["tensors"]]


def test_tova_header_entry_is_the_documented_contract(tmp_path, llama):
    caches = mlxkv.make_cache(llama, "tova-b16-s2")
    forward(llama, caches, prompt(30, 1), [30])
    mlxkv.save(str(tmp_path / "t.safetensors"), caches, prompt(30, 1))
    e = entry_of(str(tmp_path / "t.safetensors"))
    assert {k: e[k] for k in ("kind", "offset", "budget", "nSink", "minimumReusableOffset")} == {
        "kind": "tova",
        "offset": 30,
        "budget": 16,
        "nSink": 2,
        "minimumReusableOffset": 0,
    }
    assert slots(e) == [
        ("keys", "BF16", [1, 2, 16, 64]),
        ("values", "BF16", [1, 2, 16, 64]),
        ("positions", "I32", [1, 2, 16]),
    ]


def test_qfilters_header_entries_before_and_after_the_freeze(tmp_path, llama, llama_cal):
    p = str(tmp_path / "q.safetensors")
    warm = caches_for(llama, "qfilters-fallback", None)
    forward(llama, warm, prompt(20, 1), [20])
    mlxkv.save(p, warm, prompt(20, 1))
    e = entry_of(p)
    assert {k: e[k] for k in ("kind", "offset", "budget", "nSink", "recent", "sign", "calibTokens", "calibrated")} == {
        "kind": "qfilters",
        "offset": 20,
        "budget": 16,
        "nSink": 2,
        "recent": 4,
        "sign": -1,
        "calibTokens": 24,
        "calibrated": False,
    }
    assert slots(e) == [
        ("keys", "BF16", [1, 2, 20, 64]),
        ("values", "BF16", [1, 2, 20, 64]),
        ("positions", "I32", [1, 2, 20]),
        ("scores", "F32", [1, 2, 20]),
    ]
    assert mx.array_equal(mlxkv.load(p).caches[0].scores, mx.zeros((1, 2, 20)))  # no filter yet: zeros

    cal = mlxkv.make_cache(llama, "qfilters-b16-s2-r4", qfilters_calibration=llama_cal)
    forward(llama, cal, prompt(30, 1), [30])
    mlxkv.save(p, cal, prompt(30, 1))
    e = entry_of(p)
    assert e["calibrated"] is True and e["sign"] == 1
    assert slots(e)[3:] == [("scores", "F32", [1, 2, 16]), ("filter", "F32", [1, 2, 64])]


def test_batched_rows_with_a_calibrated_filter_broadcast_the_filter_over_b(tmp_path, llama_cal):
    from mlxkv import QFiltersKVCache

    k = mx.random.normal((3, 2, 40, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    c = QFiltersKVCache(16, 2, 4, filters=llama_cal.filters[0])
    c.update_and_fetch(k, k)
    p = str(tmp_path / "b.safetensors")
    mlxkv.save(p, [c], list(range(40)))
    assert slots(entry_of(p))[4] == ("filter", "F32", [3, 2, 64])
    r = mlxkv.load(p).caches[0]
    more = mx.random.normal((3, 2, 9, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    for x in (c, r):
        x.update_and_fetch(more, more)
    assert mx.array_equal(c.positions, r.positions) and mx.array_equal(c.scores, r.scores)


def test_geometry_of_eviction_entries_is_checked_against_the_model(tmp_path, llama):
    caches = mlxkv.make_cache(llama, "tova-b16-s2")
    forward(llama, caches, prompt(20, 1), [20])
    p = str(tmp_path / "g.safetensors")
    mlxkv.save(p, caches, prompt(20, 1))
    other = build_model("llama", num_key_value_heads=4)
    with pytest.raises(GeometryMismatchError):
        mlxkv.load(p, model=other)


def test_trim_rules_survive_a_restore(tmp_path, llama):
    p = str(tmp_path / "t.safetensors")
    caches = mlxkv.make_cache(llama, "tova-b16-s2")
    forward(llama, caches, prompt(12, 1), [12])
    mlxkv.save(p, caches, prompt(12, 1))
    r = mlxkv.load(p).caches
    assert all(c.is_trimmable() for c in r) and r[0].trim(4) == 4 and r[0].offset == 8
    forward(llama, caches, prompt(30, 1)[12:], [18])
    mlxkv.save(p, caches, prompt(30, 1))
    r = mlxkv.load(p).caches
    assert not any(c.is_trimmable() for c in r) and r[0].trim(4) == 0


# -- header validation before any tensor is read ------------------------------------------


def tova_entry(offset=30, budget=16, n_sink=2, T=16, pos_shape=None, pos_dtype="I32"):
    shapes = {"keys": [1, 2, T, 64], "values": [1, 2, T, 64], "positions": pos_shape or [1, 2, T]}
    dtypes = {"keys": "BF16", "values": "BF16", "positions": pos_dtype}
    entry = {
        "kind": "tova",
        "offset": offset,
        "budget": budget,
        "nSink": n_sink,
        "minimumReusableOffset": 0,
        "tensors": [{"slot": s, "dtype": dtypes[s], "shape": shapes[s]} for s in shapes],
    }
    return entry, shapes


def test_tova_check_accepts_what_we_write():
    check_entry(*tova_entry())
    check_entry(*tova_entry(offset=9, T=9))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(T=17, offset=30),  # more rows than the budget
        dict(T=12, offset=30),  # fewer rows than TOVA keeps
        dict(T=9, offset=8),  # rows past the offset
        dict(n_sink=16),
        dict(budget=0, n_sink=0),
        dict(pos_shape=[1, 2, 15]),
        dict(pos_shape=[1, 2, 16, 1]),
        dict(pos_dtype="I64"),
    ],
)
def test_tova_check_rejects_impossible_entries(kwargs):
    with pytest.raises(CorruptSnapshotError):
        check_entry(*tova_entry(**kwargs))


def test_tova_check_rejects_missing_fields_and_wrong_slot_order():
    e, s = tova_entry()
    del e["nSink"]
    with pytest.raises(CorruptSnapshotError):
        check_entry(e, s)
    e, s = tova_entry()
    with pytest.raises(CorruptSnapshotError):
        check_entry(e, {"values": s["values"], "keys": s["keys"], "positions": s["positions"]})


def qf_entry(offset=30, T=16, calibrated=True, with_filter=True, filter_shape=None, score_dtype="F32", **fields):
    shapes = {"keys": [2, 2, T, 64], "values": [2, 2, T, 64], "positions": [2, 2, T], "scores": [2, 2, T]}
    if with_filter:
        shapes["filter"] = filter_shape or [2, 2, 64]
    dtypes = {"keys": "BF16", "values": "BF16", "positions": "I32", "scores": score_dtype, "filter": "F32"}
    entry = {
        "kind": "qfilters",
        "offset": offset,
        "budget": 16,
        "nSink": 2,
        "recent": 4,
        "sign": 1,
        "calibTokens": 24,
        "calibrated": calibrated,
        "minimumReusableOffset": 0,
        "tensors": [{"slot": s, "dtype": dtypes[s], "shape": shapes[s]} for s in shapes],
    }
    entry.update(fields)
    return entry, shapes


def test_qfilters_check_accepts_what_we_write():
    check_entry(*qf_entry())
    check_entry(*qf_entry(offset=10, T=10))
    check_entry(*qf_entry(offset=20, T=20, calibrated=False, with_filter=False))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(T=17),  # over the budget
        dict(offset=30, T=30, calibrated=False, with_filter=False),  # past calibTokens without a filter
        dict(offset=20, T=16, calibrated=False, with_filter=False),  # evicted without a filter
        dict(offset=20, T=20, calibrated=True, with_filter=False),  # calibrated, no filter
        dict(filter_shape=[2, 64]),
        dict(filter_shape=[1, 2, 64]),  # must be broadcast over B
        dict(filter_shape=[2, 2, 32]),
        dict(score_dtype="BF16"),
        dict(sign=0),
        dict(recent=14),  # nSink + recent >= budget
        dict(calibrated=1),  # not a JSON bool
        dict(calibTokens=1),
    ],
)
def test_qfilters_check_rejects_impossible_entries(kwargs):
    with pytest.raises(CorruptSnapshotError):
        check_entry(*qf_entry(**kwargs))


def test_a_tampered_header_fails_the_load_before_any_tensor_is_read(tmp_path, llama, monkeypatch):
    caches = mlxkv.make_cache(llama, "tova-b16-s2")
    forward(llama, caches, prompt(30, 1), [30])
    p = str(tmp_path / "t.safetensors")
    mlxkv.save(p, caches, prompt(30, 1))
    from helpers import rewrite_header

    from mlxkv.io.tensor_reader import TensorReader

    rewrite_header(p, lambda h: h["caches"][2].update(budget=8))  # 16 rows can no longer be right
    reads = []
    monkeypatch.setattr(TensorReader, "read_all", lambda *a, **k: reads.append(a) or None)
    with pytest.raises(CorruptSnapshotError, match="cache entry 2"):
        mlxkv.load(p)
    assert reads == []
