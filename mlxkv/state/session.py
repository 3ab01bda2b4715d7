"""Generation sessions that checkpoint and resume bit for bit.

A session holds an mlx-lm model, one mlxkv cache per layer and an explicit sampler state.
Its invariant, which is also what a checkpoint stores:

- the caches cover ``tokens`` = prompt + generated tokens: every one of those positions has
  been forwarded;
- ``pending_token`` was sampled from the logits of the last of them but is neither emitted
  nor forwarded yet;
- ``key`` is the PRNG key the next sample splits. Every sample does
  ``key, sub = mx.random.split(key)`` and draws with ``sub``; the global RNG is never used,
  so the key words in the header are the whole random state.

``step()`` emits the pending token, forwards it (one position), samples the next one and
returns the emitted token. A restored session therefore continues without recomputing a
single position, and its logits and tokens equal those of a run that never stopped.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..caches.schemes import make_cache
from ..checks import is_count32, is_int, is_int_list
from ..errors import CacheConfigError, CorruptSnapshotError, SnapshotError
from .snapshot import load, save

CHECKPOINT_KEY = "generationCheckpoint"


@dataclass(frozen=True)
class Sampler:
    """Greedy (``temperature == 0``) or temperature sampling with an optional top-p cut.

    Logits are sampled in float32: ``categorical(logits / temperature)`` restricted to the
    smallest set of most likely tokens whose probability reaches ``top_p``.
    """

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise CacheConfigError(f"sampler temperature must be a finite number >= 0, got {t!r}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise CacheConfigError(f"sampler top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_header(self) -> dict:
        return {"temperature": float(self.temperature), "topP": float(self.top_p)}

    @classmethod
    def from_header(cls, fields) -> "Sampler":
        if not isinstance(fields, dict):
            raise CorruptSnapshotError(f"generationCheckpoint.sampler must be an object, got {fields!r}")
        try:
            return cls(temperature=fields.get("temperature", 0.0), top_p=fields.get("topP", 1.0))
        except CacheConfigError as e:
            raise CorruptSnapshotError(f"generationCheckpoint.sampler: {e}") from None

    def sample(self, logits: mx.array, key: mx.array):
        """``(token, next_key)`` for logits of shape [V]; ``key`` is always split once."""
        key, sub = mx.random.split(key)
        if self.greedy:
            return mx.argmax(logits, axis=-1), key
        scaled = logits.astype(mx.float32) * (1.0 / self.temperature)
        if self.top_p < 1.0:
            scaled = _top_p(scaled, self.top_p)
        return mx.random.categorical(scaled, key=sub), key


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    """Mask (to -inf) every token outside the nucleus: sorted by probability, a token is kept
    while the mass before it is below ``top_p`` (so the most likely one always is)."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    keep = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, -mx.inf)


def _cache_states(caches):
    return [c.state for c in caches]


