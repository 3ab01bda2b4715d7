"""Sampling as mlx-lm samples, with an explicit PRNG key.

:class:`Sampler` takes mlx-lm's settings (``make_sampler``'s and ``make_logits_processors``'s
arguments, same names, same defaults) and samples exactly as ``mlx_lm.generate_step`` does
with them: the logits processors (mlx-lm's own, built by ``make_logits_processors``) see the
recent tokens, ``logprobs = logits - logsumexp(logits)``, then mlx-lm's transforms in
mlx-lm's order (``apply_top_p``, ``apply_min_p``, XTC, ``apply_top_k``), then a categorical
draw of ``logprobs / temp`` (``argmax`` of ``logprobs`` when ``temp == 0``).

mlx-lm draws its random numbers from MLX's global generator: ``mx.random.categorical`` and
XTC's ``mx.random.uniform`` without a key, each taking ``split(state)`` and keeping the first
half as the new state. A sampler here never touches the global generator: it is given a key
and does the same split itself (``key, sub = split(key)``, draw with ``sub``), once for XTC's
coin (when XTC is on) and once for the draw, so a session seeded with ``s`` draws the tokens
mlx-lm draws after ``mx.random.seed(s)``, and the key it hands back is the whole random
state. The greedy case splits once too (the key counts the samples).

XTC is the one transform re-implemented (mlx-lm's ``apply_xtc`` draws from the global
generator inside a compiled function); it is mlx-lm's code with the key made explicit.

:class:`SamplerV1` is the sampler of format-1 checkpoints (temperature on float32 logits,
then mlxkv's own nucleus cut), kept so that those resume bit for bit.

mlx-lm's functions are imported where a sampler runs, not with this module: checking a
checkpoint's sampler (a header read) imports nothing of mlx-lm.
"""

import math
from dataclasses import dataclass, field, fields

import mlx.core as mx

from ..errors import CacheConfigError

#: ``samplerRules`` of a format-1 checkpoint's sampler (a request-policy field only mlxkv writes)
V1_RULES = "mlxkv-1"


def _number(name, v, lo=-math.inf, hi=math.inf):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        bounds = f" in [{lo}, {hi}]" if math.isfinite(lo) or math.isfinite(hi) else ""
        raise CacheConfigError(f"sampler {name} must be a finite number{bounds}, got {v!r}")


