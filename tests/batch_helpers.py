"""Driving mlx-lm's BatchGenerator as a server does, shared by the batch-engine tests."""


def drive(gen, prompts, max_tokens, make, join_at):
    """Every prompt but the last starts at once, the last joins after ``join_at`` decode
    steps; rows finish at their own ``max_tokens``. ``make()`` gives a row's caches. Returns
    per row, in prompt order: tokens, log-probabilities, the finished row's caches."""
    uids = gen.insert(prompts[:-1], list(max_tokens[:-1]), caches=[make() for _ in prompts[:-1]])
    toks, lps, caches, steps = {}, {}, {}, 0
    while responses := gen.next_generated():
        steps += 1
        if steps == join_at:
            uids += gen.insert([prompts[-1]], [max_tokens[-1]], caches=[make()])
        for r in responses:
            toks.setdefault(r.uid, []).append(r.token)
            lps.setdefault(r.uid, []).append(r.logprobs)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    return [toks[u] for u in uids], [lps[u] for u in uids], [caches[u] for u in uids]


def tokens_at_once(gen, prompts, max_tokens, make):
    """Every prompt starts at once with ``max_tokens`` each; ``make()`` gives a row's caches.
    Returns each row's tokens, in prompt order."""
    uids = gen.insert(prompts, [max_tokens] * len(prompts), caches=[make() for _ in prompts])
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]
