"""Small seeded models of real mlx-lm architectures, built in code (no hub download).

Used by the demo, the tests and the fixtures: a llama, a gemma3 with sliding-window layers,
and a hybrid (lfm2: convolution layers with recurrent state between attention layers).
"""

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 256

CONFIGS = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
    },
    "hybrid": {
        "model_type": "lfm2",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 128,
        "block_ff_dim": 256,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
    },
}

ARCHITECTURES = tuple(CONFIGS)
#: one scheme of every cache family (and both bf16-first targets), sized for the seeded models
SCHEMES = (
    "bf16",
    "kv4",
    "kv8-g32",
    "kv4-start16",
    "turbo-k8v3",
    "turbo-k4v2-start16",
    "tova-b32-s4",
    "qfilters-b32-s4-r8",
)


def build_model(arch: str, seed: int = 0, dtype=mx.bfloat16, **overrides):
    """The seeded model ``arch`` (one of ``ARCHITECTURES``); same seed, same weights."""
    from mlx_lm.utils import _get_classes

    if arch not in CONFIGS:
        raise ValueError(f"unknown seeded architecture {arch!r}; choose from {ARCHITECTURES}")
    config = {**CONFIGS[arch], **overrides}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Re-draw every weight from one key so the weights do not depend on init order.
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        scale = 1.0 if "norm" in name else 0.05
        val = mx.random.normal(p.shape, key=k) * scale + (1.0 if "norm" in name and arch != "gemma3" else 0.0)
        new.append((name, val.astype(dtype)))
    model.load_weights(new)
    mx.eval(model.parameters())
    model.eval()
    model.mlxkv_config = config
    model.mlxkv_model_id = f"seeded/{arch}@{seed}"
    return model


def prompt(n: int, seed: int = 1) -> list:
    """A deterministic token prompt of length n."""
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed)).tolist()


def tokenizer():
    """A byte-level word tokenizer over the seeded vocabulary, wrapped for mlx-lm.

    Token i is the word ``<ii>`` (two hex digits); ``<00>`` is the end-of-sequence token.
    It lets ``mlx_lm.generate`` and ``mlx_lm.stream_generate`` run on the seeded models.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i:02x}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<00>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<00>"))


#: the seeded tokenizer's chat template: each message's words, then a space
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_model_dir(arch: str, path: str, seed: int = 0, **overrides) -> str:
    """Write the seeded model ``arch`` (config ``overrides`` applied) as a local model directory
    ``mlx_lm.load`` (and ``mlxkv serve --model``) reads: weights, config.json, and the
    tokenizer with a chat template."""
    import os

    from mlx_lm.utils import save_config, save_model

    model = build_model(arch, seed=seed, **overrides)
    save_model(path, model)
    save_config({**CONFIGS[arch], **overrides}, os.path.join(path, "config.json"))
    hf = tokenizer()._tokenizer
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)
    return path
