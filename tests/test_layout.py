"""The layout's rules that ruff and the import contracts do not check: no module
reaches into another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p for package in ("calibrators", "service") for p in (ROOT / package).rglob("*.py")
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[str]:
    """``from m import _x`` and ``m._x`` where ``m`` is an imported module or name."""
    tree = ast.parse(source)
    imported: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                imported.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_the_checker_finds_private_names():
    code = "import numpy as np\nfrom a import _b\nfrom c import d\nx = d._e\ny = np.__version__\n"
    assert private_uses(code) == ["line 2: from a import _b", "line 4: d._e"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path):
    assert private_uses(path.read_text()) == []
