"""The compiled decode step of every family: ``decode_step(cache)`` and ``decode_phase(cache)``.

Each builder reads a cache's integers and arrays and changes nothing; the commit, after the
step, writes (docs/compiled.md). Which builder a cache gets is its family's
(``mlxkv.families``); a family without one raises :class:`~mlxkv.errors.UnknownKindError`.

Phases:

- plain, affine, TurboQuant: ``window`` over the cache's buffer (TurboQuant: its codes) as
  the append grows it (256-row steps), so a trace serves 256 consecutive steps;
- eviction caches: ``window`` over the kept rows plus the new one, rounded up to 256 and
  capped at ``budget + 1``: once the budget is reached the window no longer changes;
- rings: ``ring-fill`` over the ring's buffer (it grows in 256-row steps up to
  ``max_size``), then ``ring-wrapped`` over the whole ring, written at a traced row;
- recurrent state: ``recurrent``, its arrays in and out;
- an empty cache's first append fixes its geometry and runs eagerly (``eager``).
"""

import copy

import mlx.core as mx

from ..errors import UnknownKindError
from ..families import kind_of, step_builder
from .decode_step import (
    AffineStore,
    DecodeStep,
    EagerLayout,
    Phase,
    PlainStore,
    RecurrentLayout,
    RingLayout,
    TurboStore,
    WindowLayout,
)
from .transition import Bf16FirstCache

STEP = 256