def _count(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CacheConfigError(f"sampler {name} must be an integer >= {lo}, got {v!r}")


def _token_ids(name, v) -> tuple:
    if v is None:
        return ()
    try:
        ids = tuple(v)
    except TypeError:
        raise CacheConfigError(f"sampler {name} must be a list of token ids, got {v!r}") from None
    for t in ids:
        _count(f"{name} entry", t, 0)
    return ids


def _xtc(logits, probability, threshold, special, key):
    """mlx-lm's ``apply_xtc`` with an explicit key for its coin."""
    probs = mx.softmax(logits, -1)
    mask = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if special:
        mask[..., list(special)] = False
    return mx.where(mx.random.uniform(0, 1, key=key) > probability, logits, mx.where(mask, -mx.inf, logits))


@dataclass(frozen=True)
class Sampler:
    """mlx-lm's sampling settings: ``make_sampler(temp, top_p, min_p, min_tokens_to_keep,
    top_k, xtc_probability, xtc_threshold, xtc_special_tokens)`` and
    ``make_logits_processors(logit_bias, repetition_penalty, repetition_context_size,
    presence_penalty, presence_context_size, frequency_penalty, frequency_context_size)``.

    ``temp == 0`` is greedy; ``top_p`` applies when in (0, 1), ``min_p`` when not 0, XTC
    when ``xtc_probability > 0``, ``top_k`` when > 0; a penalty applies when it is neither
    None nor 0, over the last ``*_context_size`` tokens. Bad values raise
    :class:`~mlxkv.errors.CacheConfigError`.
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()
    logit_bias: tuple = field(default=())  # ((token, bias), ...); a dict is accepted
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20

    def __post_init__(self):
        _number("temp", self.temp, 0)
        _number("top_p", self.top_p, 0, 1)
        _number("min_p", self.min_p, 0, 1)
        _count("min_tokens_to_keep", self.min_tokens_to_keep, 1)
        _count("top_k", self.top_k, 0)
        _number("xtc_probability", self.xtc_probability, 0, 1)
        _number("xtc_threshold", self.xtc_threshold, 0, 0.5)
        object.__setattr__(self, "xtc_special_tokens", _token_ids("xtc_special_tokens", self.xtc_special_tokens))
        bias = self.logit_bias or ()
        items = tuple(bias.items()) if isinstance(bias, dict) else tuple(tuple(p) for p in bias)
        for pair in items:
            if len(pair) != 2:
                raise CacheConfigError(f"sampler logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            _count("logit_bias token", pair[0], 0)
            _number("logit_bias value", pair[1])
        object.__setattr__(self, "logit_bias", tuple(sorted(items)))
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, 0)  # mlx-lm refuses negative ones
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name))
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            _count(name, getattr(self, name), 1)  # mlx-lm's tokens[-0:] would be every token

    # -- what is in force -------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def _penalties(self):
        """(policy name, penalty, context size) of each penalty in force."""
        out = []
        for name in ("repetition", "presence", "frequency"):
            penalty = getattr(self, f"{name}_penalty")
            if penalty is not None and penalty != 0:
                out.append((name, penalty, getattr(self, f"{name}_context_size")))
        return out

    @property
    def window(self) -> int:
        """How many recent tokens the logits processors read (0: no processor does)."""
        return max((size for _, _, size in self._penalties()), default=0)

    @property
    def xtc(self) -> bool:
        return not self.greedy and self.xtc_probability > 0

    def processors(self) -> list:
        """mlx-lm's logits processors for these settings (``make_logits_processors``)."""
        from mlx_lm.sample_utils import make_logits_processors

        kwargs = {"logit_bias": dict(self.logit_bias) or None}
        for name, penalty, size in self._penalties():
            kwargs[f"{name}_penalty"] = penalty
            kwargs[f"{name}_context_size"] = size
        return make_logits_processors(**kwargs)

    def splits_per_sample(self) -> int:
        return 2 if self.xtc else 1

    # -- sampling ---------------------------------------------------------------------------

    def sample(self, logits: mx.array, key: mx.array):
        """``(token [1], next key)`` from processed logits ``[1, V]``, as mlx-lm's sampler."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.greedy:
            key, _ = mx.random.split(key)
            return mx.argmax(logprobs, axis=-1), key
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.xtc:
            key, sub = mx.random.split(key)
            logprobs = _xtc(logprobs, self.xtc_probability, self.xtc_threshold, self.xtc_special_tokens, sub)
        if self.top_k > 0:
            if self.top_k >= logprobs.shape[-1]:
                vocab = logprobs.shape[-1]
                raise CacheConfigError(f"sampler top_k {self.top_k} must be below the vocabulary size {vocab}")
            logprobs = apply_top_k(logprobs, self.top_k)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub), key

    # -- the request policy (mlx-bun's field names) ------------------------------------------

    def to_policy(self) -> dict:
        """The settings in force, as the fields of mlx-bun's request policy (docs/sessions.md);
        settings that change nothing are left out, so equal behaviour gives equal fields."""
        p = {"temperature": self.temp}
        if not self.greedy:
            if 0 < self.top_p < 1:
                p["topP"] = self.top_p
            if self.min_p != 0:
                p["minP"] = self.min_p
                if self.min_tokens_to_keep != 1:
                    p["minTokensToKeep"] = self.min_tokens_to_keep
            if self.top_k > 0:
                p["topK"] = self.top_k
            if self.xtc:
                p["xtcProbability"] = self.xtc_probability
                p["xtcThreshold"] = self.xtc_threshold
                if self.xtc_special_tokens:
                    p["xtcSpecialTokens"] = list(self.xtc_special_tokens)
        if self.logit_bias:
            p["logitBias"] = {str(t): b for t, b in self.logit_bias}
        for name, penalty, size in self._penalties():
            p[f"{name}Penalty"] = penalty
            p[f"{name}ContextSize"] = size
        return p

    @classmethod
    def from_policy(cls, p: dict) -> "Sampler":
        """The sampler of a request policy's sampling fields (``to_policy``'s inverse)."""
        bias = p.get("logitBias") or {}
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
            raise CacheConfigError(f"logitBias must map token ids (decimal strings) to numbers, got {bias!r}")
        kwargs = {"temp": p.get("temperature", 0.0), "logit_bias": {int(k): v for k, v in bias.items()}}
        for key, name in POLICY_FIELDS.items():
            if key in p and name not in ("temp", "logit_bias"):
                kwargs[name] = p[key]
        return cls(**kwargs)


#: request-policy field -> Sampler field
POLICY_FIELDS = {
    "temperature": "temp",
    "topP": "top_p",
    "minP": "min_p",
    "minTokensToKeep": "min_tokens_to_keep",
    "topK": "top_k",
    "xtcProbability": "xtc_probability",
    "xtcThreshold": "xtc_threshold",
    "xtcSpecialTokens": "xtc_special_tokens",
    "logitBias": "logit_bias",
    **{f"{n}Penalty": f"{n}_penalty" for n in ("repetition", "presence", "frequency")},
    **{f"{n}ContextSize": f"{n}_context_size" for n in ("repetition", "presence", "frequency")},
}
assert set(POLICY_FIELDS.values()) == {f.name for f in fields(Sampler)}


@dataclass(frozen=True)
class SamplerV1:
    """The sampler of format-1 checkpoints: greedy ``argmax(logits)`` at temperature 0, else
    ``categorical(float32 logits / temperature)`` restricted to the nucleus (sorted by
    probability, a token is kept while the mass before it is below ``top_p``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    window = 0
    greedy = property(lambda self: self.temperature == 0)

    def __post_init__(self):
        _number("temperature", self.temperature, 0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise CacheConfigError(f"sampler top_p must be in (0, 1], got {self.top_p!r}")

    def processors(self) -> list:
        return []

    def splits_per_sample(self) -> int:
        return 1

    def sample(self, logits: mx.array, key: mx.array):
        row = logits[0]  # format 1 sampled a [V] row
        key, sub = mx.random.split(key)
        if self.greedy:
            return mx.argmax(row, axis=-1), key
        scaled = row.astype(mx.float32) * (1.0 / self.temperature)
        if self.top_p < 1.0:
            probs = mx.softmax(scaled, axis=-1)
            order = mx.argsort(-probs, axis=-1)
            sorted_probs = mx.take_along_axis(probs, order, axis=-1)
            keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < self.top_p
            keep = mx.put_along_axis(mx.zeros(scaled.shape, mx.bool_), order, keep_sorted, axis=-1)
            scaled = mx.where(keep, scaled, -mx.inf)
        return mx.random.categorical(scaled, key=sub), key

    def to_policy(self) -> dict:
        return {"temperature": self.temperature, "topP": self.top_p, "samplerRules": V1_RULES}


def sampler_from_policy(p: dict):
    """``Sampler`` or, for a policy with ``samplerRules: "mlxkv-1"``, ``SamplerV1``."""
    if p.get("samplerRules") == V1_RULES:
        return SamplerV1(temperature=p.get("temperature", 0.0), top_p=p.get("topP", 1.0))
    return Sampler.from_policy(p)
