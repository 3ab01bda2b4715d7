"""TurboQuant on the real models attends from its codes: SmolLM2 (llama, 3 kv heads of 64) and
Gemma 3 270M (its sliding-window rings kept bf16, its global layers TurboQuant, one kv head of
256) through ``mlx_lm.generate``, eager and compiled, and ``BatchGenerator``: no window is
decoded, and in float32 the greedy tokens are the exact read's (docs/turboquant.md: the two
reads differ by summation order only)."""

import warnings

import mlx_lm
import pytest
from batch_helpers import tokens_at_once
from mlx_lm.generate import BatchGenerator
from real_models import GEMMA3, SMOLLM2, loaded

import mlxkv

pytestmark = pytest.mark.real

SCHEME = "turbo-k8v3"
QUESTIONS = ["Why is the sky blue?", "Name three rivers of Europe and the seas they reach."]


def prompts(tokenizer):
    """The questions as plain text: SmolLM2's chat template would add a 30-token system turn
    to each prompt, which reads no differently from the codes than the question does."""
    return [tokenizer.encode(q) for q in QUESTIONS]


def caches(model, codes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mlxkv.make_cache(model, SCHEME, codes=codes)


def generated(model, tokenizer, prompt, codes, compiled=False):
    m = mlxkv.compiled_model(model) if compiled else model
    return mlx_lm.generate(m, tokenizer, prompt, max_tokens=4, prompt_cache=caches(model, codes))


def batched(model, rows, codes):
    gen = BatchGenerator(model, completion_batch_size=len(rows))
    return tokens_at_once(gen, rows, 4, lambda: caches(model, codes))


@pytest.mark.parametrize("name", [SMOLLM2, GEMMA3])
def test_real_models_attend_turboquant_from_the_codes(name, codes_reads):
    model, tokenizer = loaded(name)
    rows = prompts(tokenizer)
    exact_text, exact_rows = generated(model, tokenizer, rows[0], codes=False), batched(model, rows, codes=False)
    before = dict(codes_reads)
    for compiled in (False, True):
        assert generated(model, tokenizer, rows[0], codes=True, compiled=compiled) == exact_text, (name, compiled)
    assert batched(model, rows, codes=True) == exact_rows, name
    assert codes_reads["decode"] == before["decode"] and codes_reads["attend"] > before["attend"]
