"""docs/architecture.md is true to the tree: its "Every module" section names every module
of the package under the heading of the folder that holds it, and every module it names
exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlxkv"
DOC = ROOT / "docs" / "architecture.md"


def documented_modules(text: str) -> set[str]:
    """Paths named in the section: each backticked ``*.py`` of a bullet, relative to the
    folder of the ``### `mlxkv/...` `` heading above it (``toy/data.py`` under ``mlxkv/models/``)."""
    section = text.split("\n## Every module\n", 1)[1].split("\n## ", 1)[0]
    found, folder = set(), None
    for line in section.splitlines():
        heading = re.match(r"### `(mlxkv/(?:[\w/]+/)?)`", line)
        if heading:
            folder = heading.group(1)
        elif line.startswith("- ") and folder:
            found.update(folder + name for name in re.findall(r"`([\w/]+\.py)`", line))
    return found


def gathers_names_only(path: Path) -> bool:
    """A subpackage's ``__init__.py`` holding only a docstring, imports and ``__all__``."""
    if path.name != "__init__.py" or path.parent == PACKAGE:
        return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def package_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if not gathers_names_only(p)}


def test_every_package_module_is_in_the_doc():
    missing = sorted(package_modules() - documented_modules(DOC.read_text()))
    assert not missing, f"docs/architecture.md's 'Every module' does not name: {missing}"


def test_every_module_the_doc_names_exists():
    stale = sorted(m for m in documented_modules(DOC.read_text()) if not (ROOT / m).is_file())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_the_reader_sees_folders_and_lists():
    text = "\n## Every module\n\n### `mlxkv/models/`\n\n- `a.py`, `toy/b.py`: x; `c.py`: y\n\n## Next\n- `d.py`\n"
    assert documented_modules(text) == {"mlxkv/models/a.py", "mlxkv/models/toy/b.py", "mlxkv/models/c.py"}
