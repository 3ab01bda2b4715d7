"""What a cache scheme costs in answers, measured on a model: the same text through the
scheme's caches and through a reference's (a plain cache), compared position by position.

Comparing schemes on your own model (docs/choosing-a-scheme.md, "Measuring your own model"):

- :class:`Candidate`: one cache setup, ``make_cache(model, scheme, **options)``, and a label;
- :func:`compare_schemes`: candidates against the first one (the reference) on texts at
  several context lengths: perplexity and KL of the next-token distributions near each
  context length, agreement of greedy continuations, cache bytes per token; one row per
  candidate, text and context, :func:`summarize` folds the texts together;
- :func:`passkey_prompt`, :func:`greedy_tokens`, :func:`passkey_retrieval`: a key hidden in
  filler text, asked for at the end, answered greedily through each candidate's caches;
- :func:`cache_bytes`: what a candidate's caches hold at a context length, for keys and
  values of any dtype, without running the model;
- :func:`query_anisotropy`, :func:`attention_rank_correlation`: Q-Filters' premises measured
  on a model's own queries and attention (docs/qfilters.md, "On real models").

Building blocks the toy benchmark and the TurboQuant tests use: :func:`prefill_logprobs`,
:func:`text_scores`, :func:`teacher_forced_logprobs`, :func:`greedy_flips`,
:func:`held_bytes`, :func:`marginal_bytes`, and :class:`NamedReadSite` with
:func:`named_read_attention` (mlx-lm's attention on the seeded architectures attends through a
cache's named read, the TurboQuant codes read).
"""

import contextlib
import copy
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .caches.schemes import attention_geometry, layer_template, make_cache
from .errors import MLXKVError


def _eval_caches(caches):
    mx.eval([c.state for c in caches])


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill_logprobs(model, caches, tokens: mx.array, chunk: int) -> mx.array:
    """Log-probabilities [B, L, V] (float32): tokens ``0 .. L-2`` prefilled in chunks of
    ``chunk``, the last token appended as a decode step, so the caches end in the state a
    generation sees (a rotating window drops the extra rows a multi-token block leaves)."""
    L = tokens.shape[1]
    bounds = [(i, min(i + chunk, L - 1)) for i in range(0, L - 1, chunk)] + [(L - 1, L)]
    out = []
    for a, b in bounds:
        lp = _logprobs(model(tokens[:, a:b], cache=caches))
        mx.eval(lp)
        _eval_caches(caches)
        out.append(lp)
    return mx.concatenate(out, axis=1)


def text_scores(lp: mx.array, ref_lp: mx.array, tokens: mx.array, first: int) -> tuple[float, float]:
    """(mean NLL, mean KL(ref || lp)) over predictions made at positions ``first .. L-2``."""
    lp, ref = lp[:, first:-1], ref_lp[:, first:-1]
    nll = -mx.take_along_axis(lp, tokens[:, first + 1 :, None], axis=-1)
    kl = mx.sum(mx.exp(ref) * (ref - lp), axis=-1)
    return float(mx.mean(nll).item()), float(mx.mean(kl).item())


def teacher_forced_logprobs(model, caches, tokens, prefill: int) -> mx.array:
    """Log-probabilities [steps, vocab] (float32) of one decode step per token after the first
    ``prefill`` tokens, which are forwarded as one block."""
    model(mx.array(tokens[:prefill])[None], cache=caches)
    out = []
    for t in tokens[prefill:]:
        out.append(_logprobs(model(mx.array([[t]]), cache=caches)[0, -1]))
    return mx.stack(out)


def greedy_flips(reference: mx.array, other: mx.array) -> list[float]:
    """The reference's top-two gap at every step where the two runs' greedy tokens differ."""
    flips = (mx.argmax(reference, -1) != mx.argmax(other, -1)).tolist()
    top2 = mx.sort(reference, axis=-1)[:, -2:]
    return [g for g, f in zip((top2[:, 1] - top2[:, 0]).tolist(), flips) if f]


