#!/usr/bin/env python
"""How the format-1 files in this directory were made. They are NEVER regenerated.

They were written once by mlxkv at commit a58d703 (snapshot formatVersion 1, the v1
``generationCheckpoint``: promptTokens/generatedTokens lists, ``sampler`` {temperature, topP},
PRNG ``key``) so that tests/test_checkpoint_v1.py can show that files of format 1 keep
loading and resuming bit for bit with every later mlxkv. ``expected.json`` records, per
file, its sha256 and the continuation the writing mlxkv produced after the save: the tokens
and the sha256 of the float32 logits (little-endian, stacked ``[steps, V]``).

``kv-llama.safetensors`` is a copy of ``fixtures/valid/kv-llama.safetensors`` as
``fixtures/generate.py`` wrote it at that commit (greedy, seed 0; its continuation is the
fixture manifest's ``nextTokens``).

Running this script with a later mlxkv writes the current format instead, so it is kept only
as the record of what was done.
"""

import hashlib
import json
import os
import shutil
import sys

import mlx.core as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)

from mlxkv.models.seeded import build_model, prompt  # noqa: E402
from mlxkv.session import Sampler, Session  # noqa: E402

STEPS = 8
CASES = [
    # file, arch, scheme, sampler, seed, tokens generated before the save
    ("session-temp-llama.safetensors", "llama", "bf16", {"temperature": 0.9, "top_p": 0.9}, 11, 10),
    ("session-greedy-gemma3-kv4.safetensors", "gemma3", "kv4", {}, 3, 36),
    ("session-temp-hybrid.safetensors", "hybrid", "bf16", {"temperature": 1.3}, 5, 6),
]


def digest(logits) -> str:
    return hashlib.sha256(np.stack(logits).astype("<f4").tobytes()).hexdigest()


def main():
    expected = {}
    for name, arch, scheme, sampler, seed, before in CASES:
        model = build_model(arch)
        s = Session.start(model, prompt(8, seed=5), scheme, sampler=Sampler(**sampler), seed=seed)
        s.generate(before)
        path = os.path.join(HERE, name)
        s.save(path)
        logits = []
        tokens = s.generate(STEPS, lambda t, row: logits.append(np.array(row.astype(mx.float32))))  # noqa: B023
        expected[name] = {"arch": arch, "tokens": tokens, "logitsSha256": digest(logits)}
    shutil.copy(os.path.join(ROOT, "fixtures", "valid", "kv-llama.safetensors"), HERE)
    manifest = json.load(open(os.path.join(ROOT, "fixtures", "manifest.json")))
    fixture = next(f for f in manifest["fixtures"] if f["name"] == "kv-llama")
    expected["kv-llama.safetensors"] = {"arch": "llama", "tokens": fixture["nextTokens"], "logitsSha256": None}
    for name, e in expected.items():
        e["sha256"] = hashlib.sha256(open(os.path.join(HERE, name), "rb").read()).hexdigest()
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
