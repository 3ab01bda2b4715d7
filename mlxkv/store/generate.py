"""``mlx_lm.generate`` and ``mlx_lm.stream_generate`` over a prompt store.

Each call takes the best prefix of the prompt from the store (fresh caches when there is
none), lets mlx-lm forward only the rest, and puts the caches back under every token they
then cover (prompt and generated). When some cache cannot trim (recurrent state, a ring that
may wrap, eviction), a prompt that merely repeats would never reuse an entry that went past
it, so the prompt minus its last token is prefilled first and, when the caches cannot trim
then, put: the boundary snapshot a later request with the same prompt reuses whole.
"""

import contextlib
from collections.abc import Iterator, Sequence

import mlx.core as mx

from ..caches.schemes import make_cache
from ..errors import StoreCapacityError
from ..state.reuse import reuse_of


def _tokens(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, str):  # as mlx_lm.stream_generate does
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    return [int(t) for t in prompt]


def _prefill(model, caches, tokens: Sequence[int], step: int) -> None:
    for i in range(0, len(tokens), step):
        model(mx.array([list(tokens[i : i + step])]), cache=caches)
        mx.eval([c.state for c in caches])


def stream_generate(
    model,
    tokenizer,
    prompt,
    store,
    *,
    ns: str = "",
    scheme: str = "bf16",
    cache_options: dict | None = None,
    boundary: bool | None = None,
    prefill_step_size: int = 2048,
    **kwargs,
) -> Iterator:
    """``mlx_lm.stream_generate(model, tokenizer, prompt, **kwargs)`` with its caches from
    ``store``: yields mlx-lm's ``GenerationResponse`` objects; ``prompt_tokens`` in them
    counts the tokens actually forwarded. ``scheme`` (and ``cache_options`` for
    ``make_cache``) builds the caches when the store has no prefix. ``boundary``: put the
    prompt-boundary snapshot (default: when some cache cannot trim after the prompt; False
    never, True always)."""
    import mlx_lm

    tokens = _tokens(tokenizer, prompt)
    hit = store.take(tokens, ns=ns)
    if hit is not None:
        caches, start = hit.caches, hit.prefix_len
    else:
        caches, start = make_cache(model, scheme, **(cache_options or {})), 0
    rest = tokens[start:]
    forwarded = len(rest)
    if boundary is not False and len(rest) > 1 and (boundary or not kwargs.get("logits_processors")):
        # the same chunks mlx-lm would prefill, so the result is the same; a processor that
        # tracks the prompt (a repetition penalty) would miss them, so not then by default
        _prefill(model, caches, rest[:-1], prefill_step_size)
        if boundary or not reuse_of(caches).trimmable:
            _put_back(store, tokens[:-1], caches, ns)
        rest = rest[-1:]
    generated, failed = [], False
    try:
        for response in mlx_lm.stream_generate(
            model, tokenizer, mx.array(rest), prompt_cache=caches, prefill_step_size=prefill_step_size, **kwargs
        ):
            generated.append(int(response.token))
            response.prompt_tokens = forwarded  # mlx-lm saw only the last token of them
            yield response
    except GeneratorExit:  # the caller stopped early: the caches are whole, keep them
        raise
    except BaseException:  # a forward may have stopped half way: nothing to keep
        failed = True
        raise
    finally:
        if not failed:
            _put_back(store, tokens + generated, caches, ns)


def _put_back(store, tokens, caches, ns):
    covered = tokens[: caches[0].offset]  # mlx-lm forwards every token it yields
    with contextlib.suppress(StoreCapacityError):  # larger than the store: the generation stands
        store.put(covered, caches, ns=ns)


def generate(model, tokenizer, prompt, store, *, verbose: bool = False, **kwargs) -> str:
    """``mlx_lm.generate`` over a prompt store: the generated text (see
    :func:`stream_generate` for the store's part)."""
    text = ""
    for response in stream_generate(model, tokenizer, prompt, store, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
    return text
