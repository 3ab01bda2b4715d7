"""mlx-lm's ``kv_bits`` with mlxkv caches: refused by ``make_cache`` when given to it, and by
mlx-lm's own generation at its first step, not once ``quantized_kv_start`` (5000) is reached."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.models.seeded import prompt


@pytest.mark.parametrize(
    "options, scheme",
    [({"kv_bits": 4}, "kv4-g64"), ({"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 100}, "kv8-g32-start100")],
)
def test_make_cache_refuses_mlx_lms_quantization_options(models, options, scheme):
    with pytest.raises(mlxkv.SchemeError, match=f"make_cache\\(model, '{scheme}'\\)"):
        mlxkv.make_cache(models("llama"), "bf16", **options)


def test_generate_with_kv_bits_is_refused_before_the_first_token(models):
    model = models("llama")
    caches = mlxkv.make_cache(model, "bf16")
    tokens = []
    with pytest.raises(mlxkv.SchemeError, match="kv_bits=4 would replace"):
        for t, _ in generate_step(mx.array(prompt(12)), model, prompt_cache=caches, kv_bits=4, max_tokens=4):
            tokens.append(t)
    assert tokens == [] and caches[0].offset < 12  # refused during the prompt, far below offset 5000
    assert all(isinstance(c, mlxkv.KVCache) for c in caches)  # nothing was swapped


def test_mlx_lms_own_caches_still_quantize(models):
    model = models("llama")
    caches = mlx_cache.make_prompt_cache(model)
    steps = generate_step(mx.array(prompt(12)), model, prompt_cache=caches, kv_bits=4, quantized_kv_start=0)
    next(steps)
    assert isinstance(caches[0], mlx_cache.QuantizedKVCache)


@pytest.mark.parametrize("scheme", ["turbo-k8v3", "tova-b32-s4", "qfilters-b32-s4-r8", "bf16", "kv4"])
def test_keys_and_values_of_every_scheme_is_what_a_kv_shared_layer_attends(models, scheme):
    """mlx-lm's KV-shared layers (gemma3n, afm7) call ``keys_and_values()`` on another layer's
    cache and attend the dense arrays: every scheme's cache answers, with its stored positions
    (TurboQuant decoded, eviction caches their kept rows); an empty eviction cache gives
    ``(None, None)``."""
    model = models("llama")
    caches = mlxkv.make_cache(model, scheme)
    if scheme.startswith(("tova", "qfilters")):
        assert caches[0].keys_and_values() == (None, None)
    model(mx.array([prompt(40)]), cache=caches)
    keys, values = caches[0].keys_and_values()
    if scheme == "kv4":
        keys, values = keys[0], values[0]  # affine triples, as mlx-lm's QuantizedKVCache gives
    stored = {"tova-b32-s4": 32}.get(scheme, 40)  # TOVA has evicted to its budget, Q-Filters not yet calibrated
    assert keys.shape[:3] == values.shape[:3] == (1, 2, stored)
    if scheme.startswith(("turbo", "tova", "qfilters")):
        dk, dv = caches[0].dense_window()
        assert mx.array_equal(keys, dk) and mx.array_equal(values, dv)


def test_importing_mlxkv_in_a_fresh_process_installs_the_refusal():
    """The refusal is installed only where ``mlx_lm.generate`` is already imported
    (``caches/kv_bits.py``): mlx-lm's package brings it with the first mlxkv cache class."""
    script = (
        "import sys, mlxkv; mlxkv.KVCache; g = sys.modules['mlx_lm.generate']; "
        "print(getattr(g.maybe_quantize_kv_cache, 'refuses_mlxkv_caches', False))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
