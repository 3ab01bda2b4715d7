"""A GGUF file's tensors and settings as an mlx-lm model: weights under mlx-lm's (Hugging
Face's) names and the ``config.json`` of the original model.

Three things a GGUF stores differently from the Hugging Face checkpoint it was made from, each
undone here so that the directory is the original model's layout (and ``config.json`` the
original's, with mlx-lm's default split-half RoPE):

- llama's query and key rows are permuted for llama.cpp's interleaved RoPE (pairs of adjacent
  rows rotate together); :func:`split_half_rows` puts them back in split-half order;
- gemma's norm weights carry the ``+ 1`` that Gemma's RMSNorm (and mlx-lm's) adds itself;
- architecture constants llama.cpp hard-codes (Gemma 3's local layers) come from the record.

Every tensor must map and every setting under the architecture's prefix must be understood:
anything else is a :class:`ModelError` naming it, never a silently different model.

``float32`` and ``bfloat16`` are dequantized from any GGUF type by the ``gguf`` package;
``q4`` keeps the GGUF's Q4_1/Q8_0 blocks as MLX reads them (``mx.load``: affine, group 32),
with float32 scales, biases and norms.
"""

import mlx.core as mx
import numpy as np

from ..errors import ModelError
from .registry import ModelSource

# GGUF tensor name -> mlx-lm name, per architecture ({i} is the layer)
_COMMON = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
TENSOR_NAMES = {
    "llama": {**_COMMON, "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"},
    "gemma3": {
        **_COMMON,
        "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}

# GGUF setting (after "<architecture>.") -> config.json key; settings not listed are refused
SETTINGS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
    "attention.value_length": None,  # checked equal to head_dim
    "rope.dimension_count": None,  # checked equal to head_dim: RoPE over the whole head
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}

ORIGINAL = {  # the Hugging Face config entries each architecture's models share
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"},
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
    },
}
#: the dtype a directory's model computes in; q4's scales, biases and norms are float32 (exact
#: for the GGUF's float16 block constants; MLX's CPU 4-bit matmul with float16 or bfloat16
#: scales ran 10-100x slower than with float32 ones)
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "q4": "float32"}


def open_gguf(path):
    """The ``gguf`` package's reader over ``path`` (memory-mapped; nothing is read yet)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ModelError(f"{path} is not a GGUF file gguf can read: {e}") from e


def field(reader, key: str, default=...):
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ModelError(f"the GGUF has no {key!r}, which the conversion needs")
        return default
    return f.contents()


def _shortest(x: float) -> float:
    """A float32 setting as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def model_config(source: ModelSource, reader) -> dict:
    """config.json of ``source``'s model from the GGUF's settings and the record's constants."""
    arch = field(reader, "general.architecture")
    if arch != source.architecture or arch not in ORIGINAL:
        raise ModelError(f"{source.gguf} is a {arch!r} model; the conversion reads {source.architecture!r}")
    config, checked = dict(ORIGINAL[arch]), {}
    for key in reader.fields:
        if not key.startswith(arch + "."):
            continue
        name = key[len(arch) + 1 :]
        if name not in SETTINGS:
            raise ModelError(f"{source.gguf} sets {key!r}, which the conversion does not map: refusing to guess")
        value = field(reader, key)
        value = _shortest(value) if isinstance(value, float) else value
        if SETTINGS[name]:
            config[SETTINGS[name]] = value
        else:
            checked[name] = value
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    config.setdefault("vocab_size", tokens)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    for name, value in checked.items():
        if value != config["head_dim"]:
            raise ModelError(f"{source.gguf}: {arch}.{name} = {value} differs from head_dim {config['head_dim']}")
    if config["vocab_size"] != tokens:
        raise ModelError(f"{source.gguf}: vocab_size {config['vocab_size']} but {tokens} tokens")
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    for hf, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if (value := field(reader, f"tokenizer.ggml.{key}", None)) is not None:
            config[hf] = value
    config.update(source.config)
    config["rope_scaling"] = None
    return config