def window_rows(n: int) -> int:
    """The rows a linear window holding ``n`` positions attends: ``n`` rounded up to 256."""
    return -(-n // STEP) * STEP


def _fit(a: mx.array, rows: int) -> mx.array:
    """``a`` [B, H, T, X] with exactly ``rows`` rows on axis 2: itself, a view when it holds
    more, zero rows added when it holds fewer."""
    have = a.shape[2]
    if have == rows:
        return a  # the cache's own buffer: the step may write it in place
    if have > rows:
        return a[..., :rows, :]
    return mx.concatenate([a, mx.zeros((*a.shape[:2], rows - have, a.shape[3]), a.dtype)], axis=2)


def _grown(arrays: list, offset: int) -> list:
    """The buffers mlx-lm's ``KVCache``/``QuantizedKVCache`` write one new position into:
    unchanged while there is room, else cut to ``offset`` (when it is not a whole number of
    steps) and grown by one 256-row step, as their ``update_and_fetch`` does."""
    if offset + 1 <= arrays[0].shape[2]:
        return arrays
    cut = [a[..., :offset, :] if offset % STEP else a for a in arrays]
    return [mx.concatenate([a, mx.zeros((*a.shape[:2], STEP, a.shape[3]), a.dtype)], axis=2) for a in cut]


def _positions(offset: int, write_at: int):
    return mx.array(offset, mx.int32), mx.array([write_at], mx.int32)


def _append_commit(cache):
    """Append the step's new keys and values through the cache's own ``update_and_fetch``."""
    return lambda new, effects: cache.update_and_fetch(new[0], new[1])


def _eager(cache) -> DecodeStep:
    return DecodeStep(EagerLayout(Phase(kind_of(cache), "eager")), (), None)


def _window_step(cache, store, stored: list, rows: int, write_at: int, commit, gapped: bool = False) -> DecodeStep:
    layout = WindowLayout(Phase(cache.kind, "window", rows), store, gapped)
    arrays = (*_positions(cache.offset, write_at), *(_fit(a, rows) for a in stored))
    return DecodeStep(layout, arrays, commit)


# -- one builder per family --------------------------------------------------------------


def plain_decode_step(cache) -> DecodeStep:
    """The buffer itself (grown as the append grows it) is the window; the cache adopts the
    written buffer."""
    if cache.keys is None:
        return _eager(cache)
    n = cache.offset
    keys, values = _grown([cache.keys, cache.values], n)

    def commit(new, effects):
        cache.keys, cache.values = new[2], new[3]
        cache.offset = n + 1

    return _window_step(cache, PlainStore(), [keys, values], keys.shape[2], n, commit)


def affine_decode_step(cache) -> DecodeStep:
    """As the plain step, over mlx-lm's affine triples."""
    if cache.keys is None:
        return _eager(cache)
    n = cache.offset
    stored = _grown([*cache.keys, *cache.values], n)

    def commit(new, effects):
        cache.keys, cache.values = tuple(new[2:5]), tuple(new[5:8])
        cache.offset = n + 1

    store = AffineStore(cache.bits, cache.group_size)
    return _window_step(cache, store, stored, stored[0].shape[2], n, commit)


def turbo_decode_step(cache) -> DecodeStep:
    """The codes at the capacity the cache's own append leaves (256-row steps), attended as
    the cache reads. Read as codes, the cache adopts the code arrays the step wrote (the new
    position encoded once, in the graph); decoded in the graph, the commit encodes and stores
    the new position through the cache's append."""
    if cache.storage is None:
        return _eager(cache)
    n = cache.offset
    store = TurboStore(cache.k_bits, cache.v_bits, cache.codes)
    stored, rows = list(cache.storage), cache.capacity_for(1)
    if not cache.codes:
        return _window_step(cache, store, stored, rows, n, _append_commit(cache))

    def commit(new, effects):
        cache.dtype = new[0].dtype
        cache.storage, cache.offset = list(new[2:]), n + 1  # the five written code arrays

    return _window_step(cache, store, stored, rows, n, commit)


def eviction_decode_step(cache) -> DecodeStep:
    """Kept rows plus the new one; eviction happens in the commit (the cache's append)."""
    if cache.keys is None:
        return _eager(cache)
    kept = cache.rows
    rows = window_rows(kept + 1)
    if kept <= cache.budget:  # (a Q-Filters cache may hold more until it calibrates)
        rows = min(rows, cache.budget + 1)
    stored = [cache.keys, cache.values]
    return _window_step(cache, PlainStore(), stored, rows, kept, _append_commit(cache), gapped=True)


def ring_decode_step(cache) -> DecodeStep:
    """The ring's buffer as the append leaves it before writing (grown, trimmed, wrapped:
    ``_write_plan``); the ring adopts the written buffer."""
    if cache.keys is None:
        return _eager(cache)
    one = lambda x: tuple(a[..., :1, :] for a in x) if isinstance(x, tuple) else x[..., :1, :]
    keys, values, idx = cache._write_plan(one(cache.keys), one(cache.values), 1)
    quantized = isinstance(keys, tuple)
    flat = lambda x: list(x) if quantized else [x]
    keys, values = flat(keys), flat(values)
    name = "ring-fill" if cache.offset < cache.max_size else "ring-wrapped"
    store = AffineStore(cache.bits, cache.group_size) if quantized else PlainStore()
    layout = RingLayout(Phase(cache.kind, name, keys[0].shape[2]), store, cache.max_size)
    roll = (cache._idx if cache._idx < cache.max_size else 0) + 1  # mlx-lm's mask shift
    arrays = (*_positions(cache.offset, idx), mx.array(roll, mx.int32), *keys, *values)
    w = store.width

    def commit(new, effects):
        k, v = new[2 : 2 + w], new[2 + w : 2 + 2 * w]
        cache._written(tuple(k) if quantized else k[0], tuple(v) if quantized else v[0], idx, 1)

    return DecodeStep(layout, arrays, commit)


def recurrent_decode_step(cache) -> DecodeStep:
    """The state arrays in and out (a serial ``ssm`` cache or its batch). Left padding enters
    as a traced array (the model's mask reads it; the commit's ``advance`` moves it); a
    padded prefill in progress (``lengths`` set) is a prefill step and runs eagerly."""
    if cache.lengths is not None or all(a is None for a in cache.cache):
        return _eager(cache)
    present = tuple(a is not None for a in cache.cache)
    padded = cache.left_padding is not None
    layout = RecurrentLayout(Phase(cache.kind, "recurrent"), present, padded)

    def commit(new, effects):
        after, advanced = effects
        it = iter(new)
        for i, p in enumerate(after):
            cache[i] = next(it) if p else cache[i]
        cache.advance(advanced)

    state = tuple(a for a in cache.cache if a is not None)
    return DecodeStep(layout, (*state, cache.left_padding) if padded else state, commit)


# -- dispatch --------------------------------------------------------------------------------


def _family_step(cache) -> DecodeStep:
    kind = kind_of(cache)
    build = step_builder(kind)
    if build is None:
        raise UnknownKindError(kind, "no compiled decode step for this kind")
    return build(cache)


def decode_step(cache) -> DecodeStep:
    """``cache``'s part in one compiled decode step. A bf16-first cache whose conversion is due
    (a file written before conversions happened at the end of the append) converts first;
    until it has converted, its commit is its own append, so it converts whenever its own rule
    says; once converted, the held storage's step commits as it does alone."""
    if isinstance(cache, Bf16FirstCache):
        cache.settle()
        step = _family_step(cache.inner)
        if not cache.converted and step.commit is not None:
            step.commit = _append_commit(cache)  # its append converts when its rule says
        return step
    return _family_step(cache)


def decode_phase(cache) -> Phase:
    """The phase the next decode step of ``cache`` takes, without changing the cache (a
    bf16-first cache whose conversion is due is predicted on a converted copy)."""
    if isinstance(cache, Bf16FirstCache):
        p, inner = cache.pending, cache.inner
        due = not cache.converted and p.due(inner.offset)
        cache = p.apply(copy.deepcopy(inner)) if due else inner
    return _family_step(cache).phase
