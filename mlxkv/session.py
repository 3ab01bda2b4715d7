"""Generation sessions that sample as mlx-lm does, checkpoint, and resume bit for bit.

A session holds an mlx-lm model, one mlxkv cache per layer and its sampling state. Its
invariant, which is also what a checkpoint stores:

- the caches cover ``tokens`` = the request's prompt + the tokens generated for it: every one
  of those positions has been forwarded;
- ``pending_token`` was sampled from the logits of the last of them but is neither emitted
  nor forwarded yet;
- ``prng_key`` is the key the next sample splits (``sampler.py``: the global generator is
  never used, so the key words are the whole random state); ``recent_tokens`` is what the
  logits processors (repetition, presence, frequency penalties) will read.

``step()`` emits the pending token, forwards it (one position), samples the next one and
returns the emitted token; that is ``mlx_lm.generate_step``'s order, which forwards a token
(and samples the next) before handing it out. A restored session therefore continues without
recomputing a position, and its logits and tokens equal those of a run that never stopped.

Stopping and turns follow mlx-lm's chat loop: emitting a stop token (or the ``max_tokens``-th
token) ends the request (``finish_reason``) after that token was forwarded and a next one
sampled, as mlx-lm's generator has done when its caller breaks; ``add_turn(tokens)`` discards
the pending token and runs ``tokens`` as the next request's prompt over the same caches.
"""

from collections.abc import Callable, Sequence

import mlx.core as mx

from .caches.schemes import canonical_scheme, make_cache, parse_scheme
from .checks import is_count, is_int
from .errors import CacheConfigError, GenerationFinishedError, SnapshotError
from .formats.table import load, save
from .state.checkpoint import FIELD, POLICY_VERSION, Checkpoint, own_state, read_checkpoint
from .state.generation_key import generation_key
from .state.sampler import Sampler, SamplerV1, sampler_from_policy

CHECKPOINT_KEY = FIELD
DEFAULT_SEED = 0  # the seed of a session started without one (seedMode "server-default")
PREFILL_STEP = 2048  # mlx-lm's generate_step default
MAX_SEED = 2**53 - 1  # the seed travels in mlx-bun's checkpoint, a JavaScript number


def _stop_tokens(stop_tokens) -> tuple:
    if stop_tokens is None:
        return ()
    ids = tuple(stop_tokens) if not isinstance(stop_tokens, int) else (stop_tokens,)
    if not all(is_count(t) for t in ids):
        raise CacheConfigError(f"stop_tokens must be token ids (integers >= 0), got {stop_tokens!r}")
    return tuple(sorted(set(ids)))


def _check_request(sampler, seed, max_tokens, ns):
    if not isinstance(sampler, (Sampler, SamplerV1)):
        raise CacheConfigError(f"sampler must be an mlxkv Sampler, got {type(sampler).__name__}")
    if seed is not None and not (is_int(seed) and 0 <= seed <= MAX_SEED):
        raise CacheConfigError(f"seed must be an integer in [0, 2^53) (a JavaScript number holds it), got {seed!r}")
    if max_tokens is not None and not is_count(max_tokens):
        raise CacheConfigError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    if not isinstance(ns, str):
        raise CacheConfigError(f"ns must be a string (an adapter namespace, '' for the base model), got {ns!r}")


def request_policy(
    sampler: Sampler | None = None,
    *,
    seed: int | None = None,
    stop_tokens=None,
    max_tokens: int | None = None,
    scheme: str | None = "bf16",
    max_kv_size: int | None = None,
    **make_cache_options,
) -> dict:
    """mlx-bun's request policy of a generation, without ``promptIds`` and ``cacheNs``
    (docs/sessions.md lists the fields). Settings that change nothing are left out."""
    sampler = Sampler() if sampler is None else sampler
    _check_request(sampler, seed, max_tokens, "")
    policy = {"version": POLICY_VERSION, "stopSequences": []}
    if max_tokens is not None:
        policy["maxTokens"] = max_tokens
    stop = _stop_tokens(stop_tokens)
    if stop:
        policy["eosTokenIds"] = list(stop)
    policy.update(sampler.to_policy())
    policy["seedMode"] = "server-default" if seed is None else "explicit"
    if seed is not None:
        policy["seed"] = seed
    if scheme is not None:
        parsed = parse_scheme(scheme, make_cache_options)
        if parsed.policy is not None:  # mlx-bun's fields, where mlx-bun builds the same caches
            policy.update(parsed.policy)
        if parsed.policy is None or parsed.held:  # mlxkv's own: every option that changes what is held
            policy["kvScheme"] = canonical_scheme(scheme, **make_cache_options)
    if max_kv_size is not None:
        policy["maxKvSize"] = max_kv_size
    return policy