def held_bytes(caches) -> int:
    """Bytes the caches hold (their own ``nbytes``, allocation slack included)."""
    return int(sum(c.nbytes for c in caches))


def marginal_bytes(caches) -> int:
    """Bytes one more stored token costs in all the caches (an eviction cache at its budget
    stores no more tokens: it swaps one)."""
    return int(sum(c.bytes_per_token() for c in caches))


# -- candidates ----------------------------------------------------------------------------


@dataclass
class Candidate:
    """One cache setup to compare: ``make_cache(model, scheme, **options)`` (for example
    ``options={"max_kv_size": 256}`` or ``{"qfilters_calibration": cal}``), shown as ``label``;
    ``tags`` are copied into every row measured with it."""

    label: str
    scheme: str = "bf16"
    options: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)

    def caches(self, model) -> list:
        return make_cache(model, self.scheme, **self.options)

    def describe(self) -> dict:
        """The row fields that say what was measured (options by name; objects by type)."""
        opts = {k: v if isinstance(v, (int, float, str, bool)) else type(v).__name__ for k, v in self.options.items()}
        return {"label": self.label, "scheme": self.scheme, "options": opts, **self.tags}


# -- log-probabilities of chosen positions ----------------------------------------------------


class PositionLogprobs:
    """Log-probabilities of chosen positions of a block: the model's body for every position,
    its output head only for the chosen ones (a vocabulary of 262,144 makes the head most of a
    small model's prefill). Used only where ``head(body(x))`` equals ``model(x)`` bit for bit
    on a probe (mlx-lm's llama, gemma3 and the like); otherwise the full logits, sliced."""

    def __init__(self, model):
        self.model = model
        self.body = self.head = None
        body = getattr(model, "model", None)
        head = getattr(model, "lm_head", None)
        if head is None:
            head = getattr(getattr(body, "embed_tokens", None), "as_linear", None)
        if callable(body) and callable(head):
            probe = mx.array([[1, 2, 3, 4]])
            try:
                split = head(body(probe, None))
                whole = model(probe)
                if split.shape == whole.shape and bool(mx.array_equal(split, whole).item()):
                    self.body, self.head = body, head
            except (TypeError, ValueError, AttributeError):
                pass

    @property
    def split(self) -> bool:
        return self.body is not None

    def __call__(self, tokens: mx.array, caches, rows: np.ndarray | None) -> mx.array | None:
        """Forward ``tokens`` [1, n] through ``caches``; log-probabilities [len(rows), V]
        (float32) of the block's rows ``rows`` (None: no head at all, the caches only)."""
        if self.split:
            h = self.body(tokens, caches)
            out = None if rows is None or len(rows) == 0 else _logprobs(self.head(h[0, mx.array(rows)]))
        else:
            logits = self.model(tokens, cache=caches)
            out = None if rows is None or len(rows) == 0 else _logprobs(logits[0, mx.array(rows)])
        mx.eval(out if out is not None else h if self.split else logits)
        _eval_caches(caches)
        return out


def _step_logprobs(model, caches, token: int) -> mx.array:
    lp = _logprobs(model(mx.array([[token]]), cache=caches)[0, -1])
    mx.eval(lp)
    _eval_caches(caches)
    return lp


def _kl(ref: mx.array, lp: mx.array) -> mx.array:
    """KL(ref || lp) per row, nats (both log-probabilities)."""
    return mx.sum(mx.exp(ref) * (ref - lp), axis=-1)


def _block_se(values: np.ndarray, block: int) -> float:
    """Standard error of the mean of ``values`` from the means of consecutive blocks (next-token
    losses of nearby positions are correlated; blocks of ``block`` positions are treated as
    independent)."""
    n = len(values) // block
    if n < 2:
        return float("nan")
    means = values[: n * block].reshape(n, block).mean(axis=1)
    return float(means.std(ddof=1) / math.sqrt(n))


