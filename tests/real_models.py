"""The real models of the real-model tier (``pytest -m real``), fetched through mlxkv's own
cache: ``.ci/run`` fetches them before the suite, and a test that finds them missing fetches
them (a fetch that fails fails the test: nothing here skips).

The tier runs in float32: on Linux CPUs MLX's float32 matrix products are the fastest of the
dtypes without OpenBLAS (docs/models.md), and every claim the tier checks (bit-identical
resumes, batch rows equal to serial ones, the converted tokenizer and weights) holds per dtype.
"""

import functools
import struct

import mlx_lm
import numpy as np

from mlxkv.models import fetch

TIER_DTYPE = "float32"
SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"


def model_dir(name: str, dtype: str = TIER_DTYPE) -> str:
    return str(fetch(name, dtype=dtype))


@functools.cache
def loaded(name: str, dtype: str = TIER_DTYPE):
    """``(model, tokenizer)`` of a fetched model, loaded once per test process."""
    return mlx_lm.load(model_dir(name, dtype))


def chat_prompt(tokenizer, question: str) -> list[int]:
    """The token ids of one user turn and the assistant's opening, by the model's template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


# GGUF metadata value types (the GGUF file format, version 3): scalars by struct code
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@functools.cache
def gguf_metadata(path) -> dict:
    """Every metadata key of a GGUF file, read from the format here (independently of the
    ``gguf`` package the conversion uses): the header, then ``kv_count`` pairs of a string key,
    a uint32 value type and the value; arrays are a type, a uint64 count and the items."""
    data = memoryview(open(path, "rb").read(64 << 20))  # metadata comes first, well within this
    assert bytes(data[:4]) == b"GGUF", path
    version, _, kv_count = struct.unpack_from("<IQQ", data, 4)
    assert version == 3, version
    pos = 24

    def string():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return bytes(data[pos - n : pos]).decode("utf-8")

    def value(kind):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item == _STRING:
                return [string() for _ in range(count)]
            items = np.frombuffer(data, np.dtype("<" + _SCALARS[item]), count, pos)
            pos += items.nbytes
            return items.tolist()
        (v,) = struct.unpack_from("<" + _SCALARS[kind], data, pos)
        pos += struct.calcsize(_SCALARS[kind])
        return v

    meta = {}
    for _ in range(kv_count):
        key = string()
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        meta[key] = value(kind)
    return meta