def split_half_rows(w, heads: int):
    """Query or key rows from llama.cpp's interleaved RoPE order back to split-half order.

    In a head of ``d`` rows llama.cpp stores original row ``j * d/2 + i`` (half ``j`` of pair
    ``i``) at ``2 * i + j``; works on any array whose first axis is those rows (weights,
    quantization scales and biases)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _names(arch: str, layers: int) -> dict:
    table = {}
    for gguf_name, name in TENSOR_NAMES[arch].items():
        for i in range(layers) if "{i}" in gguf_name else [None]:
            table[gguf_name.format(i=i)] = name.format(i=i)
    return table


def _fix(arch: str, name: str, w, config: dict):
    """The one architecture-specific change of tensor ``name`` (mlx-lm's name)."""
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
        return split_half_rows(w, heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1.0
    return w


def _mapped(source: ModelSource, reader, config: dict) -> dict:
    """GGUF tensor name -> mlx-lm name for every tensor; a ModelError for any that does not map."""
    table = _names(source.architecture, config["num_hidden_layers"])
    names = [t.name for t in reader.tensors]
    unmapped = [n for n in names if n not in table]
    if unmapped:
        raise ModelError(f"{source.gguf}: tensors the conversion does not map: {', '.join(unmapped[:8])}")
    return {n: table[n] for n in names}


def convert_weights(source: ModelSource, reader, gguf_path, dtype: str, config: dict) -> tuple[dict, dict | None]:
    """``(weights, quantization)``: mlx-lm's weights in ``dtype``, and for ``q4`` the
    ``config.json`` quantization entry (per-tensor bits where a tensor differs)."""
    mapped = _mapped(source, reader, config)
    arch = source.architecture
    if dtype != "q4":
        from gguf.quants import dequantize

        target = getattr(mx, dtype)
        weights = {}
        for t in reader.tensors:
            name = mapped[t.name]
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            weights[name] = mx.array(_fix(arch, name, np.asarray(w, np.float32), config)).astype(target)
            mx.eval(weights[name])
        return weights, None
    return _affine_weights(source, gguf_path, mapped, config)


def _affine_weights(source: ModelSource, gguf_path, mapped: dict, config: dict):
    """The GGUF's 4- and 8-bit blocks as MLX's affine quantization (``mx.load``), group 32."""
    try:
        raw = mx.load(str(gguf_path))
    except (ValueError, RuntimeError) as e:
        raise ModelError(f"MLX cannot read {source.gguf}'s quantized tensors ({e}): use float32 or bfloat16") from e
    group, weights, bits = 32, {}, {}
    for gguf_name, name in mapped.items():
        stem = gguf_name.removesuffix(".weight")
        if f"{stem}.scales" in raw:
            packed, scales = raw[gguf_name], raw[f"{stem}.scales"]
            in_features = scales.shape[-1] * group
            if packed.shape[-1] * 32 % in_features:
                raise ModelError(f"{source.gguf}: {gguf_name} is not in groups of {group}")
            bits[name.removesuffix(".weight")] = packed.shape[-1] * 32 // in_features
            for part, value in (("weight", packed), ("scales", scales), ("biases", raw[f"{stem}.biases"])):
                value = value if part == "weight" else value.astype(mx.float32)
                weights[f"{name.removesuffix('.weight')}.{part}"] = _fix(source.architecture, name, value, config)
        elif gguf_name in raw:
            weights[name] = _fix(source.architecture, name, raw[gguf_name], config).astype(mx.float32)
        else:
            raise ModelError(f"MLX read no tensor {gguf_name!r} from {source.gguf}")
    common = max(set(bits.values()), key=list(bits.values()).count)
    quantization = {"group_size": group, "bits": common}
    quantization.update({n: {"group_size": group, "bits": b} for n, b in bits.items() if b != common})
    return weights, quantization
