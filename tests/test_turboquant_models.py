"""TurboQuant caches on mlx-lm's own model classes whose attention reads the window itself.

mlx-lm's gemma4, plamo, plamo2 and stablelm touch the window their cache returns as arrays
(``astype``, ``mx.tile``, ``mx.fast``'s kernel, the window shared with later layers) and
gpt_oss passes attention sinks: a TurboQuant cache reads the decoded window for them
(``mlxkv.caches.attention_sites``), and the codes for llama, gemma3 and lfm2. Each decode
step is checked against a reference that attends the same decoded window through mlx-lm's
own ``KVCache``, within docs/turboquant.md's float32 tolerance (1e-3 on the logits).
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.utils import _get_classes

import mlxkv
from mlxkv.caches.attention_sites import _module_classes, window_reader
from mlxkv.caches.transition import Bf16FirstCache
from mlxkv.errors import SchemeError
from mlxkv.math import turboquant as tq
from mlxkv.models.seeded import CONFIGS

K_BITS, V_BITS = 8, 3
TOLERANCE = 1e-3  # docs/turboquant.md: float32 codes and exact reads, logits within 1e-3

#: tiny configs of the architectures whose attention reads the window (head_dim 64)
ARRAY_READERS = {
    "stablelm": {
        "model_type": "stablelm",
        "vocab_size": 256,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "rope_theta": 10000.0,
        "use_qkv_bias": False,
        "partial_rotary_factor": 0.25,
        "layer_norm_eps": 1e-5,
    },
    "plamo": {
        "model_type": "plamo",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "n_shared_head": 2,
    },
    "plamo2": {
        "model_type": "plamo2",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size_per_head": 64,
        "max_position_embeddings": 256,
        "attention_window_size": 256,
        "full_attention_idx": [1, 3],
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_step": 2,
        "mamba_chunk_size": 16,
        "intermediate_size": 256,
        "vocab_size": 256,
    },
    "gemma4": {
        "model_type": "gemma4_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "head_dim": 64,
        "global_head_dim": 64,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size": 256,
        "vocab_size_per_layer_input": 256,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 256,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 128,
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
CODES_READERS = {name: CONFIGS[name] for name in ("llama", "gemma3", "hybrid")}


def build(config: dict, seed: int = 0):
    """mlx-lm's own model class for ``config``, float32 weights drawn from ``seed`` (norm
    weights near 1, or near 0 for gemma's ``1 + w`` norms, so that logits are of order 1)."""
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    one = 0.0 if config["model_type"].startswith("gemma") else 1.0
    weights = [
        (n, mx.random.normal(p.shape, key=k) * (0.05 if "norm" in n else 0.1) + (one if "norm" in n else 0.0))
        for (n, p), k in zip(params, keys)
    ]
    model.load_weights(weights)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


class DecodedWindow(mlx_cache.KVCache):
    """The reference: mlx-lm's ``KVCache`` holding each position as TurboQuant stores and
    decodes it. Its first append is attended as given (a start-0 turbo cache attends the
    prefill before it converts)."""

    def update_and_fetch(self, keys, values):
        first = self.offset == 0
        k, v = tq.decode(tq.encode(keys, values, K_BITS, V_BITS), K_BITS, V_BITS)
        window = super().update_and_fetch(k.astype(keys.dtype), v.astype(values.dtype))
        return (keys, values) if first else window


def turbo_layers(caches) -> list:
    return [i for i, c in enumerate(caches) if isinstance(c, Bf16FirstCache)]


def logits_per_step(model, caches, prompt, steps: int = 4) -> list:
    out, tokens = [], mx.array([prompt])
    for _ in range(steps):
        logits = model(tokens, cache=caches)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
        tokens = mx.argmax(logits, axis=-1, keepdims=True)
    return out


def reference_caches(model, turbo) -> list:
    caches = mlxkv.make_cache(model, "bf16")
    for i in turbo_layers(turbo):
        caches[i] = DecodedWindow()
    return caches


