"""Every path that runs an mlx-lm model attends TurboQuant from its codes: ``mlx_lm.generate``,
``stream_generate``, ``BatchGenerator`` / ``batch_generate`` and ``mlxkv serve``, eager and
through ``mlxkv.compiled_model``. Each run counts the codes attentions and the window decodes
(there must be none) and, on float32 weights, gives the exact read's tokens
(docs/turboquant.md: in float32 the two reads differ by summation order only)."""

import warnings

import mlx.core as mx
import mlx_lm
import pytest
from batch_helpers import tokens_at_once
from mlx_lm.generate import BatchGenerator, batch_generate
from serve_helpers import Running, openai_client, words

import mlxkv
from mlxkv.models.seeded import build_model, prompt, tokenizer

SCHEME = "turbo-k8v3"


@pytest.fixture(scope="module")
def float32_llama():
    return build_model("llama", dtype=mx.float32)


def caches(model, codes=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mlxkv.make_cache(model, SCHEME, codes=codes)


PROMPTS = [prompt(n, seed=40 + n) for n in (7, 30, 18)]


def serial_text(model, codes, compiled=False, stream=False, p=PROMPTS[1], n=12):
    m = mlxkv.compiled_model(model) if compiled else model
    if stream:
        return "".join(
            r.text for r in mlx_lm.stream_generate(m, tokenizer(), p, max_tokens=n, prompt_cache=caches(model, codes))
        )
    return mlx_lm.generate(m, tokenizer(), p, max_tokens=n, prompt_cache=caches(model, codes))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream_generate"])
def test_generate_and_stream_generate_attend_the_codes(float32_llama, codes_reads, compiled, stream):
    want = serial_text(float32_llama, False)
    before = dict(codes_reads)
    assert serial_text(float32_llama, True, compiled, stream) == want
    assert codes_reads["decode"] == before["decode"] and codes_reads["attend"] > before["attend"]


def batch_tokens(model, codes, compiled=False):
    gen = BatchGenerator(mlxkv.compiled_model(model) if compiled else model, completion_batch_size=4)
    return tokens_at_once(gen, PROMPTS, 10, lambda: caches(model, codes))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_batch_generator_attends_the_codes(float32_llama, codes_reads, compiled):
    want = batch_tokens(float32_llama, False)
    before = dict(codes_reads)
    assert batch_tokens(float32_llama, True, compiled) == want
    assert codes_reads["decode"] == before["decode"] and codes_reads["attend"] > before["attend"]
    out = batch_generate(
        float32_llama, tokenizer(), PROMPTS, max_tokens=6, prompt_caches=[caches(float32_llama) for _ in PROMPTS]
    )
    assert len(out.texts) == len(PROMPTS) and codes_reads["decode"] == before["decode"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mlxkv_serve_attends_the_codes(llama_dir, codes_reads, compiled):
    server = Running("--model", llama_dir, "--scheme", SCHEME, *(["--compiled"] if compiled else []))
    try:
        client = openai_client(server.port)
        out = client.completions.create(model="default_model", prompt=words(PROMPTS[1]), max_tokens=8, temperature=0.0)
    finally:
        server.stop()
    assert out.choices[0].text
    assert codes_reads["decode"] == 0 and codes_reads["attend"] > 0
