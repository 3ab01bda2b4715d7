"""Compiled decode: every kind through the compiled step, bit-identical to the eager step,
one trace per tuple of step layouts; the driver inside mlx_lm.generate/stream_generate."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import mlxkv
from mlxkv.caches.compiled import CompiledDecoder, compiled_model
from mlxkv.caches.decode_step import Phase
from mlxkv.caches.step_builders import decode_phase, decode_step
from mlxkv.models.seeded import SCHEMES, prompt, tokenizer

STEPS = 64
OPTIONS = {"qfilters-b32-s4-r8": {"calib_tokens": 24}}  # calibrates, then evicts, within the run
CASES = [(arch, s, OPTIONS.get(s, {})) for arch in ("llama", "gemma3", "hybrid") for s in SCHEMES]
# rings: one fills, then wraps; one gets a prompt longer than itself (trimmed at the first step)
CASES += [("llama", "bf16", {"max_kv_size": 48}), ("llama", "kv4", {"max_kv_size": 16})]


class Recorder:
    """Wraps the callable ``generate_step`` is given: records every call's logits, and the
    predicted phase of every decode step."""

    def __init__(self, fn, caches):
        self.fn, self.caches = fn, caches
        self.logits, self.phases = [], []

    def __call__(self, inputs, cache=None, **kwargs):
        if inputs.shape[1] == 1:
            self.phases.append(tuple(decode_phase(c) for c in self.caches))
        out = self.fn(inputs, cache=cache, **kwargs)
        self.logits.append(out)
        return out

    def __getattr__(self, name):
        return getattr(self.fn, name)


def generate(fn, model, scheme, options, tokens):
    caches = mlxkv.make_cache(model, scheme, **options)
    rec = Recorder(fn, caches)
    out = [t for t, _ in generate_step(mx.array(tokens), rec, max_tokens=STEPS, prompt_cache=caches)]
    return out, rec, caches


def saved_bytes(path, caches, tokens):
    mlxkv.save(str(path), caches, tokens, created_at="2026-01-01T00:00:00Z")
    return path.read_bytes()


@pytest.mark.parametrize("arch,scheme,options", CASES, ids=[f"{a}-{s}-{'-'.join(o)}" for a, s, o in CASES])
def test_compiled_decode_is_bit_identical_to_eager(models, tmp_path, arch, scheme, options):
    model = models(arch)
    tokens = prompt(10 if "start16" in scheme else 20, seed=3)
    ref_tokens, ref, ref_caches = generate(model, model, scheme, options, tokens)
    cm = compiled_model(model)
    got_tokens, got, got_caches = generate(cm, model, scheme, options, tokens)

    assert got_tokens == ref_tokens and len(got.logits) == len(ref.logits) == STEPS + 2
    assert all(mx.array_equal(a, b).item() for a, b in zip(got.logits, ref.logits))
    assert cm.decoder.eager_steps == 0  # every decode step compiled
    # one trace per tuple of layouts (kinds, constants, phases and rows), none per step
    assert cm.decoder.traces == len(set(got.phases)) <= 3
    assert cm.decoder.last_phases == got.phases[-1]
    names = {p.name for step in got.phases for p in step}
    if arch == "gemma3" or "max_kv_size" in options:
        filled_in_decode = len(tokens) < options.get("max_kv_size", 32)
        assert names >= ({"ring-fill", "ring-wrapped"} if filled_in_decode else {"ring-wrapped"})
    if "start16" in scheme:
        assert {p.kind for step in got.phases for p in step} >= {"kv:plain", ref_caches[-1].kind}
    # the stored caches: the same snapshot bytes, and the same buffers (capacity included)
    history = tokens + ref_tokens
    assert saved_bytes(tmp_path / "c.safetensors", got_caches, history) == saved_bytes(
        tmp_path / "e.safetensors", ref_caches, history
    )
    for a, b in zip(got_caches, ref_caches):
        a, b = getattr(a, "inner", a), getattr(b, "inner", b)
        keys = getattr(a, "keys", None)
        if isinstance(keys, mx.array):
            assert keys.shape == b.keys.shape
        if getattr(a, "storage", None) is not None:  # TurboQuant: the codes the step wrote, adopted
            assert [x.shape for x in a.storage] == [x.shape for x in b.storage]


def test_generate_and_stream_generate_decode_through_the_compiled_step(models):
    model, tok = models("gemma3"), tokenizer()
    text = prompt(12, seed=5)
    eager = mlx_lm.generate(model, tok, text, max_tokens=40, prompt_cache=mlxkv.make_cache(model, "kv4"))
    cm = compiled_model(model)
    assert mlx_lm.generate(cm, tok, text, max_tokens=40, prompt_cache=mlxkv.make_cache(model, "kv4")) == eager
    assert cm.decoder.traces == 2 and cm.decoder.eager_steps == 0  # ring fill, then wrapped

    def stream(m):
        caches = mlxkv.make_cache(model, "kv4")
        return [r.token for r in mlx_lm.stream_generate(m, tok, text, max_tokens=8, prompt_cache=caches)]

    assert stream(cm) == stream(model)
    assert cm.layers is model.layers  # the wrapper is the model for everything but decode steps


def _decode(fn, caches, first, n):
    y, out = mx.array([[first]]), []
    for _ in range(n):
        logits = fn(y, caches)[:, -1]
        y = mx.argmax(logits, axis=-1)[:, None]
        out.append(logits)
    mx.eval(out)
    return out


def test_rings_narrower_windows_and_sinks_use_mlx_lms_rolled_mask(models):
    """gemma3's sliding layers as rings longer than the window, with sinks: mlx-lm masks them
    with a rolled array mask, which the compiled step rebuilds from a traced shift."""
    model = models("gemma3")

    def caches():
        out = mlxkv.make_cache(model, "bf16")
        for i, c in enumerate(out):
            if c.kind == "kv:rotating-plain":
                out[i] = mlxkv.RotatingKVCache(48, keep=2)
                out[i].masks = c.masks
        return out

    eager, comp = caches(), caches()
    p = mx.array(prompt(20, seed=6))[None]
    first = int(mx.argmax(model(p, cache=eager)[0, -1]).item())
    model(p, cache=comp)
    dec = CompiledDecoder(model)
    a = _decode(lambda y, c: model(y, cache=c), eager, first, 40)
    b = _decode(dec, comp, first, 40)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert eager[0].offset == 60 > 48 and dec.traces == 2


def test_rows_of_one_serial_cache_decode_together(models):
    """Serial caches holding several rows of equal length (a batch prefilled together)."""
    model = models("llama")
    eager, comp = mlxkv.make_cache(model, "kv8-g32"), mlxkv.make_cache(model, "kv8-g32")
    p = mx.array([prompt(12, seed=1), prompt(12, seed=2)])
    for c in (eager, comp):
        model(p, cache=c)
    dec = CompiledDecoder(model)
    y = mx.array([[3], [4]])
    for _ in range(5):
        a, b = model(y, cache=eager), dec(y, comp)
        assert a.shape == (2, 1, 256) and mx.array_equal(a, b).item()
        y = mx.argmax(a[:, -1], axis=-1)[:, None]
    assert dec.traces == 1


def test_the_first_append_to_an_empty_cache_runs_eagerly(models):
    model = models("hybrid")
    eager, comp = mlxkv.make_cache(model, "kv8-g32"), mlxkv.make_cache(model, "kv8-g32")
    assert decode_phase(comp[1]).name == "eager"
    dec = CompiledDecoder(model)
    a = _decode(lambda y, c: model(y, cache=c), eager, 7, 6)
    b = _decode(dec, comp, 7, 6)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert dec.eager_steps == 1 and dec.traces == 1


def test_a_window_mask_on_a_linear_step_is_mlx_lms():
    """A sliding window asked of a linear cache: mlx-lm's causal mask over the exact window,
    the padded rows hidden."""
    from mlx_lm.models.cache import create_attention_mask

    cache = mlxkv.KVCache()
    cache.update_and_fetch(*(mx.zeros((1, 2, 40, 8)),) * 2)
    step = decode_step(cache)
    sc = step.layout.open(step.arrays)
    mask = sc.make_mask(1, window_size=16)
    want = create_attention_mask(1, 40, False, 16)  # [1, 41]
    assert mask.shape == (256,) and not mask[41:].any().item()
    assert mx.array_equal(mask[:41], want[0]).item()
    assert sc.make_mask(1).sum().item() == 41
    with pytest.raises(mlxkv.MLXKVError, match="one query position"):
        sc.make_mask(2)


def test_a_cache_without_a_decode_step_is_loud(models):
    model = models("llama")
    native = [mlx_cache.KVCache() for _ in model.layers]  # mlx-lm's own: no kind
    model(mx.array(prompt(6))[None], cache=native)
    with pytest.raises(mlxkv.UnknownKindError, match="fallback='eager'"):
        CompiledDecoder(model)(mx.array([[1]]), native)
    dec = CompiledDecoder(model, fallback="eager")
    with pytest.warns(mlxkv.EagerDecodeWarning, match="runs eagerly"):
        dec(mx.array([[1]]), native)
    assert dec.eager_steps == 1 and dec.traces == 0 and native[0].offset == 7
    with pytest.raises(mlxkv.MLXKVError, match="fallback must be one of"):
        CompiledDecoder(model, fallback="quiet")
    with pytest.raises(mlxkv.MLXKVError, match=r"tokens \[B, 1\]"):
        CompiledDecoder(model)(mx.array([[1, 2]]), mlxkv.make_cache(model, "bf16"))


def test_a_model_that_cannot_be_traced_is_loud_and_changes_nothing(models):
    """A model reading the position as a Python integer cannot be traced: an error of ours
    (or, with fallback='eager', a warning and the eager step), the caches untouched."""
    model = models("llama")

    def peeky(inputs, cache=None):
        return model(inputs, cache=cache) + int(cache[0].offset) * 0

    caches = mlxkv.make_cache(model, "bf16")
    model(mx.array(prompt(6))[None], cache=caches)
    with pytest.raises(mlxkv.MLXKVError, match="cannot run a compiled decode step"):
        CompiledDecoder(peeky)(mx.array([[1]]), caches)
    assert caches[0].offset == 6
    dec = CompiledDecoder(peeky, fallback="eager")
    with pytest.warns(mlxkv.EagerDecodeWarning, match="tracing the model failed"):
        dec(mx.array([[1]]), caches)
    assert caches[0].offset == 7 and dec.eager_steps == 1


def test_decode_phase_predicts_without_changing_the_cache(models):
    model = models("llama")
    caches = mlxkv.make_cache(model, "turbo-k8v3-start16")
    model(mx.array(prompt(10))[None], cache=caches)
    c = caches[0]
    assert c.kind == "kv:plain" and decode_phase(c).kind == "kv:plain"  # short of its start
    # six positions appended behind the wrapper's back: the conversion is due, not yet done
    c.inner.update_and_fetch(*(mx.zeros((1, 2, 6, 64), mx.bfloat16),) * 2)
    assert c.kind == "kv:plain" and c.pending.due(c.offset)
    phase = decode_phase(c)
    assert (phase.kind, phase.name, phase.rows) == ("kv:turboquant:8:3", "window", 256)
    assert c.kind == "kv:plain" and c.pending is not None and c.offset == 16  # unchanged
    ring = mlxkv.RotatingKVCache(8, keep=1)
    ring.update_and_fetch(*(mx.zeros((1, 2, 5, 64)),) * 2)
    before = (ring.offset, ring._idx, ring.keys.shape)
    assert decode_phase(ring) == Phase("kv:rotating-plain", "ring-fill", 8)
    assert (ring.offset, ring._idx, ring.keys.shape) == before
    tova = mlxkv.TOVAKVCache(16, 2)
    tova.update_and_fetch(*(mx.zeros((1, 2, 20, 64)),) * 2)
    assert decode_phase(tova).rows == 17  # kept rows plus the new one, capped at budget + 1


def test_steps_of_the_same_layout_and_phase_are_equal(models):
    """What makes a trace: layouts compare equal across steps of one phase."""
    a, b = mlxkv.QuantizedKVCache(32, 4), mlxkv.QuantizedKVCache(32, 4)
    for c, n in ((a, 10), (b, 200)):
        c.update_and_fetch(*(mx.zeros((1, 2, n, 64), mx.bfloat16),) * 2)
    assert decode_step(a).layout == decode_step(b).layout
    c = mlxkv.QuantizedKVCache(32, 8)
    c.update_and_fetch(*(mx.zeros((1, 2, 10, 64), mx.bfloat16),) * 2)
    assert decode_step(c).layout != decode_step(a).layout


def test_a_trimmed_turboquant_cache_decodes_compiled_into_the_buffer_the_eager_append_keeps(models, tmp_path):
    """After a trim the codes buffer holds more rows than the positions need: the compiled
    step writes that buffer, as the eager append does, and the cache keeps its capacity."""
    model = models("llama")
    tokens = prompt(300, seed=4)

    def trimmed():
        caches = mlxkv.make_cache(model, "turbo-k8v3")
        mx.eval(model(mx.array(tokens)[None], cache=caches))  # the prompt's 300 rows, exactly
        mx.eval(model(mx.array([[tokens[-1]]]), cache=caches))  # the append grows them to 512
        for c in caches:
            c.trim(101)  # 200 positions in a 512-row buffer
        return caches

    eager, compiled = trimmed(), trimmed()
    assert eager[0].storage[0].shape[2] == 512 and eager[0].offset == 200
    y = mx.array([[tokens[200]]])
    want, got = model(y, cache=eager), CompiledDecoder(model)(y, compiled)
    assert mx.array_equal(want, got).item()
    assert [[a.shape for a in c.storage] for c in compiled] == [[a.shape for a in c.storage] for c in eager]
    history = tokens[:201]
    assert saved_bytes(tmp_path / "c.safetensors", compiled, history) == saved_bytes(
        tmp_path / "e.safetensors", eager, history
    )
