"""mlx-bun's request key (``generationCheckpointKey``) computed in Python.

The vectors were produced by Node 20 (V8, ICU) running mlx-bun's canonicalisation: object
keys sorted with ``localeCompare``, arrays kept, ``JSON.stringify``, sha256 hex (the script
is in the docstring of ``VECTORS``). The TypeScript reader recomputes the key of every
fixture checkpoint the same way (fixtures/ts/src/generation-key.ts).
"""

import hashlib

import pytest

from mlxkv.errors import CacheConfigError
from mlxkv.state.generation_key import canonical, canonical_json, generation_key

#: (policy, JSON.stringify(canonical(policy)), sha256 hex), from:
#:   const canonical = v => Array.isArray(v) ? v.map(canonical) : v && typeof v === "object"
#:     ? Object.fromEntries(Object.entries(v).sort(([a], [b]) => a.localeCompare(b))
#:         .map(([k, x]) => [k, canonical(x)])) : v;
#:   createHash("sha256").update(JSON.stringify(canonical(policy))).digest("hex")
VECTORS = [
    (
        {"version": 4, "stopSequences": [], "cacheNs": "", "promptIds": [1, 2, 3], "maxTokens": None,
         "temperature": 0.0, "seedMode": "server-default", "seed": None},
        '{"cacheNs":"","promptIds":[1,2,3],"seedMode":"server-default","stopSequences":[],"temperature":0,"version":4}',
        "1ee17a4c3fc8b34e7b63dc5d3744ed8d2f5940bbeac15e36b1e8b94a88514a4d",
    ),
    (
        {"version": 4, "stopSequences": [], "cacheNs": "lora-a", "promptIds": [101, 7, 2048], "maxTokens": 64,
         "eosTokenIds": [2, 200], "temperature": 0.8, "topP": 0.95, "minP": 0.05, "topK": 40,
         "seedMode": "explicit", "seed": 7, "repetitionPenalty": 1.1, "repetitionContextSize": 8,
         "logitBias": {"5": 1.5, "10": -2.0}, "kvBits": 4, "kvGroupSize": 64, "quantizedKvStart": 16},
        '{"cacheNs":"lora-a","eosTokenIds":[2,200],"kvBits":4,"kvGroupSize":64,"logitBias":{"5":1.5,"10":-2},'
        '"maxTokens":64,"minP":0.05,"promptIds":[101,7,2048],"quantizedKvStart":16,"repetitionContextSize":8,'
        '"repetitionPenalty":1.1,"seed":7,"seedMode":"explicit","stopSequences":[],"temperature":0.8,"topK":40,'
        '"topP":0.95,"version":4}',
        "bff9b1defbe733c177225a90c04e6b2a5d4f7e56a122c9ab2f674c5459ecdb3e",
    ),
    (
        {"version": 4, "stopSequences": [], "cacheNs": "", "promptIds": [5], "temperature": 1.0,
         "xtcProbability": 0.5, "xtcThreshold": 0.1, "xtcSpecialTokens": [3, 1], "seedMode": "explicit",
         "seed": 2**53 - 1, "turboQuant": {"vBits": 2, "kBits": 4}, "quantizedKvStart": 0,
         "presencePenalty": -0.25, "presenceContextSize": 20, "frequencyPenalty": 1e-7,
         "frequencyContextSize": 1000000, "maxKvSize": 24},
        '{"cacheNs":"","frequencyContextSize":1000000,"frequencyPenalty":1e-7,"maxKvSize":24,'
        '"presenceContextSize":20,"presencePenalty":-0.25,"promptIds":[5],"quantizedKvStart":0,'
        '"seed":9007199254740991,"seedMode":"explicit","stopSequences":[],"temperature":1,'
        '"turboQuant":{"kBits":4,"vBits":2},"version":4,"xtcProbability":0.5,"xtcSpecialTokens":[3,1],'
        '"xtcThreshold":0.1}',
        "f1a78f1067ffd23475742b4c1032eba9dfd7481ffaba26f90b5b30e898fc023d",
    ),
    (
        {"version": 4, "stopSequences": [], "cacheNs": 'ünï"\n', "promptIds": [0, 1],
         "temperature": 0.1 + 0.2, "kvScheme": "tova-b32-s4", "seedMode": "server-default"},
        '{"cacheNs":"ünï\\"\\n","kvScheme":"tova-b32-s4","promptIds":[0,1],"seedMode":"server-default",'
        '"stopSequences":[],"temperature":0.30000000000000004,"version":4}',
        "877319e16ee4537efedc59e93d6dae257e30342257ef309c70d0dd2bc260343d",
    ),
]  # fmt: skip


@pytest.mark.parametrize("policy,text,digest", VECTORS)
def test_the_key_is_node_s(policy, text, digest):
    assert canonical_json(policy) == text
    assert hashlib.sha256(text.encode()).hexdigest() == digest
    rest = {k: v for k, v in policy.items() if k not in ("promptIds", "cacheNs")}
    assert generation_key(rest, policy["promptIds"], policy["cacheNs"]) == digest


def test_keys_sort_as_localecompare_and_indices_come_first():
    # Node 20: [...keys].sort((a, b) => a.localeCompare(b)), then JSON.stringify's order
    keys = ["b", "B", "aB", "ab", "Ab", "a", "A", "x10", "x9", "x1", "10", "9", "01", "0", "topP", "topK", "turboQuant"]
    want = ["0", "9", "10", "01", "a", "A", "ab", "aB", "Ab", "b", "B", "topK", "topP", "turboQuant", "x1", "x10", "x9"]
    assert list(canonical(dict.fromkeys(keys, 1))) == want


@pytest.mark.parametrize(
    "x,text",
    [
        (1.0, "1"),
        (0.5, "0.5"),
        (-0.0, "0"),
        (1e-7, "1e-7"),
        (1e-6, "0.000001"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (123.456, "123.456"),
    ],
)
def test_numbers_are_written_as_javascript_does(x, text):
    assert canonical_json({"v": x}) == '{"v":' + text + "}"


@pytest.mark.parametrize("bad", [{"top-p": 1}, {"é": 1}, {"v": float("nan")}, {"v": [float("inf")]}])
def test_what_cannot_be_ordered_or_written_exactly_is_refused(bad):
    with pytest.raises(CacheConfigError):
        canonical_json(bad)
