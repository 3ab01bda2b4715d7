"""The tensor reader: bytes, slack, checksums and failures of the one-copy load path."""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.errors import CorruptSnapshotError, SnapshotError
from mlxkv.io import tensor_reader, zeroing
from mlxkv.io.safetensors import SafetensorsFile, read_safetensors_header, write_atomic
from mlxkv.io.tensor_reader import TensorReader


def tensors():
    keys = mx.random.split(mx.random.key(7), 3)
    big = mx.random.normal((1, 8, 520, 128), key=keys[0]).astype(mx.bfloat16)  # 1.02 MiB
    small = mx.random.normal((2, 2, 5, 16), key=keys[1]).astype(mx.float16)
    codes = mx.random.randint(0, 2**31, (3, 7), key=keys[2]).astype(mx.uint32)
    return [
        ("big", big),
        ("small", small),
        ("codes", codes),
        ("scalar", mx.array(3.5, dtype=mx.float32)),
        ("empty", mx.zeros((1, 2, 0, 8), mx.bfloat16)),
    ]


@pytest.fixture
def stored(tmp_path):
    path = str(tmp_path / "t.safetensors")
    ts = tensors()
    crcs = write_atomic(path, ts, lambda c: {"crc": ",".join(c[n] for n, _ in ts)}, fsync=False)
    return path, dict(ts), crcs


def read_all(path, crcs, rows=None):
    with TensorReader(read_safetensors_header(path)) as reader:
        return reader.read_all([(n, crcs[n], rows.get(n) if rows else None) for n in crcs])


def test_every_tensor_comes_back_exact(stored):
    path, want, crcs = stored
    got = read_all(path, crcs)
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert mx.array_equal(got[name], a).item(), name


def address(a: mx.array) -> int:
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def test_slack_rows_follow_the_data_and_are_zero(stored):
    path, want, crcs = stored
    dirty = mx.full((1 * 8 * 640 * 128 * 2,), 255, mx.uint8)  # bf16 NaNs, freed for MLX to reuse
    mx.eval(dirty)
    reused = address(dirty)
    del dirty
    got = read_all(path, crcs, rows={"big": 640, "small": 9, "empty": 4, "codes": 99})
    big, small = got["big"], got["small"]
    assert address(big) == reused  # the slack was garbage before it was zeroed
    assert big.shape == (1, 8, 640, 128) and small.shape == (2, 2, 9, 16)
    assert mx.array_equal(big[:, :, :520], want["big"]).item()
    assert mx.array_equal(small[:, :, :5], want["small"]).item()
    assert not mx.any(big[:, :, 520:]).item() and not mx.any(small[:, :, 5:]).item()
    assert got["empty"].shape == (1, 2, 4, 8) and not mx.any(got["empty"]).item()
    assert got["codes"].shape == (3, 7)  # rows applies to rank-4 tensors only


@pytest.mark.parametrize("pages_given_back", [True, False], ids=["madvise", "written"])
@pytest.mark.parametrize("start", [0, 1, 4095, 4096, 5000])
@pytest.mark.parametrize("length", [0, 1, 4096, 16384, 3 * 4096 + 7, 40000])
def test_zeroing_a_run_clears_exactly_its_bytes(start, length, pages_given_back, monkeypatch):
    """Whole pages are given back to the system (Linux, CPU), the ends written; or every byte
    written (elsewhere): either way the run reads as zeros and the bytes around it keep theirs."""
    if not pages_given_back:
        monkeypatch.setattr(zeroing, "_madvise", lambda: None)
    else:  # Linux's CPU backend gives pages back; elsewhere both cases write
        assert (zeroing._madvise() is not None) == (sys.platform == "linux" and not mx.cuda.is_available())
    a = mx.full((64 << 10,), 0xAB, mx.uint8)
    mx.eval(a)
    zeroing.zero(memoryview(a)[8192 + start : 8192 + start + length])
    got = np.array(a)
    assert not got[8192 + start : 8192 + start + length].any()
    assert (got[: 8192 + start] == 0xAB).all() and (got[8192 + start + length :] == 0xAB).all()


def test_both_halves_of_a_split_read_are_checked(stored, monkeypatch):
    path, want, crcs = stored
    assert want["big"].nbytes >= tensor_reader._SPLIT_MIN  # read by two threads
    info = read_safetensors_header(path).tensors["big"]
    for where in (info.begin + 10, info.end - 10):  # first half: caller; second half: helper
        with open(path, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptSnapshotError, match="checksum mismatch in tensor 'big'"):
            read_all(path, crcs, rows={"big": 640})
        with open(path, "r+b") as f:
            f.seek(where)
            f.write(byte)
    read_all(path, crcs, rows={"big": 640})  # restored: reads again


