"""The store under an engine: mlx_lm.generate / stream_generate through the store helper,
and the adapter that stands in for mlx-lm's LRUPromptCache, driven the way mlx-lm's server
drives its prompt cache."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import LRUPromptCache
from store_helpers import build

import mlxkv
from mlxkv import MLXKVError, PromptStore
from mlxkv.models.seeded import prompt, tokenizer
from mlxkv.store import StoreOptions, StorePromptCache, generate, stream_generate

CAP = 64 << 20


def _reference(model, tokens, n):
    caches = mlxkv.make_cache(model, "bf16")
    stream = mlx_lm.stream_generate(model, tokenizer(), mx.array(tokens), max_tokens=n, prompt_cache=caches)
    return [r.token for r in stream]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "hybrid"])
def test_stream_generate_reuses_and_puts_back(models, arch):
    model = models(arch)
    tok = tokenizer()
    store = PromptStore(model, tok, cap=CAP)
    system = prompt(48, seed=1)
    first = system + prompt(10, seed=2)
    out = list(stream_generate(model, tok, first, store, max_tokens=6))
    assert [r.token for r in out] == _reference(model, first, 6)
    assert out[0].prompt_tokens == len(first)
    covered = first + [r.token for r in out]
    assert any(t == covered for _, t, _, _ in store.entries())  # every token the caches cover

    again = list(stream_generate(model, tok, first, store, max_tokens=6))
    assert [r.token for r in again] == [r.token for r in out]
    assert again[0].prompt_tokens == 1  # the boundary snapshot (or a trim) serves the whole prompt

    second = system + prompt(12, seed=3)
    out2 = list(stream_generate(model, tok, second, store, max_tokens=6))
    assert [r.token for r in out2] == _reference(model, second, 6)
    if arch == "llama":  # trimmable: the system prompt is reused from the first entry
        assert out2[0].prompt_tokens == 12


def test_generate_returns_mlx_lms_text(models):
    model = models("llama")
    tok = tokenizer()
    store = PromptStore(model, tok, cap=CAP)
    text = "<01> <02> <03> <04> <05> <06> <07> <08>"
    want = mlx_lm.generate(model, tok, text, max_tokens=5, prompt_cache=mlxkv.make_cache(model, "bf16"))
    assert generate(model, tok, text, store, max_tokens=5) == want
    assert generate(model, tok, text, store, max_tokens=5) == want
    assert store.stats["hits"]["ram"] == 1


def test_stopping_early_keeps_the_caches(models):
    model = models("llama")
    tok = tokenizer()
    store = PromptStore(model, tok, cap=CAP)
    tokens = prompt(30, seed=1)
    stream = stream_generate(model, tok, tokens, store, max_tokens=20)
    got = [next(stream).token for _ in range(3)]
    stream.close()
    (_, held, _, _) = store.entries()[-1]
    assert held == tokens + got


def _serve_single(cache_store, model, model_key, prompt_tokens, n):
    """mlx-lm's server, sequential path (ResponseGenerator._serve_single), as far as the
    prompt cache is concerned."""
    cache_key = prompt_tokens[:]
    cache, rest = cache_store.fetch_nearest_cache(model_key, cache_key)
    cached = len(prompt_tokens) - len(rest)
    rest = prompt_tokens[cached:]
    if cache is None:
        cache = mlxkv.make_cache(model, "bf16")
    out = []
    for gen in mlx_lm.stream_generate(model, tokenizer(), mx.array(rest), max_tokens=n, prompt_cache=cache):
        out.append(gen.token)
        cache_key.append(gen.token)
    cache_store.insert_cache(model_key, cache_key, cache)
    return out, cached


def test_adapter_serves_mlx_lms_call_pattern(models):
    model = models("llama")
    key = ("seeded/llama", None, None)
    adapter = StorePromptCache(PromptStore(model, tokenizer(), cap=CAP))
    system = prompt(40, seed=1)
    history, previous = system + prompt(8, seed=2), []
    for turn in range(3):
        out, cached = _serve_single(adapter, model, key, history, 5)
        assert out == _reference(model, history, 5)
        if turn:
            assert cached == len(previous)  # the whole previous turn, generated tokens included
        previous = history + out
        history = previous + prompt(6, seed=10 + turn)
    other, cached = _serve_single(adapter, model, key, system + prompt(9, seed=30), 5)
    assert cached >= len(system)
    assert len(adapter) >= 1 and adapter.nbytes == adapter.store.nbytes
    stats = adapter.stats_by_type()
    assert sum(s["n_sequences"] for s in stats.values()) == len(adapter)
    assert sum(s["n_bytes"] for s in stats.values()) == adapter.nbytes


def test_adapter_never_returns_nothing_to_forward(models):
    """mlx-lm's LRUPromptCache answers an exact match with the whole cache and no token left
    to forward; the adapter always leaves one."""
    model = models("llama")
    tokens = prompt(20, seed=1)
    lru = LRUPromptCache()
    lru.insert_cache("m", tokens, build(model, "bf16", {}, tokens, 20))
    assert lru.fetch_nearest_cache("m", tokens)[1] == []
    adapter = StorePromptCache(PromptStore(model, tokenizer(), cap=CAP))
    adapter.insert_cache("m", tokens, build(model, "bf16", {}, tokens, 20))
    cache, rest = adapter.fetch_nearest_cache("m", tokens)
    assert rest == tokens[-1:] and cache[0].offset == 19


def test_adapter_batched_path_calls(models):
    """The batched path inserts at segment ends with a cache type, trims to leave room for the
    active batch, and namespaces by adapter; refused inserts never fail a request."""
    model = models("llama")
    per_token = 4 * 2 * 2 * 64 * 2
    adapter = StorePromptCache(PromptStore(model, tokenizer(), cap=200 * per_token))
    sysp = prompt(40, seed=1)
    adapter.insert_cache(("m", None, None), sysp, build(model, "bf16", {}, sysp, 40), cache_type="system")
    user = sysp + prompt(30, seed=2)
    adapter.insert_cache(("m", "lora-a", None), user, build(model, "bf16", {}, user, 70), cache_type="user")
    assert adapter.fetch_nearest_cache(("m", None, None), user)[1] == user[40:]
    assert adapter.fetch_nearest_cache(("m", "lora-a", None), user)[1] == user[-1:]
    stats = adapter.stats_by_type()
    assert stats["system"]["n_sequences"] == 1 and stats["user"]["n_sequences"] == 1
    adapter.trim_to(n_bytes=75 * per_token)  # the least recently used (the system prompt) goes
    assert adapter.nbytes == 70 * per_token and len(adapter) == 1
    # caches covering one token fewer than the server passes (it appends the last sampled token)
    more = prompt(30, seed=3)
    adapter.insert_cache(("m", None, None), more + [9], build(model, "bf16", {}, more, 30))
    assert adapter.fetch_nearest_cache(("m", None, None), more + [1])[1] == [1]
    big = prompt(300, seed=4)
    adapter.insert_cache(("m", None, None), big, build(model, "bf16", {}, big, 300))  # over the cap
    assert adapter.refused == 1


def test_store_options_refuse_a_bad_flag_before_any_model_loads(tmp_path):
    """What a server builds from its flags is checked when made: a directory that is a file,
    a URL that is not Redis's, --redis without the deployment's secret."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(MLXKVError, match="not a directory"):
        StoreOptions(cap=1 << 20, directory=str(f))
    with pytest.raises(MLXKVError, match="URL"):
        StoreOptions(cap=1 << 20, redis="not-a-url", secret="s" * 16)
    with pytest.raises(MLXKVError, match="secret"):
        StoreOptions(cap=1 << 20, redis="redis://127.0.0.1:1/0")
    StoreOptions(cap=1 << 20, redis="redis://127.0.0.1:1/0", secret="s" * 16)  # nothing is sent yet


def test_the_adapter_opens_its_store_when_the_model_loads(models, tmp_path):
    """Until bind, a fetch misses and an insert is dropped; bind opens the store of the
    model (its open report names the directory), close returns the last flush report."""
    model = models("llama")
    adapter = StorePromptCache(options=StoreOptions(cap=CAP, directory=str(tmp_path), scheme="bf16"))
    tokens = prompt(30, seed=1)
    adapter.insert_cache("m", tokens, build(model, "bf16", {}, tokens, 30))
    assert adapter.fetch_nearest_cache("m", tokens + [1]) == (None, tokens + [1]) and adapter.counters() == {}
    adapter.bind(model, tokenizer())
    assert [o.tier for o in adapter.open_report] == ["ram", "disk"]
    adapter.insert_cache("m", tokens, build(model, "bf16", {}, tokens, 30))
    assert adapter.fetch_nearest_cache("m", tokens + [1])[1] == [1]
    assert adapter.counters()["tiers"]["ram"]["hits"] == 1
    report = adapter.close()
    assert [len(t) for _, t in report.durable] == [30] and adapter.fetch_nearest_cache("m", tokens)[0] is None