class Session:
    """A generation over ``model`` with checkpointable caches and sampler state.

    Build one with :meth:`start` or :meth:`restore`; do not call the constructor with
    caches that do not cover ``prompt_tokens + generated_tokens``.
    """

    def __init__(
        self,
        model,
        caches: list,
        prompt_tokens: Sequence[int],
        generated_tokens: Sequence[int],
        pending_token: int,
        key: mx.array,
        seed: int,
        sampler: Sampler,
        logits: mx.array | None = None,
    ):
        self.model = model
        self.caches = caches
        self.prompt_tokens: list[int] = [int(t) for t in prompt_tokens]
        self.generated_tokens: list[int] = [int(t) for t in generated_tokens]
        self.pending_token = int(pending_token)
        self.key = key
        self.seed = int(seed)
        self.sampler = sampler
        #: logits [V] the pending token was sampled from (None right after a restore)
        self.logits = logits

    # -- building ------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        model,
        prompt_tokens: Sequence[int],
        scheme: str = "bf16",
        sampler: Sampler | None = None,
        seed: int = 0,
        caches: list | None = None,
        prefill_step_size: int = 512,
        **make_cache_options,
    ) -> "Session":
        """Prefill ``prompt_tokens`` (in chunks of ``prefill_step_size``) and sample the
        first pending token. ``caches`` (empty, from ``make_cache``) overrides ``scheme``."""
        prompt_tokens = [int(t) for t in prompt_tokens]
        if not prompt_tokens:
            raise CacheConfigError("a session needs at least one prompt token")
        if prefill_step_size <= 0:
            raise CacheConfigError(f"prefill_step_size must be > 0, got {prefill_step_size}")
        sampler = sampler or Sampler()
        if caches is None:
            caches = make_cache(model, scheme, **make_cache_options)
        session = cls(model, caches, prompt_tokens, [], -1, mx.random.key(seed), seed, sampler)
        logits = None
        for i in range(0, len(prompt_tokens), prefill_step_size):
            logits = session._forward(prompt_tokens[i : i + prefill_step_size])
        session._sample(logits)
        return session

    # -- generating ----------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The positions the caches cover: prompt + generated."""
        return self.prompt_tokens + self.generated_tokens

    def _forward(self, tokens: Sequence[int]) -> mx.array:
        out = self.model(mx.array([list(tokens)], dtype=mx.int32), cache=self.caches)
        logits = out[0, -1]
        mx.eval(logits, _cache_states(self.caches))
        return logits

    def _sample(self, logits: mx.array) -> None:
        token, self.key = self.sampler.sample(logits, self.key)
        mx.eval(token, self.key)
        self.pending_token = int(token.item())
        self.logits = logits

    def step(self) -> int:
        """Emit the pending token, forward it, sample the next one; returns the emitted token."""
        token = self.pending_token
        self.generated_tokens.append(token)
        self._sample(self._forward([token]))
        return token

    def generate(self, n: int, on_token: Callable[[int, mx.array], None] | None = None) -> list[int]:
        """Emit ``n`` tokens; ``on_token(token, logits)`` sees each emitted token and the
        logits computed after forwarding it."""
        out = []
        for _ in range(n):
            out.append(self.step())
            if on_token is not None:
                on_token(out[-1], self.logits)
        return out

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint(self) -> dict:
        """The ``generationCheckpoint`` header field for the current state."""
        return {
            "pendingToken": self.pending_token,
            "promptTokens": list(self.prompt_tokens),
            "generatedTokens": list(self.generated_tokens),
            "seed": self.seed,
            "sampler": self.sampler.to_header(),
            "key": [int(w) for w in self.key.tolist()],
        }

    def save(self, path: str, progress=None, fsync: bool = True, **identity) -> dict:
        """Write caches, tokens and the generation checkpoint to ``path``; returns the header.

        The snapshot records the model's identity (``mlxkv.state.identity``: its id and
        fingerprint); ``identity`` (model_id, config_fingerprint, tokenizer_hash, ns)
        overrides or adds fields."""
        return save(
            path,
            self.caches,
            self.tokens,
            model=self.model,
            generation_checkpoint=self.checkpoint(),
            progress=progress,
            fsync=fsync,
            **identity,
        )

    def save_to(self, store, *, ns: str = "") -> None:
        """Put this checkpoint into a prompt store (``PromptStore.put_checkpoint``): a
        longer checkpoint of the same generation replaces shorter ones, and
        ``store.find_checkpoint(prompt, sampler)`` resumes it."""
        store.put_checkpoint(self, ns=ns)

    @classmethod
    def restore(
        cls, path: str, model, progress=None, verify: bool = True, allow_other_model: bool = False, **expect
    ) -> "Session":
        """Resume the session saved at ``path`` on ``model``.

        The snapshot must have been computed by ``model`` (its recorded fingerprint, unless
        ``allow_other_model``) and match its layer count and head geometry; ``expect`` adds
        identity expectations (model_id, tokenizer_hash, ns, ...). The checkpoint is checked
        before any tensor is read, and header and tensors come from one open file."""
        snap = load(
            path,
            model=model,
            verify=verify,
            progress=progress,
            allow_other_model=allow_other_model,
            check=_check_checkpoint,
            **expect,
        )
        cp = snap.header[CHECKPOINT_KEY]
        return cls(
            model,
            snap.caches,
            cp["promptTokens"],
            cp["generatedTokens"],
            cp["pendingToken"],
            mx.array(cp["key"], dtype=mx.uint32),
            cp["seed"],
            Sampler.from_header(cp["sampler"]),
        )


def _check_checkpoint(path: str, header: dict) -> None:
    """Validate ``generationCheckpoint`` before any tensor is read."""
    cp = header.get(CHECKPOINT_KEY)
    if cp is None:
        raise SnapshotError(
            f"{path}: this snapshot has no generationCheckpoint (it stores caches only): "
            "open it with mlxkv.load instead of Session.restore"
        )
    where = f"{path}: generationCheckpoint"
    if not isinstance(cp, dict):
        raise CorruptSnapshotError(f"{where} must be an object")
    for name in ("promptTokens", "generatedTokens"):
        seq = cp.get(name)
        if not is_int_list(seq):
            raise CorruptSnapshotError(f"{where}.{name} must be a list of integers")
    if not cp["promptTokens"]:
        raise CorruptSnapshotError(f"{where}.promptTokens is empty")
    if cp["promptTokens"] + cp["generatedTokens"] != header.get("tokens"):
        raise CorruptSnapshotError(f"{where}: promptTokens + generatedTokens differ from the tokens the caches cover")
    if not is_count32(cp.get("pendingToken")):
        raise CorruptSnapshotError(f"{where}.pendingToken must be a token id, got {str(cp.get('pendingToken'))[:40]}")
    if not is_int(cp.get("seed")):
        raise CorruptSnapshotError(f"{where}.seed must be an integer, got {str(cp.get('seed'))[:40]}")
    key = cp.get("key")
    if not (isinstance(key, list) and len(key) == 2 and all(is_int(w) and 0 <= w < 2**32 for w in key)):
        raise CorruptSnapshotError(f"{where}.key must be two uint32 words, got {str(key)[:80]}")
    Sampler.from_header(cp.get("sampler"))
