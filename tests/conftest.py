import warnings

import pytest

from mlxkv.models.seeded import build_model


@pytest.fixture(scope="session")
def models():
    cache = {}

    def get(arch, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_model(arch, **overrides)
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def _quiet_sliding_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sliding-window layers stay.*")
        yield


#: the real tier's demo processes (tests/test_real_sessions.py), started when collection ends
_DEMOS = {}
DEMO_TEST = "test_real_sessions.py::test_every_scheme_resumes_bit_identically_in_a_fresh_process"


def pytest_collection_finish(session):
    """Start the real tier's two demo processes (its longest test) as soon as the selected
    tests are known, so they use the second core while the tier's other tests run here."""
    if any(item.nodeid.endswith(DEMO_TEST) for item in session.items):
        from test_real_sessions import demo_processes

        _DEMOS.update(demo_processes())


def pytest_sessionfinish(session):
    for proc in _DEMOS.values():  # an interrupted run leaves no demo behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def real_demos():
    """The demo processes conftest started (or, for a test run without collection's start,
    started now)."""

    def get():
        if not _DEMOS:
            from test_real_sessions import demo_processes

            _DEMOS.update(demo_processes())
        return dict(_DEMOS)

    return get


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """The seeded llama saved as a model directory (what ``mlxkv serve --model`` and
    ``mlx_lm.load`` read)."""
    from mlxkv.models.seeded import save_model_dir

    return save_model_dir("llama", str(tmp_path_factory.mktemp("seeded-llama")))


@pytest.fixture
def codes_reads(monkeypatch):
    """``{"attend": n, "decode": n}``: TurboQuant codes attentions and window decodes since the
    start (a path that attends the codes decodes no window)."""
    from mlxkv.caches.codes_window import CodesWindow
    from mlxkv.math import turboquant as tq

    counts = {"attend": 0, "decode": 0}
    attend, decode = CodesWindow.attend, tq.decode

    def counted_attend(window, *a, **k):
        counts["attend"] += 1
        return attend(window, *a, **k)

    def counted_decode(*a, **k):
        counts["decode"] += 1
        return decode(*a, **k)

    monkeypatch.setattr(CodesWindow, "attend", counted_attend)
    monkeypatch.setattr(tq, "decode", counted_decode)
    return counts