def test_short_reads_are_resumed(stored, monkeypatch):
    path, want, crcs = stored
    real = os.preadv

    def dribble(fd, buffers, offset):  # the kernel may return less than asked: 1000 bytes at most
        first = buffers[0]
        return real(fd, [first[: min(len(first), 1000)]], offset)

    monkeypatch.setattr(os, "preadv", dribble)
    got = read_all(path, crcs, rows={"big": 600})
    assert mx.array_equal(got["big"][:, :, :520], want["big"]).item()
    assert mx.array_equal(got["codes"], want["codes"]).item()


@pytest.mark.parametrize("verified", [True, False])
def test_reads_are_chunked_only_for_a_checksum(stored, monkeypatch, verified):
    path, want, crcs = stored
    real, calls = os.preadv, []

    def counted(fd, buffers, offset):
        calls.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    monkeypatch.setattr(tensor_reader, "_CHUNK", 64 << 10)
    given = crcs if verified else dict.fromkeys(crcs)
    got = read_all(path, given, rows={"big": 600})
    assert mx.array_equal(got["big"][:, :, :520], want["big"]).item()
    big = want["big"].nbytes
    # verified: the big tensor's two halves in 64 KiB chunks; not: one read per half
    assert sum(c >= big // 2 for c in calls) == (0 if verified else 2), calls
    assert max(calls) <= (64 << 10 if verified else big)


def test_single_thread_read_without_preadv_gives_the_same_arrays(stored, monkeypatch):
    path, want, crcs = stored
    monkeypatch.setattr(tensor_reader, "_PARALLEL", False)
    monkeypatch.delattr(os, "preadv")
    got = read_all(path, crcs, rows={"big": 600})
    assert mx.array_equal(got["big"][:, :, :520], want["big"]).item()
    assert mx.array_equal(got["small"], want["small"]).item()


def test_a_file_cut_short_after_its_header_was_checked(stored):
    path, _, crcs = stored
    with SafetensorsFile(path) as file:
        with open(path, "r+b") as f:
            f.truncate(file.header.file_size - 100)
        reader = TensorReader(file)
        with pytest.raises(CorruptSnapshotError, match="truncated while loading"):
            reader.read_all([(n, crcs[n], None) for n in crcs])


def test_a_header_alone_refuses_a_file_replaced_since(stored, tmp_path):
    path, _, crcs = stored
    st = read_safetensors_header(path)
    os.replace(path, str(tmp_path / "elsewhere"))
    write_atomic(path, tensors(), lambda c: {"crc": "x"}, fsync=False)  # same bytes, another file
    with pytest.raises(SnapshotError, match="changed since its header was read"):
        TensorReader(st)


def test_an_io_error_is_ours(stored, monkeypatch):
    path, _, crcs = stored

    def fail(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tensor_reader, "_pread_into", fail)
    with pytest.raises(SnapshotError, match="cannot read: .*Input/output error"):
        read_all(path, crcs)


def test_progress_counts_stored_bytes_up_to_the_total(stored):
    path, want, crcs = stored
    seen = []
    with TensorReader(read_safetensors_header(path)) as reader:
        reader.read_all([(n, crcs[n], 640 if n == "big" else None) for n in crcs], lambda d, t: seen.append((d, t)))
    total = sum(a.nbytes for a in want.values())
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_checksum_reads_without_building_arrays(stored):
    path, _, crcs = stored
    with TensorReader(read_safetensors_header(path)) as reader:
        assert {n: reader.checksum(n) for n in crcs} == crcs


def test_chunks_regroup_pieces_without_losing_a_byte():
    data = bytearray(np.arange(5000, dtype=np.int64).astype(np.uint8).tobytes())
    view = memoryview(data)
    pieces = [(view[0:1500], 100), (view[1500:1600], 1600), (view[1600:5000], 1700)]
    chunks = list(tensor_reader._chunks(pieces, 1024))
    assert [off for _, off in chunks] == [100, 1124, 2148, 3172, 4196]
    assert b"".join(bytes(v) for vs, _ in chunks for v in vs) == bytes(data)
    head, tail = tensor_reader._split(pieces, 1550)
    assert sum(len(v) for v, _ in head) == 1550 and tail[0][1] == 1650
