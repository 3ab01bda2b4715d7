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
