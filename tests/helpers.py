"""Tools for tests that damage or rewrite snapshot files."""

import json
import os
import struct

from mlxkv.io import tensor_reader
from mlxkv.io.safetensors import crc32_hex


def read_raw(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def rewrite_header(path, edit, fix_crc=True):
    """Apply ``edit(mlxkv_header_dict)`` and write the file back (header re-padded)."""
    doc, body = read_raw(path)
    header = json.loads(doc["__metadata__"]["mlxkv"])
    edit(header)
    text = json.dumps(header, separators=(",", ":"))
    doc["__metadata__"]["mlxkv"] = text
    if fix_crc:
        doc["__metadata__"]["mlxkv.crc32"] = crc32_hex(text.encode())
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def flip_bit(path, byte_offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(byte_offset)
        b = f.read(1)[0]
        f.seek(byte_offset)
        f.write(bytes([b ^ (1 << bit)]))


def data_start(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def replace_before_tensors(monkeypatch, other, path):
    """The next load of ``path`` finds it replaced by ``other`` (``os.replace``) after its
    header was read, just before its tensors are."""
    real = tensor_reader.TensorReader.read_all

    def replaced_first(self, *a, **k):
        os.replace(other, path)
        return real(self, *a, **k)

    monkeypatch.setattr(tensor_reader.TensorReader, "read_all", replaced_first)
