"""The ``generationCheckpoint`` header field: mlx-bun's fields, mlxkv's own state beside them.

Format 2 (docs/format.md section 3.1) writes mlx-bun's checkpoint as mlx-bun does, with
mlx-bun's types and meanings, and mlxkv's own state under ``mlxkv``, a name mlx-bun does not
use::

    {"key": <request key>, "cacheNs": "", "originalPromptTokens": 8, "generatedTokens": 30,
     "pendingToken": 183, "seed": 11, "seedWasExplicit": true,
     "mlxkv": {"policy": {...}, "prngKey": [w0, w1], "recentTokens": [...], "finishReason": null}}

A checkpoint without ``mlxkv`` (one mlx-bun wrote) is valid; it resumes with a sampler the
caller gives. Format 1's checkpoint (token lists, ``sampler``, ``key``) is read into the same
shape (:func:`read_checkpoint`), so every caller sees one kind of checkpoint.
"""

import json
from dataclasses import dataclass

from ..checks import INT32_MAX, is_count32, is_int, is_int_list
from ..errors import CacheConfigError, CorruptSnapshotError, SnapshotError
from .generation_key import generation_key
from .sampler import POLICY_FIELDS, V1_RULES, sampler_from_policy

FIELD = "generationCheckpoint"
OWN = "mlxkv"  # mlxkv's own state inside the checkpoint
FINISH_REASONS = (None, "stop", "length")
POLICY_VERSION = 4  # the ``version`` of mlx-bun's request policy this mirrors
#: request-policy fields mlxkv fills and honours (sampling fields: sampler.POLICY_FIELDS)
OTHER_POLICY_FIELDS = (
    "version",
    "stopSequences",
    "maxTokens",
    "eosTokenIds",
    "seedMode",
    "seed",
    "samplerRules",
    "kvBits",
    "kvGroupSize",
    "quantizedKvStart",
    "turboQuant",
    "kvScheme",
    "maxKvSize",
)
POLICY_KEYS = frozenset(POLICY_FIELDS) | frozenset(OTHER_POLICY_FIELDS)
U32 = 2**32


@dataclass
class Checkpoint:
    """One paused generation. ``tokens[:original_prompt_tokens]`` is the request's prompt;
    ``generated_tokens`` is a count; ``state`` is mlxkv's own (None: an mlx-bun checkpoint)."""

    key: str
    cache_ns: str
    original_prompt_tokens: int
    generated_tokens: int
    pending_token: int
    seed: int
    seed_was_explicit: bool
    state: dict | None = None

    def to_header(self) -> dict:
        """The header field, in mlx-bun's key order, mlxkv's state last."""
        out = {
            "key": self.key,
            "cacheNs": self.cache_ns,
            "originalPromptTokens": self.original_prompt_tokens,
            "generatedTokens": self.generated_tokens,
            "pendingToken": self.pending_token,
            "seed": self.seed,
            "seedWasExplicit": self.seed_was_explicit,
        }
        if self.state is not None:
            out[OWN] = self.state
        return out

    def prompt(self, tokens) -> list[int]:
        return list(tokens[: self.original_prompt_tokens])


def own_state(policy: dict, prng_key, recent_tokens, finish_reason) -> dict:
    return {
        "policy": policy,
        "prngKey": [int(w) for w in prng_key],
        "recentTokens": [int(t) for t in recent_tokens],
        "finishReason": finish_reason,
    }


def is_v1_layout(cp) -> bool:
    return isinstance(cp, dict) and "promptTokens" in cp and "originalPromptTokens" not in cp


def read_checkpoint(header: dict, where: str = "", *, state: bool = True) -> Checkpoint | None:
    """The checked checkpoint of a header (mlxkv format 1 or 2, or a translated mlx-bun
    header), None when it has none. Raises :class:`CorruptSnapshotError` for a malformed one.
    ``state=False`` checks mlx-bun's fields only (what a reader of an mlx-bun file checks:
    mlxkv's own state, if any, is a resume's to check, and only has to be an object)."""
    cp = header.get(FIELD)
    if cp is None:
        return None
    where = f"{where}: {FIELD}" if where else FIELD
    if not isinstance(cp, dict):
        raise CorruptSnapshotError(f"{where} must be an object")
    tokens = header.get("tokens") or []
    v1 = header.get("formatVersion") == 1 if "mlxBun" not in header else is_v1_layout(cp)
    return _read_v1(cp, tokens, header.get("ns", ""), where) if v1 else _read_v2(cp, tokens, where, state)


