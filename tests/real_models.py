"""The real models of the real-model tier (``pytest -m real``), fetched through mlxkv's own
cache: ``.ci/run`` fetches them before the suite, and a test that finds them missing fetches
them (a fetch that fails fails the test: nothing here skips).

The tier runs in float32: the dequantized weights exactly, which the numpy references compare
against, and the dtype a developer with OpenBLAS preloaded runs fastest (without it bfloat16
reads prompts faster, docs/models.md); every claim the tier checks (bit-identical resumes, batch
rows equal to serial ones, the converted tokenizer and weights) holds per dtype.
"""

import functools
import glob
import math
import os
import struct
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
import numpy as np

from mlxkv.models import fetch
from mlxkv.models.fetch_model import gguf_file

TIER_DTYPE = "float32"
SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"


#: Debian's OpenBLAS (``libopenblas0-pthread``), where installed: MLX's Linux wheel multiplies
#: float32 matrices with a reference BLAS, and the tier's demo processes spend their time there
OPENBLAS = min(glob.glob("/usr/lib/*-linux-gnu/libopenblas.so.0"), default=None) if sys.platform == "linux" else None


def child_env() -> dict:
    """The environment of the tier's child processes that compare only with each other (a
    demo and the fresh process it resumes in): OpenBLAS preloaded where installed, one thread
    each (two demos share two cores). Tests in this process keep MLX's own BLAS: fixtures and
    tolerances the rest of the suite checks were computed with it."""
    env = dict(os.environ)
    if OPENBLAS is not None and "LD_PRELOAD" not in env:
        env.update(LD_PRELOAD=OPENBLAS, OPENBLAS_NUM_THREADS="1")
    return env


def model_dir(name: str, dtype: str = TIER_DTYPE) -> str:
    return str(fetch(name, dtype=dtype))


@functools.cache
def tokenizer(name: str):
    """A fetched model's tokenizer, loaded once per test process: every dtype's directory holds
    the same tokenizer files and ``eos_token_id`` (Gemma's takes about 9 s to load)."""
    directory = Path(model_dir(name))
    eos = mlx_lm.utils.load_config(directory).get("eos_token_id")  # as mlx_lm.load reads it
    return mlx_lm.utils.load_tokenizer(directory, eos_token_ids=eos)


def loaded(name: str, dtype: str = TIER_DTYPE):
    """``(model, tokenizer)`` of a fetched model as ``mlx_lm.load`` gives them, each loaded once
    per test process (``loaded(name)`` and ``loaded(name, TIER_DTYPE)`` are the same model)."""
    return _model(name, dtype), tokenizer(name)


@functools.cache
def _model(name: str, dtype: str):
    return mlx_lm.utils.load_model(Path(model_dir(name, dtype)))[0]


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

    def tensor(self, name, rows=None) -> np.ndarray:
        """Tensor ``name`` in float32, shaped outermost first (``[rows, columns]``); ``rows``:
        only those rows of a matrix (each row is whole blocks: an embedding's lookup
        dequantizes the tokens it looks up, not the vocabulary)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        dims, kind, offset = self.tensors[name]
        kind = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n, row_bytes = int(np.prod(dims[1:])), dims[0] // block * block_bytes
        raw = np.frombuffer(self._data, np.uint8, n * row_bytes, self._start + offset).reshape(n, row_bytes)
        if rows is not None:
            assert len(dims) == 2, name
            return np.asarray(dequantize(raw[list(rows)], kind), np.float32).reshape(len(rows), dims[0])
        return np.asarray(dequantize(raw, kind), np.float32).reshape(*reversed(dims))


@functools.cache
def gguf(name: str) -> GGUFFile:
    """The fetched GGUF file of model ``name``, read once per test process."""
    return GGUFFile(gguf_file(name))


# -- an independent Gemma 3 forward pass in numpy, from the GGUF ---------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_split_half(x, base):
    t, half = x.shape[-2], x.shape[-1] // 2
    angle = np.arange(t, dtype=np.float32)[:, None] * base ** (-np.arange(half, dtype=np.float32) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@functools.cache
def numpy_gemma3(ids: tuple) -> tuple:
    """``(hidden [T, d], [(keys, values)] per layer)`` of Gemma 3 over ``ids`` from the GGUF,
    written from its published architecture with llama.cpp's conventions for the file, not
    the converter's output: embedding scaled by sqrt(d) (rounded to bfloat16, as the
    reference implementations and mlx-lm compute it); per layer pre-norm attention with
    per-head query/key norms, post-attention norm, pre- and post-feed-forward norms around a
    GELU-gated MLP; scores scaled by head_dim ** -0.5; the norm weights as stored (with the
    ``+ 1`` the converter takes out). Local layers (five of every six) attend the last
    ``sliding_window`` positions with RoPE base 10,000, global ones everything with the
    file's base. ``hidden`` is after the final norm (the logits are ``hidden @ embedding.T``);
    the keys and values are what a cache holds, ``[kv_heads, T, head_dim]``."""
    g = gguf(GEMMA3)
    m = {k.removeprefix("gemma3."): v for k, v in g.metadata.items()}
    d, dh, eps = m["embedding_length"], m["attention.key_length"], m["attention.layer_norm_rms_epsilon"]
    heads, kv_heads, window = m["attention.head_count"], m["attention.head_count_kv"], m["attention.sliding_window"]
    t = len(ids)
    x = g.tensor("token_embd.weight", rows=ids) * np.float32(mx.array(math.sqrt(d), mx.bfloat16).item())
    pos = np.arange(t)
    causal = np.where(pos[None, :] <= pos[:, None], 0, -np.inf).astype(np.float32)
    local = np.where(pos[None, :] > pos[:, None] - window, causal, -np.inf).astype(np.float32)
    kv = []
    for i in range(m["block_count"]):
        w = lambda name, i=i: g.tensor(f"blk.{i}.{name}.weight")
        is_local = i % 6 < 5
        h = _rms(x, w("attn_norm"), eps)
        q = _rms((h @ w("attn_q").T).reshape(t, heads, dh), w("attn_q_norm"), eps).transpose(1, 0, 2)
        k = _rms((h @ w("attn_k").T).reshape(t, kv_heads, dh), w("attn_k_norm"), eps).transpose(1, 0, 2)
        v = (h @ w("attn_v").T).reshape(t, kv_heads, dh).transpose(1, 0, 2)
        base = 10000.0 if is_local else m["rope.freq_base"]
        q, k = _rope_split_half(q, base), _rope_split_half(k, base)
        kv.append((k, v))
        k, v = np.repeat(k, heads // kv_heads, 0), np.repeat(v, heads // kv_heads, 0)
        s = q @ k.transpose(0, 2, 1) * np.float32(dh**-0.5) + (local if is_local else causal)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(t, heads * dh)
        x = x + _rms(o @ w("attn_output").T, w("post_attention_norm"), eps)
        h = _rms(x, w("ffn_norm"), eps)
        f = (_gelu_tanh(h @ w("ffn_gate").T) * (h @ w("ffn_up").T)) @ w("ffn_down").T
        x = x + _rms(f, w("post_ffw_norm"), eps)
    return _rms(x, g.tensor("output_norm.weight"), eps), kv