def request_key(prompt_tokens: Sequence[int], sampler: Sampler | None = None, *, ns: str = "", **request) -> str:
    """The key ``Session.start(model, prompt_tokens, sampler=sampler, ns=ns, **request)``
    gives its generation (mlx-bun's ``generationCheckpointKey``): what
    ``PromptStore.find_checkpoint`` looks for. ``request``: seed, stop_tokens, max_tokens,
    scheme, max_kv_size and make_cache options, as given to ``Session.start``."""
    return generation_key(request_policy(sampler, **request), [int(t) for t in prompt_tokens], ns)


def _cache_states(caches):
    return [c.state for c in caches]


class Session:
    """A generation over ``model`` with checkpointable caches and sampling state.

    Build one with :meth:`start` or :meth:`restore` (or ``PromptStore.find_checkpoint``).
    """

    def __init__(
        self,
        model,
        caches: list,
        *,
        prompt_tokens,
        generated_tokens,
        pending_token: int,
        prng_key,
        seed: int,
        seed_was_explicit: bool,
        sampler,
        policy: dict,
        ns: str,
        request_key: str,
        recent_tokens=(),
        finish_reason: str | None = None,
        stop_tokens=(),
        max_tokens=None,
        prefill_step_size: int = PREFILL_STEP,
        logits: mx.array | None = None,
    ):
        self.model = model
        self.caches = caches
        self.prompt_tokens: list[int] = [int(t) for t in prompt_tokens]
        self.generated_tokens: list[int] = [int(t) for t in generated_tokens]
        self.pending_token = int(pending_token)
        self.prng_key = prng_key
        self.seed = int(seed)
        self.seed_was_explicit = bool(seed_was_explicit)
        self.sampler = sampler
        self.policy = policy
        self.ns = ns
        self.request_key = request_key
        self.recent_tokens: list[int] = [int(t) for t in recent_tokens]
        self.finish_reason = finish_reason
        self.stop_tokens = tuple(stop_tokens)
        self.max_tokens = max_tokens
        self.prefill_step_size = prefill_step_size
        #: logits [V] of the last forwarded position, the pending token's (None right after a restore)
        self.logits = logits
        self._processors = sampler.processors()

    # -- building ------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        model,
        prompt_tokens: Sequence[int],
        scheme: str = "bf16",
        sampler: Sampler | None = None,
        seed: int | None = None,
        caches: list | None = None,
        prefill_step_size: int = PREFILL_STEP,
        *,
        stop_tokens=None,
        max_tokens: int | None = None,
        ns: str = "",
        **make_cache_options,
    ) -> "Session":
        """Prefill ``prompt_tokens`` and sample the first pending token, as
        ``mlx_lm.generate_step`` does: all but the last token in chunks of
        ``prefill_step_size``, then the last one. ``caches`` (empty, from ``make_cache``)
        overrides ``scheme`` (pass the scheme they were built with: the request key names
        it). ``seed`` None: seed 0, recorded as not explicit (mlx-bun's server default).
        ``stop_tokens``: token ids that end the request when emitted (mlx-lm's eos ids);
        ``max_tokens``: tokens the request may emit; ``ns``: the adapter namespace."""
        prompt_tokens = [int(t) for t in prompt_tokens]
        if not prompt_tokens:
            raise CacheConfigError("a session needs at least one prompt token")
        if not is_int(prefill_step_size) or prefill_step_size <= 0:
            raise CacheConfigError(f"prefill_step_size must be > 0, got {prefill_step_size}")
        sampler = Sampler() if sampler is None else sampler
        _check_request(sampler, seed, max_tokens, ns)
        policy = request_policy(
            sampler, seed=seed, stop_tokens=stop_tokens, max_tokens=max_tokens, scheme=scheme, **make_cache_options
        )
        if caches is None:
            caches = make_cache(model, scheme, **make_cache_options)
        real_seed = DEFAULT_SEED if seed is None else seed
        session = cls(
            model,
            caches,
            prompt_tokens=prompt_tokens,
            generated_tokens=[],
            pending_token=-1,
            prng_key=mx.random.key(real_seed),
            seed=real_seed,
            seed_was_explicit=seed is not None,
            sampler=sampler,
            policy=policy,
            ns=ns,
            request_key=generation_key(policy, prompt_tokens, ns),
            stop_tokens=_stop_tokens(stop_tokens),
            max_tokens=max_tokens,
            prefill_step_size=prefill_step_size,
        )
        session._prefill(prompt_tokens)
        return session

    # -- generating ----------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The positions the caches cover: prompt + generated."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def finished(self) -> bool:
        """The request ended: a stop token or its ``max_tokens``-th token was emitted."""
        return self.finish_reason is not None

    def _remember(self, tokens: Sequence[int]) -> None:
        window = self.sampler.window
        if window:
            self.recent_tokens = (self.recent_tokens + list(tokens))[-window:]

    def _sample(self, out: mx.array) -> None:
        """Sample the pending token from the model output ``[1, L, V]`` of the last forward."""
        row = out[0, -1]
        logits = out[:, -1, :]  # its own array: processors write into it, never into ``row``
        if self._processors:
            recent = mx.array(self.recent_tokens, dtype=mx.int32)
            for processor in self._processors:
                logits = processor(recent, logits)
        token, self.prng_key = self.sampler.sample(logits, self.prng_key)
        mx.eval(row, token, self.prng_key, _cache_states(self.caches))
        self.pending_token = int(token.item())
        self.logits = row

    def _prefill(self, tokens: list[int]) -> None:
        """mlx-lm's prefill: every token but the last in chunks, then the last, sampled."""
        i, step = 0, self.prefill_step_size
        while len(tokens) - i > 1:
            n = min(step, len(tokens) - i - 1)
            self.model(mx.array([tokens[i : i + n]], dtype=mx.int32), cache=self.caches)
            mx.eval(_cache_states(self.caches))
            i += n
        self._remember(tokens)
        self._sample(self.model(mx.array([tokens[i:]], dtype=mx.int32), cache=self.caches))
        if self.max_tokens == 0:
            self.finish_reason = "length"

    def step(self) -> int:
        """Emit the pending token, forward it, sample the next one; returns the emitted token.
        Raises :class:`GenerationFinishedError` once the request has finished."""
        if self.finish_reason is not None:
            raise GenerationFinishedError(
                f"the generation finished ({self.finish_reason}): add the next turn with add_turn(tokens)"
            )
        token = self.pending_token
        self.generated_tokens.append(token)
        self._remember([token])
        self._sample(self.model(mx.array([[token]], dtype=mx.int32), cache=self.caches))
        if token in self.stop_tokens:
            self.finish_reason = "stop"
        elif self.max_tokens is not None and len(self.generated_tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return token

    def generate(self, n: int, on_token: Callable[[int, mx.array], None] | None = None) -> list[int]:
        """Emit up to ``n`` tokens (fewer when the request finishes); ``on_token(token,
        logits)`` sees each emitted token and the logits computed after forwarding it."""
        out = []
        while len(out) < n and self.finish_reason is None:
            out.append(self.step())
            if on_token is not None:
                on_token(out[-1], self.logits)
        return out

    def add_turn(self, tokens: Sequence[int]) -> None:
        """Start the next request of a conversation over the same caches: the pending token
        is discarded (never emitted, never forwarded), ``tokens`` (e.g. the chat template's
        rendering of the next user message) are prefilled as mlx-lm does, and a new pending
        token is sampled. The new request's prompt is every token so far plus ``tokens``; its
        key, ``generated_tokens`` and the processors' recent tokens start over (mlx-lm's
        ``generate_step`` reads only its own prompt and output); the PRNG key continues."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise CacheConfigError("add_turn needs at least one token")
        self.prompt_tokens = self.tokens + tokens
        self.generated_tokens = []
        self.recent_tokens = []
        self.finish_reason = None
        self.request_key = generation_key(self.policy, self.prompt_tokens, self.ns)
        self._prefill(tokens)

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """The generation checkpoint of the current state (``.to_header()``: the header field)."""
        return Checkpoint(
            self.request_key,
            self.ns,
            len(self.prompt_tokens),
            len(self.generated_tokens),
            self.pending_token,
            self.seed,
            self.seed_was_explicit,
            own_state(self.policy, self.prng_key.tolist(), self.recent_tokens, self.finish_reason),
        )

    def save(self, path: str, progress=None, fsync: bool = True, format: str = "mlxkv", **identity) -> dict:
        """Write caches, tokens and the generation checkpoint to ``path``; returns the header.

        The snapshot records the model's identity (``mlxkv.state.identity``: its id and
        fingerprint) and the session's ``ns``; ``identity`` (model_id, config_fingerprint,
        tokenizer_hash, ns) overrides or adds fields. ``format="mlx-bun"`` writes mlx-bun's
        cache file, the same checkpoint in it."""
        ident = {"ns": self.ns, **identity}
        return save(
            path,
            self.caches,
            self.tokens,
            model=self.model,
            generation_checkpoint=self.checkpoint().to_header(),
            progress=progress,
            fsync=fsync,
            format=format,
            **ident,
        )

    def save_to(self, store) -> None:
        """Put this checkpoint into a prompt store (``PromptStore.put_checkpoint``): a longer
        checkpoint of the same request replaces shorter ones, and
        ``store.find_checkpoint(prompt, session.request_key, ns=...)`` resumes it."""
        store.put_checkpoint(self)

    @classmethod
    def restore(
        cls,
        path: str,
        model,
        progress=None,
        verify: bool = True,
        *,
        allow_other_model: bool = False,
        sampler: Sampler | None = None,
        stop_tokens=None,
        max_tokens: int | None = None,
        prefill_step_size: int = PREFILL_STEP,
        **expect,
    ) -> "Session":
        """Resume the session saved at ``path`` (mlxkv format 1 or 2, or an mlx-bun file) on
        ``model``.

        The snapshot must have been computed by ``model`` (its recorded fingerprint, unless
        ``allow_other_model``) and match its layer count and head geometry; ``expect`` adds
        identity expectations (model_id, tokenizer_hash, ns, ...). The checkpoint is checked
        before any tensor is read, and header and tensors come from one open file.
        ``sampler``, ``stop_tokens``, ``max_tokens``: needed for a checkpoint that records no
        sampling state (mlx-bun's); for mlxkv's own they may only repeat what it records."""
        resumed = {}

        def check(where: str, header: dict) -> None:
            cp = read_checkpoint(header, where)
            if cp is None:
                raise SnapshotError(
                    f"{where}: this snapshot has no generationCheckpoint (it stores caches only): "
                    "open it with mlxkv.load instead of Session.restore"
                )
            resumed["cp"] = cp
            resumed["plan"] = _resume_plan(cp, header["tokens"], sampler, stop_tokens, max_tokens, where)

        snap = load(
            path,
            model=model,
            verify=verify,
            progress=progress,
            allow_other_model=allow_other_model,
            check=check,
            **expect,
        )
        return cls._resumed(model, snap.caches, snap.tokens, resumed["cp"], resumed["plan"], prefill_step_size)

    @classmethod
    def resume(
        cls,
        model,
        caches: list,
        header: dict,
        *,
        sampler=None,
        stop_tokens=None,
        max_tokens=None,
        prefill_step_size: int = PREFILL_STEP,
        where: str = "",
    ) -> "Session":
        """A session over ``caches`` restored from a snapshot whose checked ``header`` holds a
        generation checkpoint (``PromptStore.find_checkpoint`` builds its sessions so)."""
        cp = read_checkpoint(header, where)
        if cp is None:
            raise SnapshotError(f"{where or 'snapshot'}: no generationCheckpoint to resume")
        plan = _resume_plan(cp, header["tokens"], sampler, stop_tokens, max_tokens, where)
        return cls._resumed(model, caches, header["tokens"], cp, plan, prefill_step_size)

    @classmethod
    def _resumed(cls, model, caches, tokens, cp: Checkpoint, plan: dict, prefill_step_size) -> "Session":
        return cls(
            model,
            caches,
            prompt_tokens=cp.prompt(tokens),
            generated_tokens=tokens[cp.original_prompt_tokens :],
            pending_token=cp.pending_token,
            seed=cp.seed,
            seed_was_explicit=cp.seed_was_explicit,
            ns=cp.cache_ns,
            request_key=cp.key,
            prefill_step_size=prefill_step_size,
            **plan,
        )


def _resume_plan(cp: Checkpoint, tokens: list, sampler, stop_tokens, max_tokens, where: str) -> dict:
    """The sampling state a checkpoint resumes with: its own (mlxkv's), or, for mlx-bun's,
    the caller's sampler with the PRNG key mlxkv would hold after the same samples."""
    if cp.state is not None:
        policy = cp.state["policy"]
        recorded = {
            "sampler": sampler_from_policy(policy),
            "stop_tokens": tuple(policy.get("eosTokenIds", ())),
            "max_tokens": policy.get("maxTokens"),
        }
        given = {"sampler": sampler, "stop_tokens": stop_tokens, "max_tokens": max_tokens}
        for name, value in given.items():
            if value is None:
                continue
            same = (
                value.to_policy() == recorded[name].to_policy()
                if name == "sampler"
                else (_stop_tokens(value) if name == "stop_tokens" else value) == recorded[name]
            )
            if not same:
                raise CacheConfigError(
                    f"{where}: the checkpoint records {name} {recorded[name]!r}; a resumed generation keeps "
                    "its own (omit it, or start a new turn with add_turn)"
                )
        return {
            **recorded,
            "policy": policy,
            "prng_key": mx.array(cp.state["prngKey"], dtype=mx.uint32),
            "recent_tokens": cp.state["recentTokens"],
            "finish_reason": cp.state["finishReason"],
        }
    if sampler is None:
        raise SnapshotError(
            f"{where}: this checkpoint (mlx-bun's) records no sampler state: pass sampler=Sampler(...) "
            "(Sampler() for greedy), and stop_tokens=/max_tokens= if the request had them"
        )
    _check_request(sampler, cp.seed, max_tokens, cp.cache_ns)
    stop = _stop_tokens(stop_tokens)
    key = mx.random.key(cp.seed)
    for i in range((cp.generated_tokens + 1) * sampler.splits_per_sample()):
        key = mx.random.split(key)[0]
        if i % 1024 == 1023:
            mx.eval(key)  # keep the graph short for long generations
    generated = tokens[cp.original_prompt_tokens :]
    finish = None
    if generated and generated[-1] in stop:
        finish = "stop"
    elif max_tokens is not None and len(generated) >= max_tokens:
        finish = "length"
    policy = request_policy(
        sampler, seed=cp.seed if cp.seed_was_explicit else None, stop_tokens=stop, max_tokens=max_tokens, scheme=None
    )
    window = sampler.window
    return {
        "sampler": sampler,
        "stop_tokens": stop,
        "max_tokens": max_tokens,
        "policy": policy,
        "prng_key": key,
        "recent_tokens": tokens[-window:] if window else [],
        "finish_reason": finish,
    }