def _read_v2(cp: dict, tokens: list, where: str, check_state: bool = True) -> Checkpoint:
    for name, ok, what in (
        ("key", lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        ("cacheNs", lambda v: isinstance(v, str), "a string"),
        ("originalPromptTokens", lambda v: is_int(v) and 1 <= v <= len(tokens), f"an integer in [1, {len(tokens)}]"),
        ("generatedTokens", is_int, "an integer"),
        ("pendingToken", is_count32, f"a token id (an integer in 0..{INT32_MAX})"),
        ("seed", lambda v: is_int(v) and 0 <= v < 2**53, "an integer in [0, 2^53)"),
        ("seedWasExplicit", lambda v: isinstance(v, bool), "a boolean"),
    ):
        if not ok(cp.get(name)):
            raise CorruptSnapshotError(f"{where}.{name} must be {what}, got {cp.get(name)!r}")
    if cp["generatedTokens"] != len(tokens) - cp["originalPromptTokens"]:
        raise CorruptSnapshotError(
            f"{where}: originalPromptTokens {cp['originalPromptTokens']} + generatedTokens {cp['generatedTokens']} "
            f"differ from the {len(tokens)} tokens the caches cover"
        )
    state = cp.get(OWN)
    if state is not None:
        if check_state:
            _check_state(state, f"{where}.{OWN}")
        elif not isinstance(state, dict):
            raise CorruptSnapshotError(f"{where}.{OWN} must be an object")
    return Checkpoint(
        cp["key"],
        cp["cacheNs"],
        cp["originalPromptTokens"],
        cp["generatedTokens"],
        cp["pendingToken"],
        cp["seed"],
        cp["seedWasExplicit"],
        state,
    )


def _check_prng_key(key, where):
    if not (isinstance(key, list) and len(key) == 2 and all(is_int(w) and 0 <= w < U32 for w in key)):
        raise CorruptSnapshotError(f"{where} must be two uint32 words, got {key!r}")


def _check_state(state, where: str) -> None:
    if not isinstance(state, dict):
        raise CorruptSnapshotError(f"{where} must be an object")
    _check_prng_key(state.get("prngKey"), f"{where}.prngKey")
    if not is_int_list(state.get("recentTokens")):
        raise CorruptSnapshotError(f"{where}.recentTokens must be a list of integers")
    if state.get("finishReason") not in FINISH_REASONS:
        raise CorruptSnapshotError(f'{where}.finishReason must be null, "stop" or "length"')
    check_policy(state.get("policy"), f"{where}.policy")


def check_policy(policy, where: str) -> None:
    """A request policy mlxkv can honour: known fields of the right types. A field mlxkv does
    not implement (mlx-bun's ``hlg``, ``curve``, ``kvConfig``, an execution binding, stop
    sequences) is refused: the generation could not continue as it began."""
    if not isinstance(policy, dict):
        raise CorruptSnapshotError(f"{where} must be an object")
    unknown = sorted(set(policy) - POLICY_KEYS)
    if unknown:
        raise SnapshotError(f"{where} has fields mlxkv does not implement: {unknown}; it cannot continue it")
    if policy.get("version") != POLICY_VERSION:
        raise CorruptSnapshotError(f"{where}.version must be {POLICY_VERSION}, got {policy.get('version')!r}")
    if policy.get("stopSequences") != []:
        raise SnapshotError(f"{where}.stopSequences {policy.get('stopSequences')!r}: mlxkv stops on tokens only")
    if "maxTokens" in policy and not (is_int(policy["maxTokens"]) and policy["maxTokens"] >= 0):
        raise CorruptSnapshotError(f"{where}.maxTokens must be an integer >= 0")
    if "eosTokenIds" in policy and not is_int_list(policy["eosTokenIds"]):
        raise CorruptSnapshotError(f"{where}.eosTokenIds must be a list of integers")
    if policy.get("seedMode") not in ("explicit", "server-default"):
        raise CorruptSnapshotError(f'{where}.seedMode must be "explicit" or "server-default"')
    if (policy["seedMode"] == "explicit") != is_int(policy.get("seed")):
        raise CorruptSnapshotError(f'{where}.seed must be present exactly when seedMode is "explicit"')
    if "samplerRules" in policy and policy["samplerRules"] != V1_RULES:
        raise SnapshotError(f"{where}.samplerRules {policy['samplerRules']!r} is not one mlxkv knows")
    try:
        sampler_from_policy(policy)
    except (CacheConfigError, TypeError) as e:
        raise CorruptSnapshotError(f"{where}: {e}") from None


def _read_v1(cp: dict, tokens: list, ns: str, where: str) -> Checkpoint:
    """Format 1's checkpoint, as format 2 holds it: the prompt and generated lists become the
    count, ``sampler`` and ``seed`` a request policy (``samplerRules: "mlxkv-1"``, an explicit
    seed), ``key`` the PRNG key; the request key is computed from that policy."""
    for name in ("promptTokens", "generatedTokens"):
        if not is_int_list(cp.get(name)):
            raise CorruptSnapshotError(f"{where}.{name} must be a list of integers")
    if not cp["promptTokens"]:
        raise CorruptSnapshotError(f"{where}.promptTokens is empty")
    if cp["promptTokens"] + cp["generatedTokens"] != tokens:
        raise CorruptSnapshotError(f"{where}: promptTokens + generatedTokens differ from the tokens the caches cover")
    for name in ("pendingToken", "seed"):
        if not is_int(cp.get(name)):
            raise CorruptSnapshotError(f"{where}.{name} must be an integer, got {cp.get(name)!r}")
    _check_prng_key(cp.get("key"), f"{where}.key")
    sampler = cp.get("sampler")
    if not isinstance(sampler, dict):
        raise CorruptSnapshotError(f"{where}.sampler must be an object, got {sampler!r}")
    policy = {
        "version": POLICY_VERSION,
        "stopSequences": [],
        "temperature": sampler.get("temperature", 0.0),
        "topP": sampler.get("topP", 1.0),
        "samplerRules": V1_RULES,
        "seedMode": "explicit",
        "seed": cp["seed"],
    }
    try:
        sampler_from_policy(policy)
    except CacheConfigError as e:
        raise CorruptSnapshotError(f"{where}.sampler: {e}") from None
    prompt = cp["promptTokens"]
    return Checkpoint(
        generation_key(policy, prompt, ns),
        ns,
        len(prompt),
        len(cp["generatedTokens"]),
        cp["pendingToken"],
        cp["seed"],
        True,
        own_state(policy, cp["key"], [], None),
    )


def normalized(checkpoint, tokens, ns: str = "") -> dict | None:
    """A checkpoint about to be written, in format 2's layout (a format-1 one translated,
    anything else checked); None stays None. Raises :class:`CorruptSnapshotError`."""
    if checkpoint is None:
        return None
    if isinstance(checkpoint, Checkpoint):
        checkpoint = checkpoint.to_header()
    header = {"tokens": list(tokens), "ns": ns, FIELD: checkpoint}
    header["formatVersion"] = 1 if is_v1_layout(checkpoint) else 2
    return read_checkpoint(header).to_header()


def describe(header: dict) -> list[tuple[str, str]]:
    """``mlxkv inspect``'s rows for a header's checkpoint (none when it has none)."""
    try:
        cp = read_checkpoint(header)
    except SnapshotError as e:
        return [(FIELD, f"unreadable: {e}")]
    if cp is None:
        return []
    tokens = header["tokens"]
    seed = f"{cp.seed} ({'explicit' if cp.seed_was_explicit else 'server default'})"
    counts = f"prompt {cp.original_prompt_tokens} + generated {cp.generated_tokens} tokens"
    rows = [
        (FIELD, f"{counts}, pending {cp.pending_token}, seed {seed}"),
        ("  key", cp.key),
        ("  cacheNs", repr(cp.cache_ns)),
    ]
    if cp.state is None:
        rows.append(("  mlxkv", "absent (mlx-bun's checkpoint): resume with an explicit sampler"))
        return rows
    s = cp.state
    derived = generation_key(s["policy"], cp.prompt(tokens), cp.cache_ns) == cp.key
    origin = "= the recorded policy's" if derived else "not the recorded policy's: written elsewhere"
    rows[1] = ("  key", f"{cp.key} ({origin})")
    rows += [
        ("  policy", json.dumps(s["policy"], separators=(",", ":"))),
        ("  prngKey", str(s["prngKey"])),
        ("  recentTokens", f"{len(s['recentTokens'])} {s['recentTokens'][-8:]}"),
        ("  finishReason", str(s["finishReason"])),
    ]
    return rows
