"""mlx-lm's own continuous-batching engine (``BatchGenerator``, ``batch_generate``) driving
mlxkv caches of every scheme on the three seeded architectures: prompts of different
lengths, a row joining while others decode, rows finishing early. Every row gets the tokens
and the log-probabilities it gets alone, bit for bit."""

import copy

import mlx.core as mx
import pytest
from batch_helpers import drive
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import LRUPromptCache

import mlxkv
from mlxkv.models.seeded import ARCHITECTURES, SCHEMES, prompt, tokenizer

LENS, MAX_TOKENS, JOIN_AT = (5, 23, 40, 12), (8, 3, 8, 6), 2
STEP = 16  # prefill chunk: the long prompts prefill in several padded chunks


def serial(model, scheme, p, n):
    caches = mlxkv.make_cache(model, scheme)
    steps = generate_step(mx.array(p), model, max_tokens=n, prompt_cache=caches, prefill_step_size=STEP)
    toks, lps = zip(*((int(t), lp) for t, lp in steps))
    return list(toks), list(lps), caches


def batched(model, scheme, prompts):
    """Rows 0-2 start together, row 3 joins after JOIN_AT decode steps; rows finish early."""
    gen = BatchGenerator(model, prefill_step_size=STEP, completion_batch_size=4, prefill_batch_size=2)
    make = lambda: mlxkv.make_cache(model, scheme)
    return drive(gen, prompts, MAX_TOKENS, make, JOIN_AT)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_generator_gives_every_row_its_serial_tokens(models, arch, scheme):
    model = models(arch)
    prompts = [prompt(n, seed=30 + i) for i, n in enumerate(LENS)]
    toks, lps, finished = batched(model, scheme, prompts)
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        ref_toks, ref_lps, ref_caches = serial(model, scheme, p, n)
        assert toks[i] == ref_toks, f"row {i}"
        assert all(mx.array_equal(a, b).item() for a, b in zip(lps[i], ref_lps)), f"row {i}"
        # the finished row comes back as mlxkv serial caches holding its prompt and tokens
        assert [c.kind for c in finished[i]] == [c.kind for c in ref_caches]
        # ... every reported token included: the engine feeds a token before it reports it
        assert [c.offset for c in finished[i] if c.kind != "ssm"][0] == len(p) + n


def test_batch_generate_takes_and_returns_mlxkv_prompt_caches(models):
    """``batch_generate(prompt_caches=...)`` continues caller caches (never modified) and
    hands back extracted mlxkv caches that continue exactly."""
    model, tok = models("hybrid"), tokenizer()
    heads = [prompt(n, seed=80 + n) for n in (9, 21)]
    tails = [prompt(3, seed=1), prompt(6, seed=2)]
    mine = []
    for h in heads:
        c = mlxkv.make_cache(model, "turbo-k4v2-start16")
        mx.eval(model(mx.array(h)[None], cache=c))
        mine.append(c)
    kept = copy.deepcopy(mine)
    out = batch_generate(
        model, tok, tails, prompt_caches=mine, max_tokens=5, return_prompt_caches=True, return_token_ids=True
    )
    assert [c.offset for c in mine[0]] == [c.offset for c in kept[0]]  # the caller's caches are untouched
    for i, (h, t) in enumerate(zip(heads, tails)):
        ref = mlxkv.make_cache(model, "turbo-k4v2-start16")
        mx.eval(model(mx.array(h)[None], cache=ref))
        want = [int(x) for x, _ in generate_step(mx.array(t), model, max_tokens=5, prompt_cache=ref)]
        want = want[: want.index(0)] if 0 in want else want  # the eos token ends a row
        assert out.token_ids[i] == want
        got = out.caches[i]
        assert all(isinstance(c, (mlxkv.Bf16FirstCache, mlxkv.ArraysCache)) for c in got)
        y = mx.array([[7]])
        assert mx.array_equal(model(y, cache=got), model(y, cache=ref))


def test_mlx_lm_prompt_cache_stores_and_serves_mlxkv_caches(models):
    """mlx-lm's LRUPromptCache deep-copies, trims and measures mlxkv caches."""
    model = models("llama")
    lru = LRUPromptCache(max_size=4)
    tokens = prompt(30)
    caches = mlxkv.make_cache(model, "kv4")
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    lru.insert_cache("m", tokens, caches)
    assert lru.nbytes == sum(c.nbytes for c in caches) > 0
    hit, rest = lru.fetch_nearest_cache("m", tokens[:20] + [1, 2])  # a longer entry, trimmed
    assert rest == [1, 2] and [c.offset for c in hit] == [20] * 4
    assert [c.offset for c in caches] == [30] * 4  # served a copy
    exact, rest = lru.fetch_nearest_cache("m", tokens)
    assert rest == [] and exact[0] is not caches[0] and mx.array_equal(exact[0].keys[0], caches[0].keys[0])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_mlx_lms_byte_accounting_measures_the_caches_of_queued_requests(models, scheme):
    """With a byte cap mlx-lm's server sums ``nbytes`` over the caches of queued requests
    (``BatchGenerator.prompt_cache_nbytes``) after every insertion, and its ``LRUPromptCache``
    over what it stores: a fresh cache of every scheme holds 0 bytes (an empty affine cache
    once raised AttributeError there, and every completion of `mlxkv serve --scheme kv4
    --prompt-cache-bytes 1GB` got HTTP 500)."""
    model = models("llama")
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
    gen.insert([prompt(9), prompt(13)], [4, 4], caches=[mlxkv.make_cache(model, scheme) for _ in range(2)])
    assert gen.prompt_cache_nbytes == 0
    lru = LRUPromptCache(max_size=4, max_bytes=1 << 20)
    lru.insert_cache("m", [1, 2], mlxkv.make_cache(model, scheme))
    assert lru.nbytes == 0
    gen.next_generated()  # the prompts are prefilled: their caches hold bytes now
    assert gen.prompt_cache_nbytes > 0
    gen.close()


def test_a_row_removed_mid_decode_comes_back_as_its_serial_caches(models):
    """``BatchGenerator.remove(uids, return_prompt_caches=True)`` and ``prompt_cache_nbytes``."""
    model = models("gemma3")
    prompts = [prompt(n, seed=70 + n) for n in (9, 37)]
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
    uids = gen.insert(prompts, [50, 50], caches=[mlxkv.make_cache(model, "turbo-k4v2-start16") for _ in prompts])
    produced = {u: [] for u in uids}
    for _ in range(6):
        for r in gen.next_generated():
            produced[r.uid].append(r.token)
    assert gen.prompt_cache_nbytes > 0
    (caches, tokens) = gen.remove([uids[0]], return_prompt_caches=True)[uids[0]]
    assert tokens == prompts[0] + produced[uids[0]]
    ref = mlxkv.make_cache(model, "turbo-k4v2-start16")
    n = len(prompts[0]) - 1
    mx.eval(model(mx.array(tokens[:n])[None], cache=ref))  # as the engine fed them: the prompt, then one by one
    for t in tokens[n:]:
        model(mx.array([[t]]), cache=ref)
    assert [c.kind for c in caches] == [c.kind for c in ref] and [c.offset for c in caches] == [c.offset for c in ref]
    y = mx.array([[3]])
    assert mx.array_equal(model(y, cache=caches), model(y, cache=ref))
    rest = gen.next_generated()
    assert {r.uid for r in rest} == {uids[1]}
    gen.close()
