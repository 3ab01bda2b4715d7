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
