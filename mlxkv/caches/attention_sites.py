"""What a model's attention does with the window its cache returns, read off its source.

A TurboQuant cache in codes mode returns its codes as a ``CodesWindow`` (not an array), and
only mlx-lm's ``scaled_dot_product_attention(queries, keys, values, cache, ...)`` knows to
hand it back to the cache (``mlxkv.caches.routed_reads``). A model whose attention touches
the window otherwise (``keys.astype``, ``mx.tile(keys, ...)``, ``mx.fast``'s kernel called
directly, the window returned for other layers to share) or passes attention sinks (which
mlx-lm's quantized route refuses) needs the decoded window.

:func:`window_reader` decides from the model's own code, not from a list of architectures:
every function of the model's module classes (and every module-level function of their
modules) that calls ``update_and_fetch`` is parsed, and the names that call binds must
reach nothing but mlx-lm's SDPA, as its keys and values, with the cache and without
sinks. Anything else, or a site whose source cannot be read, is named as the reason. The
rule is conservative: a model it cannot prove attends the window untouched reads the decoded
window, which is exact (``codes=False``), never a wrong or failing read.
"""

import ast
import functools
import inspect
import sys
import textwrap

import mlx.nn as nn
from mlx_lm.models import base as mlx_base

#: mlx-lm's SDPA's parameters after queries, keys, values: where ``cache`` and ``sinks`` sit
_SDPA_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")


def _resolve(node, names: dict):
    """The object an expression of names and attributes denotes in a module's globals."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, names)
        return None if owner is None else getattr(owner, node.attr, None)
    return None


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _routed_call(call: ast.Call, names: dict) -> bool:
    """``call`` is mlx-lm's SDPA given a cache and no sinks."""
    if _resolve(call.func, names) is not mlx_base.scaled_dot_product_attention:
        return False
    given = dict(zip(_SDPA_PARAMS, call.args))
    given.update({k.arg: k.value for k in call.keywords if k.arg is not None})
    if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
        return False  # **kwargs or *args: what they hold is not visible
    return "cache" in given and not _is_none(given["cache"]) and _is_none(given.get("sinks", ast.Constant(None)))


def _window_names(node: ast.Assign):
    """The names ``a, b = <x>.update_and_fetch(...)`` binds, or None when it is no such call
    or binds something else (one name, a subscript)."""
    value = node.value
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return None
    if value.func.attr != "update_and_fetch":
        return None
    target = node.targets[0] if len(node.targets) == 1 else None
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        return {e.id for e in target.elts if e.id != "_"}
    return ()


def _function_reads(fn, names: dict, where: str, offset: int):
    """The first use of the window in ``fn`` other than as mlx-lm's SDPA's keys or values
    (a reason naming its file line: the parsed line plus ``offset``), or None when every
    use is that."""
    sites = [(n, _window_names(n)) for n in ast.walk(fn) if isinstance(n, ast.Assign)]
    routed_args = set()
    for call in ast.walk(fn):
        if isinstance(call, ast.Call) and _routed_call(call, names):
            routed_args.update(id(a) for a in call.args[1:3])
            routed_args.update(id(k.value) for k in call.keywords if k.arg in ("keys", "values"))
    branches = [
        ({id(n) for b in node.body for n in ast.walk(b)}, {id(n) for b in node.orelse for n in ast.walk(b)})
        for node in ast.walk(fn)
        if isinstance(node, ast.If)
    ]
    for assign, window in sites:
        if window is None:
            continue
        line = f"{where} (line {assign.lineno + offset})"
        if not window:
            return f"{line}: update_and_fetch's result is not unpacked to names"
        after = (assign.end_lineno, assign.end_col_offset)
        for use in ast.walk(fn):
            if not (isinstance(use, ast.Name) and use.id in window and isinstance(use.ctx, ast.Load)):
                continue
            if (use.lineno, use.col_offset) < after or id(use) in routed_args:
                continue
            if any({id(assign), id(use)} <= (a | b) and (id(assign) in a) != (id(use) in a) for a, b in branches):
                continue  # the other branch of an if that fetched: not reached from the fetch
            return (
                f"{line}: the window {use.id!r} is used at line {use.lineno + offset} "
                "other than as mlx-lm's scaled_dot_product_attention's keys or values with the cache, without sinks"
            )
    return None


def _fetching(tree) -> list:
    """The functions in ``tree`` that call ``update_and_fetch``."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(a, ast.Attribute) and a.attr == "update_and_fetch" for a in ast.walk(n))
    ]


@functools.cache
def _source_reads(owner) -> str | None:
    """The reason the window is read as arrays in ``owner`` (a class or a module), or None."""
    module = owner if inspect.ismodule(owner) else sys.modules.get(owner.__module__)
    names = vars(module) if module is not None else {}
    label = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
    try:
        lines, first = inspect.getsourcelines(owner)
    except (OSError, TypeError):
        return f"{label}: its source cannot be read"
    tree = ast.parse(textwrap.dedent("".join(lines)))
    if inspect.ismodule(owner):  # its module-level functions (classes are read as classes)
        tree = ast.Module([n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))], [])
    for fn in _fetching(tree):
        reason = _function_reads(fn, names, f"{label}.{fn.name}", max(first, 1) - 1)
        if reason:
            return reason
    return None


def _module_classes(model) -> set[type]:
    """The classes of ``model`` and of every module under it. A prompt store asks at every
    hit; ``nn.Module.modules()`` visits every array too, 2 ms on SmolLM2 against 0.2."""
    found, stack = set(), [model]
    while stack:
        v = stack.pop()
        if isinstance(v, nn.Module):
            found.add(type(v))
            stack.extend(v.values())
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return found or {type(model)}


def window_reader(model) -> str | None:
    """Why ``model``'s attention needs the decoded window (the first site found), or None
    when every site that fetches from a cache hands the window straight to mlx-lm's SDPA."""
    for cls in sorted(_module_classes(model), key=lambda c: (c.__module__, c.__qualname__)):
        for owner in cls.__mro__:
            if owner.__module__.startswith(("mlx.nn", "builtins")):
                continue
            module = sys.modules.get(owner.__module__)
            reason = _source_reads(owner) or (_source_reads(module) if module is not None else None)
            if reason:
                return reason
    return None
