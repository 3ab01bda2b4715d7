"""Imports only go down the layers (README "Layout"): every ``import`` in the package,
including the ones inside functions, names a module of the same layer or a lower one."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlxkv"

# lowest first; a module belongs to the layer of the longest prefix its dotted name starts with
LAYERS = [
    ("foundation", ("mlxkv.errors", "mlxkv.checks", "mlxkv.families")),
    ("models", ("mlxkv.models",)),
    ("math", ("mlxkv.math",)),
    ("live caches", ("mlxkv.caches",)),
    ("batched layouts", ("mlxkv.batched",)),
    ("codecs", ("mlxkv.codecs",)),
    ("kind records", ("mlxkv.kinds",)),
    ("file I/O", ("mlxkv.io",)),
    ("state", ("mlxkv.state",)),
    ("file formats", ("mlxkv.formats",)),
    ("sessions", ("mlxkv.session",)),
    ("prompt store", ("mlxkv.store",)),
    ("command line and server", ("mlxkv.cli", "mlxkv.serve", "mlxkv")),
]


def layer_of(module: str) -> int:
    found = [
        (len(p), rank)
        for rank, (_, prefixes) in enumerate(LAYERS)
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    if not found:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return max(found)[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path):
    """(line, imported module) for every import of an mlxkv module in ``path``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mlxkv":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mlxkv":
                continue
            for alias in node.names:  # `from ..math import turboquant` imports mlxkv.math.turboquant
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                yield node.lineno, sub if is_module else target


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_only_go_down(path):
    importer = module_name(path)
    rank = layer_of(importer)
    upward = [
        f"line {line}: {target} ({LAYERS[layer_of(target)][0]})"
        for line, target in imports_of(path)
        if layer_of(target) > rank
    ]
    assert not upward, f"{importer} ({LAYERS[rank][0]}) imports upward: " + "; ".join(upward)


def test_the_walk_sees_relative_and_function_level_imports(tmp_path):
    """The checker itself: an upward import inside a function is found."""
    found = {t: n for n, t in imports_of(PACKAGE / "codecs" / "plain.py")}
    assert "mlxkv.caches.plain" in found  # `from ..caches.plain import KVCache`, inside a method
    assert layer_of("mlxkv.formats.mlxkv") > layer_of("mlxkv.caches.base")
    assert layer_of("mlxkv.store.store") > layer_of("mlxkv.session") > layer_of("mlxkv.state.identity")


def import_graph() -> dict[str, set[str]]:
    """Every package module -> the package modules it imports (function-level imports too)."""
    names = {module_name(p) for p in MODULES}
    graph = {}
    for path in MODULES:
        me = module_name(path)
        graph[me] = {t for _, t in imports_of(path) if t in names and t != me}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    """Within a folder as across folders, no module reaches itself through imports: a
    reader can take the package bottom-up, one module at a time."""
    assert import_circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
