"""The converted models compute what their GGUF files say: logits of a fixed prompt from
mlx-lm on the fetched directory against an independent numpy forward pass that reads the GGUF
itself (tests/real_models.py reads the file; ``gguf.quants`` dequantizes), and greedy answers
that are the expected facts.

The numpy passes follow llama.cpp's conventions for the GGUF, not the converter's output, so a
conversion step that is wrong shows:

- SmolLM2 (llama): ``mlxkv.models.numpy_llama`` with traditional RoPE on the GGUF's query and
  key rows as stored (the converter reorders them for mlx-lm's split-half RoPE instead);
- Gemma 3: the numpy Gemma 3 of tests/real_models.py, written from its published
  architecture, with the GGUF's norm weights used as stored (they include the ``+ 1`` that
  the converter takes out for mlx-lm's ``1 + w``), local layers (five of every six) with RoPE
  base 10,000 and global ones with the file's 1,000,000. The prompt is shorter than the 512
  window, so the window is not compared here (the same pass over 520 positions gives the
  wrapped rings' keys and values in tests/test_real_sessions.py). Its embedding scale is
  ``sqrt(hidden_size)`` rounded to bfloat16, as the reference implementations compute it for
  the bfloat16 checkpoint and mlx-lm does for every dtype.

The tolerance is stated once: float32 and q4 (the GGUF's own blocks, float32 scales) against
numpy float32; the arg-max agrees everywhere. bfloat16 is checked to be float32 rounded.
"""

import functools

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import real_models
from real_models import GEMMA3, SMOLLM2, chat_prompt, gguf, loaded

from mlxkv.models import fetch, numpy_llama

pytestmark = pytest.mark.real

#: max |logit difference| over every position and token, relative to the largest |logit|
TOLERANCE = 2e-4
PROMPT = "The rainbow has seven colours: red, orange, yellow"


def _layers(g, arch):
    return g.metadata[f"{arch}.block_count"]


@functools.cache
def numpy_smollm2(ids):
    """SmolLM2's logits [T, V] from the GGUF with llama.cpp's interleaved RoPE."""
    g = gguf(SMOLLM2)
    m = g.metadata
    cfg = {
        "hidden_size": m["llama.embedding_length"],
        "num_attention_heads": m["llama.attention.head_count"],
        "num_key_value_heads": m["llama.attention.head_count_kv"],
        "head_dim": m["llama.rope.dimension_count"],
        "rms_norm_eps": m["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": m["llama.rope.freq_base"],
        "num_hidden_layers": _layers(g, "llama"),
        "rope_traditional": True,
    }
    params = {"model.embed_tokens.weight": g.tensor("token_embd.weight")}
    params["model.norm.weight"] = g.tensor("output_norm.weight")
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in names.items():
            params[f"model.layers.{i}.{theirs}.weight"] = g.tensor(f"blk.{i}.{ours}.weight")
    return numpy_llama.logits(params, cfg, np.array([list(ids)]))[0]


def numpy_gemma3(ids):
    """Gemma 3's logits [T, V] from the GGUF (tests/real_models.py: the forward pass) by its tied
    output embedding."""
    hidden, _ = real_models.numpy_gemma3(ids)
    return hidden @ gguf(GEMMA3).tensor("token_embd.weight").T


@pytest.mark.parametrize(
    "name,dtype,reference",
    [(SMOLLM2, "float32", numpy_smollm2), (SMOLLM2, "q4", numpy_smollm2), (GEMMA3, "float32", numpy_gemma3)],
)
def test_logits_agree_with_an_independent_forward_pass_from_the_gguf(name, dtype, reference):
    ids = tuple(loaded(name)[1].encode(PROMPT))
    expected = reference(ids)
    model, _ = loaded(name, dtype)
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    worst = float(np.abs(got - expected).max() / np.abs(expected).max())
    assert worst <= TOLERANCE, f"{name} {dtype}: max |logit diff| / max |logit| = {worst:.2e}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_bfloat16_weights_are_the_float32_ones_rounded():
    f32 = mx.load(str(fetch(SMOLLM2, dtype="float32") / "model.safetensors"))
    bf16 = mx.load(str(fetch(SMOLLM2, dtype="bfloat16") / "model.safetensors"))
    assert f32.keys() == bf16.keys()
    for name, w in f32.items():
        assert bf16[name].dtype == mx.bfloat16 and mx.array_equal(w.astype(mx.bfloat16), bf16[name]).item(), name


FACTS = {  # SmolLM2-Instruct asked in its chat template (the capital of France: tests/test_real_serve.py);
    # Gemma 3 270M (pretrained) continues text
    SMOLLM2: [("What is 2 + 2?", "4")],
    GEMMA3: [("The capital of Japan is", "Tokyo"), ("Monday, Tuesday, Wednesday,", "Thursday")],
}
#: tokens generated per answer: SmolLM2 opens its answer with a sentence; Gemma 3 continues with
#: the fact (each generated token pays its 262,144-row output head)
MAX_TOKENS = {SMOLLM2: 10, GEMMA3: 3}


@pytest.mark.parametrize("name", [SMOLLM2, GEMMA3])
def test_greedy_answers_are_the_expected_facts(name):
    model, tokenizer = loaded(name)
    for question, fact in FACTS[name]:
        prompt = chat_prompt(tokenizer, question) if tokenizer.chat_template else question
        answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS[name])
        assert fact.lower() in answer.lower(), (question, answer)
