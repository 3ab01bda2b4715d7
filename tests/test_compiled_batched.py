"""Compiled decode on the serving path: mlx-lm's ``BatchGenerator`` over
``mlxkv.compiled_model(model)`` decodes mlxkv's batched layouts through the compiled step,
bit-identical to ``BatchGenerator(model)`` (logits, tokens and the stored bytes after every
step), with one trace per layout tuple and batch size; the layouts without a decode step are loud."""

import hashlib
import warnings

import mlx.core as mx
import numpy as np
import pytest
from batch_helpers import drive
from mlx_lm.generate import BatchGenerator

import mlxkv
from mlxkv.batched.bf16first import Bf16FirstBatch
from mlxkv.caches.compiled import CompiledDecoder, compiled_model
from mlxkv.caches.step_builders import decode_phase
from mlxkv.models.seeded import ARCHITECTURES, prompt

SCHEMES = ["bf16", "kv4", "kv8-g32", "turbo-k8v3"]
LENS, MAX_TOKENS, JOIN_AT = (5, 23, 40, 12), (30, 3, 40, 20), 2  # rows finish early, row 3 joins


def digest(cache) -> str:
    """Everything a batched layout stores, as bytes: its buffers (capacity and padding
    included), per-row columns, offsets and state arrays."""
    if isinstance(cache, Bf16FirstBatch):
        return digest(cache.target) + ("" if cache.bf16 is None else digest(cache.bf16))
    h = hashlib.sha1()
    arrays = [*(cache.key_arrays or ()), *(cache.value_arrays or ())] if hasattr(cache, "cols") else cache.cache
    for a in arrays:
        if a is not None:
            h.update(str((a.shape, a.dtype)).encode())
            h.update(np.array(a.view(mx.uint8)).tobytes())
    cols = cache.cols.key() if hasattr(cache, "cols") else None
    h.update(repr((cols, cache.offsets.tolist(), getattr(cache, "dtype", None))).encode())
    return h.hexdigest()


class Recorder:
    """The model ``BatchGenerator`` calls: after every decode step, the digest of every cache
    and, for a compiled model, the phases the step took, the batch size and the capacities."""

    def __init__(self, fn):
        self.fn = fn
        self.digests, self.layouts = [], []

    def __call__(self, inputs, cache=None, **kwargs):
        out = self.fn(inputs, cache=cache, **kwargs)
        if inputs.shape[1] == 1:
            self.digests.append([digest(c) for c in cache])
            decoder = getattr(self.fn, "decoder", None)
            phases = () if decoder is None else decoder.last_phases  # () when a kind had no decode step
            if phases and "eager" not in {p.name for p in phases}:
                # the step's (after its repack)
                capacities = tuple(getattr(getattr(c, "target", c), "capacity", 0) for c in cache)
                self.layouts.append((phases, inputs.shape[0], capacities))
        return out

    def __getattr__(self, name):
        return getattr(self.fn, name)


def serve(fn, model, scheme, lens=LENS, max_tokens=MAX_TOKENS, join_at=JOIN_AT):
    """Rows 0-2 start together, the last row joins after ``join_at`` steps; rows finish early.
    Returns (tokens, logprobs, finished caches) per row and the recorder."""
    rec = Recorder(fn)
    gen = BatchGenerator(rec, prefill_step_size=16, completion_batch_size=4, prefill_batch_size=2)
    make = lambda: mlxkv.make_cache(model, scheme)
    prompts = [prompt(n, seed=30 + i) for i, n in enumerate(lens)]
    return (*drive(gen, prompts, max_tokens, make, join_at), rec)


def saved(path, caches):
    mlxkv.save(str(path), caches, [0] * max(c.offset for c in caches), created_at="2026-01-01T00:00:00Z")
    return path.read_bytes()


def assert_same_serving(tmp_path, eager, compiled):
    (t1, l1, c1, r1), (t2, l2, c2, r2) = eager, compiled
    assert t2 == t1
    assert all(mx.array_equal(a, b).item() for x, y in zip(l1, l2) for a, b in zip(x, y))
    assert r2.digests == r1.digests  # the stored bytes after every step
    for i, (a, b) in enumerate(zip(c1, c2)):  # the finished rows, extracted to serial caches
        assert saved(tmp_path / f"c{i}.safetensors", b) == saved(tmp_path / f"e{i}.safetensors", a)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_generator_decodes_compiled_bit_identical_to_eager(models, tmp_path, arch, scheme):
    model = models(arch)
    eager = serve(model, model, scheme)
    cm = compiled_model(model)
    compiled = serve(cm, model, scheme)
    assert_same_serving(tmp_path, eager, compiled)
    rec = compiled[3]
    assert cm.decoder.eager_steps == 0 and len(rec.layouts) == len(rec.digests)  # every decode step compiled
    # one trace per tuple of layouts (attended columns, capacities) and batch size, none per step
    assert cm.decoder.traces == len(set(rec.layouts)) < len(rec.layouts) // 4
    kinds = {p.kind for step, _, _ in rec.layouts for p in step}
    assert all(k.startswith("kv:batched-") for k in kinds)


