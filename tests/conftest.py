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
