"""The fuzz suite, in-suite size: seeded damaged and crafted snapshots over every persisted
kind and the three seeded architectures (tests/fuzzing.py); zero defects. The 50,000-case
run is tests/fuzz_campaign.py."""

import collections

import pytest
from fuzzing import DEFECTS, MUTATIONS, Corpus, make_case, run_case

CASES = 3000


@pytest.fixture(scope="module")
def corpus():
    return Corpus()


def test_damaged_and_crafted_snapshots_are_refused_or_load_whole(corpus, tmp_path):
    path = str(tmp_path / "case.safetensors")
    outcomes, defects = collections.Counter(), []
    for i in range(CASES):
        name, mutation, data, expect = make_case(corpus, 0, i)
        outcome, detail = run_case(corpus, path, name, data, expect, with_model=i % 4 == 0)
        outcomes[(mutation, outcome)] += 1
        if outcome in DEFECTS:
            defects.append((i, name, mutation, outcome, detail))
    assert defects == []
    for mutation in MUTATIONS:  # every mutation ran, and damage was refused
        assert sum(n for (m, _), n in outcomes.items() if m == mutation) > 0, mutation
    assert outcomes[("bitflip", "refused")] > 0 and outcomes[("hostile", "refused")] > 0
    assert outcomes[("crafted", "loaded-crafted")] > 0  # crafted files that are valid still load


def test_the_fuzzer_sees_defects(corpus, tmp_path, monkeypatch):
    """The classifier is not blind: a reader that lets a foreign exception escape, or loads
    a hostile file, is caught."""
    import mlxkv

    path = str(tmp_path / "case.safetensors")
    name = corpus.names[0]
    data = corpus.data[name]
    monkeypatch.setattr(mlxkv, "verify", lambda p: {}.__getitem__("boom"))
    assert run_case(corpus, path, name, data, "damaged", False)[0] == "foreign-exception"
    monkeypatch.undo()
    assert run_case(corpus, path, name, data, "invalid", False)[0] == "accepted-invalid"
    assert run_case(corpus, path, name, data, "damaged", False)[0] == "equal"