def test_repacks_and_ring_wraps_happen_outside_the_graph(models, tmp_path):
    """Long rows: the global layers' buffer fills (the step repacks as the eager append does)
    and the sliding layers' rings wrap and repack; still bit-identical, one trace per capacity."""
    model = models("gemma3")
    lens, max_tokens = (240, 7, 30), (40, 250, 20)
    eager = serve(model, model, "kv4", lens, max_tokens, join_at=30)
    cm = compiled_model(model)
    compiled = serve(cm, model, "kv4", lens, max_tokens, join_at=30)
    assert_same_serving(tmp_path, eager, compiled)
    rec = compiled[3]
    capacities = {c for _, _, caps in rec.layouts for c in caps}
    assert len(capacities) >= 2  # the buffers were repacked to another capacity mid-run
    assert cm.decoder.eager_steps == 0 and cm.decoder.traces == len(set(rec.layouts)) < len(rec.layouts) // 10


def test_batched_eviction_rows_are_refused_with_their_reason(models, tmp_path):
    model = models("llama")
    with pytest.raises(mlxkv.UnknownKindError, match=r"kv:batched-tova.*policy per row.*fallback='eager'"):
        serve(compiled_model(model), model, "tova-b32-s4")
    cm = compiled_model(model, fallback="eager")
    with pytest.warns(mlxkv.EagerDecodeWarning, match="kv:batched-tova"):
        compiled = serve(cm, model, "tova-b32-s4")
    assert_same_serving(tmp_path, serve(model, model, "tova-b32-s4"), compiled)
    assert cm.decoder.traces == 0 and cm.decoder.eager_steps == len(compiled[3].digests)


def test_unconverted_bf16_first_rows_decode_eagerly_until_every_row_converts(models, tmp_path):
    """kv4-start16: the batch is refused while a row is short of 16 positions (it attends its
    bf16 side store); with fallback='eager' those steps run eagerly, the rest compiled."""
    model = models("llama")
    lens, max_tokens = (5, 23, 9), (30, 3, 20)
    with pytest.raises(mlxkv.UnknownKindError, match=r"kv:batched-quant:4:64.*have not converted yet"):
        serve(compiled_model(model), model, "kv4-start16", lens, max_tokens)
    cm = compiled_model(model, fallback="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = serve(cm, model, "kv4-start16", lens, max_tokens)
    assert any(issubclass(w.category, mlxkv.EagerDecodeWarning) for w in caught)
    assert_same_serving(tmp_path, serve(model, model, "kv4-start16", lens, max_tokens), compiled)
    steps = len(compiled[3].digests)
    assert 0 < cm.decoder.eager_steps < steps and cm.decoder.traces >= 1
    assert len(compiled[3].layouts) == steps - cm.decoder.eager_steps


def batch_of(model, scheme, lens):
    """One batch per layer from serial caches holding prompts of ``lens`` tokens."""
    rows = []
    for i, n in enumerate(lens):
        caches = mlxkv.make_cache(model, scheme)
        model(mx.array(prompt(n, seed=i))[None], cache=caches)
        rows.append(caches)
    return [mlxkv.merge_rows(list(layer)) for layer in zip(*rows)]


def test_a_padded_prefill_step_runs_eagerly(models):
    """Inside ``prepare`` .. ``finalize`` a one-token chunk is a prefill step: eager, no error."""
    model = models("hybrid")
    batch = batch_of(model, "kv4", (6, 9))
    for c in batch:
        c.prepare(lengths=[1, 0], right_padding=[0, 1])
    assert {decode_phase(c).name for c in batch} == {"eager"}
    dec = CompiledDecoder(model)
    dec(mx.array([[3], [0]]), batch)
    assert dec.eager_steps == 1 and dec.traces == 0
    for c in batch:
        c.finalize()
    assert {decode_phase(c).name for c in batch} == {"window", "recurrent"}


def test_left_padded_recurrent_state_is_masked_as_mlx_lm_masks_it(models):
    """A recurrent batch with ``left_padding`` (mlx-lm's own left-padded rows): the padding
    enters the trace; the step's mask and the padding's advance are mlx-lm's."""
    model = models("hybrid")
    eager, compiled = batch_of(model, "bf16", (6, 9)), batch_of(model, "bf16", (6, 9))
    for c in eager + compiled:
        if c.kind == "kv:batched-ssm":
            c.left_padding = mx.array([1, 0])
    dec = CompiledDecoder(model)
    tokens = mx.array([[5], [7]])
    for _ in range(3):
        assert mx.array_equal(dec(tokens, compiled), model(tokens, cache=eager)).item()
    assert [digest(c) for c in compiled] == [digest(c) for c in eager]
    ssm = [c for c in compiled if c.kind == "kv:batched-ssm"]
    assert ssm[0].left_padding.tolist() == [-2, -3] and dec.traces == 1 and dec.eager_steps == 0
