"""Every on-disk name of a checkpoint is defined once, in ``resilience/checkpoint/layout.py``.

The layout's docstring draws the whole tree and names each constant; no other module of the
package spells one of those names as a string constant of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

from resilience.checkpoint import layout

PACKAGE = Path(layout.__file__).resolve().parents[1]
NAMES = {name: value for name, value in vars(layout).items() if name.isupper() and isinstance(value, str) and len(value) > 1}
# File names, markers and pointers; a plain directory name (model, rng, ...) also labels a save's part.
FILE_NAMES = {value for value in NAMES.values() if not value.isalpha() or value.isupper()}


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """``(line, value)`` of every string constant in ``path`` outside docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_module_but_layout_spells_an_on_disk_name():
    spelled = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "layout.py"
        for line, value in _string_constants(path)
        if value in FILE_NAMES
    ]
    assert not spelled, "on-disk names spelled outside checkpoint/layout.py:\n" + "\n".join(spelled)


def test_the_layout_docstring_names_every_constant():
    missing = [name for name in NAMES if name not in layout.__doc__]
    assert not missing, f"layout.py's tree does not show {missing}"