@pytest.mark.parametrize("name", sorted(ARRAY_READERS) + sorted(CODES_READERS))
def test_a_decode_step_on_turbo_equals_the_decoded_window(name):
    model = build({**ARRAY_READERS, **CODES_READERS}[name])
    prompt = list(range(3, 23))
    turbo = mlxkv.make_cache(model, f"turbo-k{K_BITS}v{V_BITS}")
    assert turbo_layers(turbo), "the model has full-attention layers for the scheme"
    got = logits_per_step(model, turbo, prompt)
    want = logits_per_step(model, reference_caches(model, turbo), prompt)
    bf16 = logits_per_step(model, mlxkv.make_cache(model, "bf16"), prompt)
    for step, (g, w, b) in enumerate(zip(got, want, bf16)):
        assert mx.abs(g - w).max().item() < TOLERANCE
        if step:  # the decode steps attend the stored window: TurboQuant's rounding shows
            assert mx.abs(b - w).max().item() > 10 * TOLERANCE
    # the read each layer took: codes where the model routes the window through mlx-lm's SDPA
    held = [turbo[i].inner for i in turbo_layers(turbo)]
    assert {c.codes for c in held} == {name in CODES_READERS}


@pytest.mark.parametrize("name", sorted(ARRAY_READERS))
def test_codes_true_on_a_model_that_reads_arrays_is_refused_at_make_cache(name):
    model = build(ARRAY_READERS[name])
    reason = window_reader(model)
    assert reason is not None
    with pytest.raises(SchemeError, match="codes=True") as e:
        mlxkv.make_cache(model, "turbo-k8v3", codes=True)
    assert reason in str(e.value)


@pytest.mark.parametrize("name", sorted(CODES_READERS))
def test_the_seeded_models_route_the_window(name):
    assert window_reader(build(CODES_READERS[name])) is None


@pytest.mark.parametrize("name", sorted({**CODES_READERS, **ARRAY_READERS}))
def test_the_sites_are_looked_for_in_every_module_class(name):
    model = build({**CODES_READERS, **ARRAY_READERS}[name])
    assert _module_classes(model) == {type(m) for m in model.modules()}


def test_sinks_need_the_decoded_window():
    assert "sinks" in window_reader(build(ARRAY_READERS["gpt_oss"]))


def _continued(model, caches, token: int, steps: int = 3) -> list:
    return [x.tolist() for x in logits_per_step(model, caches, [token], steps)]


@pytest.mark.parametrize("scheme", ["turbo-k8v3", "turbo-k8v3-start32"])
def test_a_restore_on_the_model_reads_as_make_cache_does(tmp_path, scheme):
    """A snapshot does not record the read: restored on a model whose attention reads the
    window itself (stablelm), a TurboQuant cache, or a pending conversion to one that
    converts after the restore, reads the decoded window and continues as the live caches
    do; restored without the model it reads codes."""
    model = build(ARRAY_READERS["stablelm"])
    prompt = list(range(3, 23))
    live = mlxkv.make_cache(model, scheme)
    model(mx.array([prompt]), cache=live)
    path = str(tmp_path / "s.mlxkv")
    mlxkv.save(path, live, prompt, model=model)
    restored = mlxkv.load(path, model=model).caches
    assert _continued(model, restored, 7, 16) == _continued(model, live, 7, 16)  # past start 32
    held = [c.inner if isinstance(c, Bf16FirstCache) else c for c in restored]
    assert {c.codes for c in held if hasattr(c, "codes")} == {False}
    bare = [c.inner if isinstance(c, Bf16FirstCache) else c for c in mlxkv.load(path).caches]
    if scheme == "turbo-k8v3":
        assert {c.codes for c in bare if hasattr(c, "codes")} == {True}


def test_a_store_hit_reads_as_make_cache_does():
    model = build(ARRAY_READERS["stablelm"])
    prompt = list(range(3, 23))
    live = mlxkv.make_cache(model, "turbo-k8v3")
    model(mx.array([prompt]), cache=live)
    store = mlxkv.PromptStore(model, None, cap=1 << 26, scheme="turbo-k8v3")
    store.put(prompt, live)
    hit = store.take(prompt + [7])
    assert hit is not None and hit.prefix_len == len(prompt)
    assert {c.codes for c in hit.caches if hasattr(c, "codes")} == {False}
    assert _continued(model, hit.caches, 7) == _continued(model, live, 7)
