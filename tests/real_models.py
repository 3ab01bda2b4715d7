"""The real models of the real-model tier (``pytest -m real``), fetched through mlxkv's own
cache: ``.ci/run`` fetches them before the suite, and a test that finds them missing fetches
them (a fetch that fails fails the test: nothing here skips).

The tier runs in float32: the dequantized weights exactly, which the numpy references compare
against, and the dtype a developer with OpenBLAS preloaded runs fastest (without it bfloat16
reads prompts faster, docs/models.md); every claim the tier checks (bit-identical resumes, batch
rows equal to serial ones, the converted tokenizer and weights) holds per dtype.
"""

import functools
import struct

import mlx_lm
import numpy as np

from mlxkv.models import fetch
from mlxkv.models.fetch_model import gguf_file

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


class GGUFFile:
    """A GGUF file read from the format here, independently of the ``gguf`` package's reader
    the conversion uses: the header (magic, version, tensor and metadata counts), ``kv_count``
    pairs of a string key, a uint32 value type and the value (arrays: an item type, a uint64
    count, the items), then per tensor its name, dimensions (innermost first), type and data
    offset; the data starts at the next multiple of ``general.alignment`` (default 32).
    :meth:`tensor` dequantizes with ``gguf.quants``, llama.cpp's reference dequantizer."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self._data = memoryview(f.read())
        data, self._pos = self._data, 24
        assert bytes(data[:4]) == b"GGUF", path
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        assert version == 3, version
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
            self.tensors[name] = (dims, self._unpack("I"), self._unpack("Q"))
        align = self.metadata.get("general.alignment", 32)
        self._start = -(-self._pos // align) * align

    def _unpack(self, code):
        (v,) = struct.unpack_from("<" + code, self._data, self._pos)
        self._pos += struct.calcsize(code)
        return v

    def _string(self):
        n = self._unpack("Q")
        self._pos += n
        return bytes(self._data[self._pos - n : self._pos]).decode("utf-8")

    def _value(self, kind):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("I"), self._unpack("Q")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            items = np.frombuffer(self._data, np.dtype("<" + _SCALARS[item]), count, self._pos)
            self._pos += items.nbytes
            return items.tolist()
        return self._unpack(_SCALARS[kind])

    def tensor(self, name) -> np.ndarray:
        """Tensor ``name`` in float32, shaped outermost first (``[rows, columns]``)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        dims, kind, offset = self.tensors[name]
        kind = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        rows, row_bytes = int(np.prod(dims[1:])), dims[0] // block * block_bytes
        raw = np.frombuffer(self._data, np.uint8, rows * row_bytes, self._start + offset).reshape(rows, row_bytes)
        return np.asarray(dequantize(raw, kind), np.float32).reshape(*reversed(dims))


@functools.cache
def gguf(name: str) -> GGUFFile:
    """The fetched GGUF file of model ``name``, read once per test process."""
    return GGUFFile(gguf_file(name))