def schedule(contexts: Sequence[int], chunk: int):
    """The blocks :func:`compare_schemes` feeds, as ``(start, end)`` token ranges: for each
    context ``L`` (ascending), tokens up to ``L - 1`` in blocks ending at multiples of
    ``chunk``, then token ``L - 1`` alone (the decode step a generation starts with)."""
    pos = 0
    for L in contexts:
        while pos < L - 1:
            end = min((pos // chunk + 1) * chunk, L - 1)
            yield pos, end
            pos = end
        yield L - 1, L
        pos = L


@dataclass
class _Context:
    """What one run measured at one context length."""

    nll: np.ndarray  # per scored position
    kl: np.ndarray  # per scored position, against the reference (zeros for the reference)
    lp: mx.array | None  # [scored, V]: the reference's only
    decode_lp: mx.array | None  # [continuation, V]: the reference's only
    decode_kl: float
    greedy: list  # the arg-max after L - 1, then after each decode step
    held: int
    marginal: int
    seconds: float


def _run(model, heads, caches, tokens, contexts, chunk, window, continuation, ref: dict | None) -> dict:
    """One candidate through one text along :func:`schedule`; the ``window`` positions before
    ``L - 1`` are scored, the caches' bytes read once token ``L - 1`` is in, then
    ``continuation`` decode steps run on a copy of the caches: fed the reference's greedy
    tokens when ``ref`` (its runs per context) is given, the run's own greedy tokens otherwise.
    The main caches go on to the next context."""
    out, lps, t0 = {}, [], time.perf_counter()
    ends = {L - 1: L for L in contexts}
    for a, b in schedule(contexts, chunk):
        L = ends.get(a)
        if L is None:  # a prefill block (the block at L - 1 is the decode step)
            first = _next_context(contexts, a) - 1 - window
            rows = np.arange(max(a, first), b) - a
            lp = heads(mx.array(tokens[None, a:b]), caches, rows if len(rows) else None)
            if lp is not None:
                lps.append(lp)
            continue
        first = L - 1 - window  # scored: positions first .. L-2, predicting first+1 .. L-1
        scored = mx.concatenate(lps)
        lps = []
        nll = -mx.take_along_axis(scored, mx.array(tokens[first + 1 : L])[:, None], axis=-1)[:, 0]
        last = _step_logprobs(model, caches, int(tokens[L - 1]))
        held, marginal = held_bytes(caches), marginal_bytes(caches)
        fork = copy.deepcopy(caches)
        r = None if ref is None else ref[L]
        decode, greedy, decode_kl = [last], [int(mx.argmax(last).item())], []
        for i in range(continuation):
            lp = decode[-1]
            if r is not None:  # compared at once, not kept
                decode_kl.append(float(_kl(r.decode_lp[i], lp).item()))
                decode.pop()
            if i < continuation - 1:
                decode.append(_step_logprobs(model, fork, greedy[i] if r is None else r.greedy[i]))
                greedy.append(int(mx.argmax(decode[-1]).item()))
        del fork
        out[L] = _Context(
            nll=np.array(nll),
            kl=np.zeros(len(nll)) if r is None else np.array(_kl(r.lp, scored)),
            lp=scored if r is None else None,
            decode_lp=mx.stack(decode) if r is None else None,
            decode_kl=0.0 if r is None else float(np.mean(decode_kl)),
            greedy=greedy,
            held=held,
            marginal=marginal,
            seconds=time.perf_counter() - t0,
        )
        t0 = time.perf_counter()
    return out


def _next_context(contexts, pos: int) -> int:
    return next(L for L in contexts if pos < L)


def _check_contexts(contexts, chunk: int, window: int, length: int):
    if not contexts or list(contexts) != sorted(set(contexts)):
        raise MLXKVError(f"contexts must be distinct and ascending, got {list(contexts)}")
    gaps = [b - a for a, b in zip([0, *contexts], contexts)]
    if window < 2 or window > min(gaps) - 1:
        raise MLXKVError(f"window={window} must be 2 .. {min(gaps) - 1} (below the distance between contexts)")
    if chunk < 1:
        raise MLXKVError(f"chunk={chunk} must be at least 1")
    if length < contexts[-1]:
        raise MLXKVError(f"a text of {length} tokens is shorter than the longest context {contexts[-1]}")


def compare_schemes(
    model,
    texts: Sequence,
    candidates: Sequence[Candidate],
    contexts: Sequence[int] = (1024, 2048, 4096),
    chunk: int = 128,
    window: int = 512,
    continuation: int = 128,
    block: int = 64,
    log: Callable | None = None,
    on_candidate: Callable | None = None,
) -> list[dict]:
    """Candidates against ``candidates[0]`` (the reference, usually ``Candidate("bf16")``: a
    plain cache) on each text (token ids, at least ``max(contexts)`` of them), one row per
    candidate, text and context ``L``:

    - ``nll``, ``ppl``, ``rel_ppl`` (perplexity over the reference's), ``kl`` (mean
      KL(reference || candidate), nats) over the ``window`` next-token predictions made at
      positions ``L - 1 - window .. L - 2``; ``rel_ppl_se``, ``kl_se``: their standard errors
      from blocks of ``block`` positions. The text is fed along :func:`schedule`: blocks of
      ``chunk`` tokens (the scheme's own attention applies during the prefill, as with
      mlx-lm's ``prefill_step_size``), token ``L - 1`` as a decode step;
    - ``agreement``: the share of the reference's ``continuation`` greedy tokens after
      position ``L - 1`` that the candidate's arg-max reproduces when fed the reference's
      tokens; ``first_divergence``: the step of its first miss (``continuation`` if none),
      which is how many tokens its own greedy run repeats exactly; ``decode_kl``: mean
      KL(reference || candidate) over those steps;
    - ``held_bytes_per_token``: the caches' ``nbytes`` with ``L`` tokens in, over ``L``;
      ``marginal_bytes_per_token``: what one more stored token costs (:func:`marginal_bytes`).

    The reference's log-probabilities are kept while the others run: ``len(contexts) *
    (window + continuation)`` rows of the vocabulary in float32. Quality numbers are
    deterministic for a given model, text and MLX build. ``on_candidate(rows, candidate)`` is
    called with each candidate's rows of a text once they are measured (a long run can save
    them as it goes)."""
    if not candidates:
        raise MLXKVError("compare_schemes needs at least one candidate: the first is the reference")
    contexts = list(contexts)
    texts = [np.asarray(t, dtype=np.int64).reshape(-1) for t in texts]
    for t in texts:
        _check_contexts(contexts, chunk, window, len(t))
    heads = PositionLogprobs(model)
    rows = []
    for ti, tokens in enumerate(texts):
        ref = None
        for cand in candidates:
            t0 = time.perf_counter()
            run = _run(model, heads, cand.caches(model), tokens, contexts, chunk, window, continuation, ref)
            ref = ref or run
            mine = []
            for L in contexts:
                r, c = ref[L], run[L]
                d_nll = c.nll - r.nll
                match = [a == b for a, b in zip(c.greedy, r.greedy)]
                row = {
                    **cand.describe(),
                    "text": ti,
                    "context": L,
                    "nll": float(c.nll.mean()),
                    "ppl": math.exp(c.nll.mean()),
                    "rel_ppl": math.exp(d_nll.mean()),
                    "rel_ppl_se": math.exp(d_nll.mean()) * _block_se(d_nll, block),
                    "kl": float(c.kl.mean()),
                    "kl_se": _block_se(c.kl, block),
                    "agreement": sum(match) / len(match),
                    "first_divergence": match.index(False) if False in match else len(match),
                    "decode_kl": c.decode_kl,
                    "held_bytes_per_token": c.held / L,
                    "marginal_bytes_per_token": c.marginal,
                    "scored_positions": len(c.nll),
                    "seconds": round(c.seconds, 2),
                }
                mine.append(row)
                if log:
                    log(
                        f"text {ti} L={L:5d} {cand.label:24s} rel_ppl {row['rel_ppl']:.4f} kl {row['kl']:.2e} "
                        f"agree {row['agreement']:.3f} first {row['first_divergence']:3d} "
                        f"B/tok {row['held_bytes_per_token']:8.1f} {row['seconds']:.0f}s"
                    )
            rows += mine
            if on_candidate:
                on_candidate(mine, cand)
            if log:
                log(f"text {ti} {cand.label}: {time.perf_counter() - t0:.0f} s")
    return rows


SUMMARY_FIELDS = ("rel_ppl", "kl", "agreement", "first_divergence", "decode_kl", "held_bytes_per_token")


def summarize(rows: Sequence[dict], fields: Sequence[str] = SUMMARY_FIELDS) -> list[dict]:
    """Rows of :func:`compare_schemes` folded over texts: per label and context, each field's
    mean and its range over the texts (``<field>_min``, ``<field>_max``), and ``texts``."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["label"], r["context"]), []).append(r)
    out = []
    for (_, context), rs in groups.items():
        first = rs[0]
        row = {k: v for k, v in first.items() if k not in fields and not isinstance(v, float) and k != "text"}
        row["context"], row["texts"] = context, len(rs)
        for f in fields:
            values = [r[f] for r in rs]
            row[f] = float(np.mean(values))
            row[f + "_min"], row[f + "_max"] = float(min(values)), float(max(values))
        out.append(row)
    return out


# -- cache bytes without the model ------------------------------------------------------------


def cache_bytes(
    model, candidate: Candidate, contexts: Sequence[int], dtype=mx.bfloat16, chunk: int = 128
) -> dict[int, tuple[int, int]]:
    """Context -> (held, marginal) bytes of ``candidate``'s caches for ``model``, fed along
    :func:`schedule` (as :func:`compare_schemes` reads them) with random keys and values of
    ``dtype``, shaped by the model's attention geometry, straight into every layer's cache.
    What a cache holds depends on its rows' shapes and dtype, not on their values, so this
    gives a bfloat16 model's bytes from a float32 one, without a forward pass."""
    heads, dim = attention_geometry(model)
    if heads is None or dim is None:
        raise MLXKVError("cache_bytes: the model's config gives no kv heads / head_dim")
    caches = [c for c in candidate.caches(model) if hasattr(c, "update_and_fetch")]  # not recurrent state
    ends = {L - 1: L for L in contexts}
    key, out = mx.random.key(0), {}
    for a, b in schedule(list(contexts), chunk):
        for c in caches:
            key, sub = mx.random.split(key)
            kv = mx.random.normal((2, 1, heads, b - a, dim), key=sub).astype(dtype)
            c.update_and_fetch(kv[0], kv[1])
        _eval_caches(caches)
        if a in ends:
            out[ends[a]] = (held_bytes(caches), marginal_bytes(caches))
    return out


# -- pass-key retrieval -------------------------------------------------------------------------

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(tokenizer, length: int, key: int, depth: float) -> list[int]:
    """Token ids of a prompt of about ``length`` tokens (at most) hiding ``key`` at ``depth``
    (0..1) of the filler and asking for it at the end, in the model's chat template (plain
    text without one)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def render(n: int) -> list[int]:
        at = int(n * depth)
        text = "There is a pass key hidden in this text. Find it and remember it. "
        text += PASSKEY_FILLER * at + needle + PASSKEY_FILLER * (n - at) + PASSKEY_QUESTION
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(text)

    n = 1
    if len(render(n)) > length:
        raise MLXKVError(f"passkey_prompt: the shortest prompt is {len(render(n))} tokens, above length={length}")
    while len(render(n + 1)) <= length:
        n += 1
    return render(n)


def greedy_tokens(model, caches, prompt: Sequence[int], n: int, chunk: int = 128) -> list[int]:
    """``n`` greedy tokens after ``prompt``: all but its last token prefilled in chunks of
    ``chunk``, the last one the first decode step (as mlx-lm's generate does)."""
    heads = PositionLogprobs(model)
    prompt = list(prompt)
    for a in range(0, len(prompt) - 1, chunk):
        heads(mx.array([prompt[a : min(a + chunk, len(prompt) - 1)]]), caches, None)
    out, t = [], prompt[-1]
    for _ in range(n):
        t = int(mx.argmax(_step_logprobs(model, caches, t)).item())
        out.append(t)
    return out


def passkey_retrieval(
    model,
    tokenizer,
    candidates: Sequence[Candidate],
    lengths: Sequence[int],
    trials: int = 3,
    chunk: int = 128,
    answer_tokens: int = 10,
    seed: int = 0,
    log: Callable | None = None,
    on_candidate: Callable | None = None,
) -> list[dict]:
    """Per candidate and prompt length: a 5-digit key at ``trials`` depths (``(t + 0.5) /
    trials``), found when its digits appear in the greedy answer (spaces removed). Rows carry
    ``found`` of ``trials`` and ``found_where_reference`` (found among the trials the first
    candidate, the reference, found), with every trial's answer. ``on_candidate(rows,
    candidate)`` is called with each candidate's rows once they are measured."""
    rng = random.Random(seed)
    plan = [[(rng.randrange(10000, 100000), (t + 0.5) / trials) for t in range(trials)] for _ in lengths]
    rows, ref_found = [], {}
    for cand in candidates:
        mine = []
        for length, keys in zip(lengths, plan):
            results = []
            for key, depth in keys:
                ids = passkey_prompt(tokenizer, length, key, depth)
                answer = tokenizer.decode(greedy_tokens(model, cand.caches(model), ids, answer_tokens, chunk))
                found = str(key) in answer.replace(" ", "")
                results.append({"tokens": len(ids), "key": key, "depth": depth, "answer": answer, "found": found})
                if log:
                    log(f"passkey {cand.label:24s} {length}: {answer!r} {'ok' if results[-1]['found'] else 'miss'}")
            found = [r["found"] for r in results]
            ref_found.setdefault(length, found)
            usable = [f for f, rf in zip(found, ref_found[length]) if rf]
            mine.append(
                {
                    **cand.describe(),
                    "length": length,
                    "tokens": max(r["tokens"] for r in results),
                    "found": sum(found),
                    "trials": trials,
                    "found_where_reference": sum(usable),
                    "reference_found": sum(ref_found[length]),
                    "answers": results,
                }
            )
        rows += mine
        if on_candidate:
            on_candidate(mine, cand)
    return rows


# -- Q-Filters' premises on a model's own activations -----------------------------------------


def query_anisotropy(queries: mx.array, filters: mx.array | None = None) -> dict:
    """Per head, what the Q-Filters paper (and the method document's Llama-3.2 table) reports
    of queries ``[H, N, D]``, from their *uncentered* SVD ``Q = U S Vᵀ``:

    - ``energy_share``: ``s1² / Σ sᵢ²``, the leading component's share of the energy;
    - ``mean_ratio``: ``|mean(Q v1)|`` over the mean of ``|mean(Q vⱼ)|``, j ≥ 2 (the drift along
      the leading direction against the other components');
    - ``positive``: ``mean(Q f) > 0`` for the filter ``f`` of each head (``filters`` [H, D];
      not given: ``v1`` signed by ``sgn(1ᵀu1)``, positive by construction);
    - ``mean_projection``: ``mean(Q f)``.

    Numpy arrays of length H."""
    x = np.asarray(queries.astype(mx.float32))
    H, N, D = x.shape
    energy, ratio, pos, proj = (np.zeros(H) for _ in range(4))
    for h in range(H):  # one SVD per head: [N, D] with N in the thousands, D <= 256
        _, s, vt = np.linalg.svd(x[h], full_matrices=False)
        means = x[h] @ vt.T  # [N, D]: projections on every right singular vector
        m = means.mean(axis=0)
        energy[h] = s[0] ** 2 / np.sum(s**2)
        ratio[h] = abs(m[0]) / np.mean(np.abs(m[1:]))
        f = vt[0] * (1.0 if m[0] >= 0 else -1.0) if filters is None else np.asarray(filters[h], np.float64)
        proj[h] = float((x[h] @ f).mean())
        pos[h] = proj[h] > 0
    return {"energy_share": energy, "mean_ratio": ratio, "positive": pos.astype(bool), "mean_projection": proj}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def attention_rank_correlation(queries: mx.array, keys: mx.array, scale: float, scorers: dict, last: int = 256) -> dict:
    """Spearman correlation, per kv head, between a score of each key and the attention it
    receives: the mean softmax weight over the last ``last`` query positions (every query
    head of the group) for keys ``0 .. N - last - 1``, under causal attention.

    ``queries`` [H_q, N, D] and ``keys`` [H_kv, N, D] are one sequence's post-RoPE
    activations of one layer (positions 0 .. N-1); ``scorers`` maps a name to a function of
    (keys [H_kv, n, D], positions [n]) -> scores [H_kv, n]. Returns name -> array [H_kv]."""
    q = queries.astype(mx.float32)
    k = keys.astype(mx.float32)
    Hq, N, _ = q.shape
    Hk = k.shape[0]
    if last >= N:
        raise MLXKVError(f"attention_rank_correlation: last={last} must be below the sequence length {N}")
    qg = q[:, N - last :].reshape(Hk, Hq // Hk, last, -1)
    logits = (qg @ k[:, None].swapaxes(-1, -2)) * scale  # [Hk, G, last, N]
    causal = mx.arange(N)[None, :] <= mx.arange(N - last, N)[:, None]
    weights = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1)
    received = np.asarray(mx.mean(weights, axis=(1, 2))[:, : N - last])  # [Hk, N - last]
    scored_keys, positions = k[:, : N - last], mx.arange(N - last)
    out = {}
    for name, scorer in scorers.items():
        scores = np.asarray(scorer(scored_keys, positions).astype(mx.float32))
        out[name] = np.array([_spearman(scores[h], received[h]) for h in range(Hk)])
    return out


def full_attention_layers(model) -> list[int]:
    """Indices of the layers whose caches a scheme replaces (not sliding-window rings, not
    recurrent state): the layers eviction and quantization act on."""
    from mlx_lm.models import cache as mlx_cache

    template = layer_template(model)
    if template is None:
        return list(range(len(model.layers)))
    return [i for i, t in enumerate(template) if not isinstance(t, (mlx_cache.RotatingKVCache, mlx_cache.ArraysCache))]


# -- named reads (the TurboQuant tests) ---------------------------------------------------------


class NamedReadSite:
    """A cache behind the named reads: the model's append becomes ``append_decode`` /
    ``append_window`` and its attention call (patched by :func:`named_read_attention`)
    attends through that read."""

    def __init__(self, cache):
        self.cache, self.read = cache, None

    def update_and_fetch(self, keys, values):
        name = "append_decode" if keys.shape[2] == 1 else "append_window"
        self.read = getattr(self.cache, name)(keys, values)
        return self.read.keys, self.read.values

    def __getattr__(self, name):
        return getattr(self.cache, name)


@contextlib.contextmanager
def named_read_attention():
    """Route the seeded architectures' attention calls on a :class:`NamedReadSite` to its read."""
    import mlx_lm.models.gemma3_text
    import mlx_lm.models.lfm2
    import mlx_lm.models.llama

    modules = (mlx_lm.models.llama, mlx_lm.models.gemma3_text, mlx_lm.models.lfm2)
    saved = [m.scaled_dot_product_attention for m in modules]
    for m, real in zip(modules, saved):

        def sdpa(q, k, v, cache, scale, mask, sinks=None, real=real):
            if isinstance(cache, NamedReadSite):
                return cache.read.attend(q, scale)
            return real(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

        m.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        for m, real in zip(modules, saved):
            m.scaled_dot_product_attention = real
