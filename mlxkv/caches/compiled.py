"""The compiled decode driver: one decode step of a whole mlx-lm model under ``mx.compile``.

``CompiledDecoder(model)(tokens, caches)`` is ``model(tokens, cache=caches)`` for one new
position per row: every cache enters as its ``DecodeStep`` (its part in the step, built by its
family: ``mlxkv.caches.step_builders``), the model runs traced over stand-in caches, and each
step's commit writes the new position into the real cache after the step. The traced
function is compiled once per tuple of step layouts (the kinds, constants and phases of all
layers); array shapes are fixed within a phase, so a
trace serves every step of that phase. ``traces`` counts how often the model was traced.

``compiled_model(model)`` wraps a model so that ``mlx_lm.generate``/``stream_generate`` (and
anything else that calls ``model(tokens, cache=caches)``) decode through the compiled step;
prompts (more than one position) run eagerly.

mlx-lm's ``BatchGenerator`` given ``compiled_model(model)`` decodes mlxkv's batched layouts
through it too (their decode steps: ``mlxkv.batched.step_builders``).

Steps that cannot be compiled: an empty cache's first append runs eagerly (it fixes the
cache's geometry, like a prefill), as does a one-position step inside a batch's padded
prefill. A cache whose kind has no decode step (a cache without an mlxkv kind, a batch of eviction
rows, a bf16-first batch with rows not converted yet) raises
:class:`~mlxkv.errors.UnknownKindError` naming the kind and why, and a model that
cannot be traced raises :class:`~mlxkv.errors.MLXKVError`, before anything is written; with
``fallback="eager"`` such a step runs eagerly with an :class:`~mlxkv.errors.EagerDecodeWarning`.
"""

import warnings
from collections import OrderedDict

import mlx.core as mx

from ..errors import EagerDecodeWarning, MLXKVError, UnknownKindError
from .decode_step import EagerLayout
from .step_builders import decode_step

FALLBACKS = ("raise", "eager")


class _Trace:
    """One compiled step per tuple of layouts, and what its trace recorded."""

    def __init__(self, fn):
        self.fn = fn
        self.effects = None  # per layer: what the commit replays (fixed for the trace)


class CompiledDecoder:
    """A compiled decode step for ``model`` (an mlx-lm model: ``model(tokens, cache=caches)``
    with attention modules that call ``cache.update_and_fetch``, ``cache.offset`` for RoPE
    and ``cache.make_mask``/``create_attention_mask``)."""

    def __init__(self, model, fallback: str = "raise", max_traces: int = 16):
        if fallback not in FALLBACKS:
            raise MLXKVError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        if not isinstance(max_traces, int) or max_traces < 1:
            raise MLXKVError(f"max_traces must be an integer >= 1, got {max_traces!r}")
        self.model = model
        self.fallback = fallback
        self.max_traces = max_traces  # compiled steps kept (least recently used dropped)
        self.traces = 0  # times the model was traced (one per layout tuple and shape)
        self.eager_steps = 0  # steps run eagerly (first appends, fallbacks)
        self.last_phases = ()  # the phase of every cache in the last step
        self._compiled: OrderedDict[tuple, _Trace] = OrderedDict()

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        """One decode step: ``tokens`` [B, 1] -> logits [B, 1, vocab]; the caches advance."""
        if tokens.ndim != 2 or tokens.shape[1] != 1:
            raise MLXKVError(f"a compiled decode step takes tokens [B, 1], got shape {list(tokens.shape)}")
        steps = self._steps(caches)
        self.last_phases = () if steps is None else tuple(s.phase for s in steps)
        if steps is None or any(isinstance(s.layout, EagerLayout) for s in steps):
            self.eager_steps += 1
            return self.model(tokens, cache=caches)
        layouts = tuple(s.layout for s in steps)
        trace = self._compiled.get(layouts) or self._compile(layouts)
        self._compiled.move_to_end(layouts)
        try:
            # one token dtype (a prompt's int32, a sampler's uint32): a dtype change would retrace
            logits, new = trace.fn(tokens.astype(mx.int32), [s.arrays for s in steps])
        except Exception as e:  # the trace failed; nothing was written to the caches
            del self._compiled[layouts]
            if self.fallback == "raise":
                raise MLXKVError(
                    f"the model cannot run a compiled decode step ({type(e).__name__}: {e}); decode it "
                    "eagerly, or pass fallback='eager'"
                ) from e
            warnings.warn(
                f"compiled decode: tracing the model failed ({e}); this step runs eagerly",
                EagerDecodeWarning,
                stacklevel=2,
            )
            self.eager_steps += 1
            return self.model(tokens, cache=caches)
        for step, n, effects in zip(steps, new, trace.effects):
            step.commit(n, effects)
        return logits

    def _steps(self, caches):
        try:
            return [decode_step(c) for c in caches]
        except UnknownKindError as e:
            if self.fallback == "raise":
                raise UnknownKindError(
                    e.kind,
                    f"{e.where or 'no compiled decode step'}; pass fallback='eager' to decode such steps eagerly",
                ) from e
            warnings.warn(
                f"compiled decode: cache kind {e.kind!r} cannot run compiled ({e.where}); this step runs eagerly",
                EagerDecodeWarning,
                stacklevel=3,
            )
            return None

    def _compile(self, layouts: tuple) -> _Trace:
        def step(tokens, arrays):
            self.traces += 1
            stand_ins = [layout.open(a) for layout, a in zip(layouts, arrays)]
            logits = self.model(tokens, cache=stand_ins)
            trace.effects = [c.effects() for c in stand_ins]
            return logits, [c.outputs() for c in stand_ins]

        # the weights are inputs of the trace, not constants: a model updated later is seen
        state = getattr(self.model, "state", None)
        trace = _Trace(mx.compile(step, inputs=None if state is None else [state]))
        self._compiled[layouts] = trace
        if len(self._compiled) > self.max_traces:  # capacities only grow: old ones rarely return
            self._compiled.popitem(last=False)
        return trace


class CompiledModel:
    """``model`` with its single-position forwards over a cache list compiled: pass it to
    ``mlx_lm.generate``/``stream_generate`` with ``prompt_cache=mlxkv.make_cache(model, ...)``.
    Every other call (a prompt, no cache, input embeddings) is the model's own."""

    def __init__(self, model, fallback: str = "raise", max_traces: int = 16):
        self.model = model
        self.decoder = CompiledDecoder(model, fallback, max_traces)

    def __call__(self, inputs, cache=None, input_embeddings=None, **kwargs):
        if cache is not None and input_embeddings is None and not kwargs and inputs.ndim == 2 and inputs.shape[1] == 1:
            return self.decoder(inputs, cache)
        if input_embeddings is not None:
            kwargs["input_embeddings"] = input_embeddings
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        if name in ("model", "decoder"):
            raise AttributeError(name)
        return getattr(self.model, name)


def compiled_model(model, fallback: str = "raise", max_traces: int = 16) -> CompiledModel:
    """``model`` decoding through a :class:`CompiledDecoder` (see :class:`CompiledModel`)."""
    return CompiledModel(model, fallback, max_traces)
