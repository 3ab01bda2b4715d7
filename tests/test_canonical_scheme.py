"""``canonical_scheme``: one string per set of caches ``make_cache`` builds, what a prompt
store keys its entries on. Spellings of one scheme give one form; an option that changes
what the caches keep gives another; and caches of one form hold the same bytes after the
same prompt, where caches of different forms here do not."""

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxkv.caches.schemes import canonical_scheme, make_cache
from mlxkv.errors import SchemeError
from mlxkv.models.seeded import prompt

# (scheme, make_cache options) in groups: one canonical form per group
GROUPS = [
    ("bf16", [("bf16", {}), ("fp16", {}), ("plain", {})]),
    ("bf16+max_kv_size=24", [("bf16", {"max_kv_size": 24}), ("fp16", {"max_kv_size": 24})]),
    ("bf16+max_kv_size=32", [("bf16", {"max_kv_size": 32})]),
    ("kv4-g64", [("kv4", {}), ("kv4-g64", {}), ("kv04-g064", {})]),
    ("kv4-g64+max_kv_size=24", [("kv4", {"max_kv_size": 24})]),
    ("kv4-g32", [("kv4-g32", {})]),
    ("kv4-g64-start16", [("kv4-start16", {}), ("kv4-g64-start16", {})]),
    ("turbo-k8v3-start0", [("turbo-k8v3", {}), ("turbo-k8v3-start0", {}), ("turbo-k8v3", {"codes": True})]),
    ("turbo-k8v3-start16", [("turbo-k8v3-start16", {}), ("turbo-k8v3-start16", {"deferred": False})]),
    ("tova-b32-s4", [("tova-b32-s4", {})]),
    ("tova-b24-s4", [("tova-b24-s4", {})]),
    ("qfilters-b32-s4-r8+calib_tokens=16+sign=1", [("qfilters-b32-s4-r8", {"calib_tokens": 16})]),
    ("qfilters-b32-s4-r8+calib_tokens=16+sign=-1", [("qfilters-b32-s4-r8", {"calib_tokens": 16, "sign": -1})]),
    ("qfilters-b32-s4-r8+calib_tokens=24+sign=1", [("qfilters-b32-s4-r8", {"calib_tokens": 24})]),
]


def held(model, scheme, options, tokens):
    """The caches' state after ``tokens`` (in chunks of 8), as numpy arrays."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_cache(model, scheme, **options)
    for i in range(0, len(tokens), 8):
        mx.eval(model(mx.array([tokens[i : i + 8]]), cache=caches))
    out = []
    for _, a in tree_flatten([c.state for c in caches]):
        if isinstance(a, mx.array):
            a = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
        out.append(a)
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        np.shape(x) == np.shape(y) and np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(a, b)
    )


def test_one_form_per_scheme_and_options():
    for form, members in GROUPS:
        for scheme, options in members:
            assert canonical_scheme(scheme, **options) == form, (scheme, options)
    assert len({form for form, _ in GROUPS}) == len(GROUPS)


def test_one_form_holds_the_same_bytes_and_different_forms_here_do_not(models):
    model, tokens = models("llama"), prompt(40, seed=7)  # past every ring, budget and calibration
    states = []
    for form, members in GROUPS:
        first = held(model, *members[0], tokens)
        for scheme, options in members[1:]:
            assert same(held(model, scheme, options, tokens), first), (form, scheme, options)
        states.append((form, first))
    for i, (form, state) in enumerate(states):
        for other, other_state in states[i + 1 :]:
            assert not same(state, other_state), (form, other)


def test_calibrated_filters_are_named_by_their_values():
    filters = mx.random.normal((2, 64), key=mx.random.key(1))
    named = canonical_scheme("qfilters-b32-s4-r8", filters=filters)
    assert named == canonical_scheme("qfilters-b32-s4-r8", filters=mx.array(np.array(filters)))
    assert named != canonical_scheme("qfilters-b32-s4-r8", filters=filters * 2)
    assert named.startswith("qfilters-b32-s4-r8+filters=") and "calib_tokens" not in named


def test_options_make_cache_refuses_are_refused():
    with pytest.raises(SchemeError, match="has no ring form"):
        canonical_scheme("tova-b32-s4", max_kv_size=64)
    with pytest.raises(SchemeError, match="max_kv_size must be an integer above the 4 positions a ring keeps"):
        canonical_scheme("bf16", max_kv_size=4)
    with pytest.raises(SchemeError, match="unknown cache scheme"):
        canonical_scheme("bf17")


@pytest.mark.parametrize(
    "scheme, options, valid",
    [
        ("bf16", {"codes": False}, "it takes no option but make_cache's max_kv_size"),
        ("kv4-start16", {"calib_tokens": 8}, "it takes no option"),
        ("turbo-k8v3", {"code": False}, "its options are deferred, codes"),
        (
            "qfilters-b16-s2-r4",
            {"sign": -1, "calib_token": 8},
            "its options are qfilters_calibration, filters, sign, calib_tokens",
        ),
    ],
)
def test_an_unknown_option_is_refused_by_name_before_any_cache_is_built(scheme, options, valid):
    class Model:  # make_cache would read its layers; a refusal never gets that far
        def make_cache(self):
            raise AssertionError("the model's layers were read before the options were checked")

    bad = next(k for k in options if k not in ("sign",))
    with pytest.raises(SchemeError, match=rf"unknown option '{bad}'; {re.escape(valid)}"):
        make_cache(Model(), scheme, **options)
    with pytest.raises(SchemeError, match=rf"unknown option '{bad}'"):
        canonical_scheme(scheme, **options)
