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


# -- tests/ mirrors the code ---------------------------------------------------------
#: A test module in tests/<top>/<package>/ tests that package: it imports from
#: ``<top>.<package>`` or its docstring names it (``<top>.<package>`` or
#: ``<top>/<package>/``). Tests of several packages, of the whole service (the CLI,
#: processes, end to end) and of the test helpers stay at tests/<top>/ itself.
MIRRORED = ("calibrators", "service")
TESTS = ROOT / "tests"
MIRRORED_TESTS = sorted(
    p for top in MIRRORED for p in (TESTS / top).glob("*/test_*.py")
)


def names_package(source: str, package: str) -> bool:
    """Whether a module imports from ``package`` or its docstring names it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        if any(m == package or m.startswith(package + ".") for m in modules):
            return True
    doc = ast.get_docstring(tree) or ""
    return package in doc or package.replace(".", "/") + "/" in doc


def test_the_mirror_checker_reads_imports_and_docstrings():
    assert names_package("from service.storage import db\n", "service.storage")
    assert names_package("import service.storage.db\n", "service.storage")
    assert names_package('"""The cache (service/storage/array_cache.py)."""\n', "service.storage")
    assert not names_package("from service.api.app import create_app\n", "service.storage")
    assert not names_package("from service.storages import x\n", "service.storage")


@pytest.mark.parametrize("top", MIRRORED)
def test_every_test_folder_mirrors_a_code_package(top):
    folders = {p.name for p in (TESTS / top).iterdir() if any(p.glob("test_*.py"))}
    packages = {p.parent.name for p in (ROOT / top).glob("*/__init__.py")}
    assert folders <= packages, folders - packages


@pytest.mark.parametrize("path", MIRRORED_TESTS, ids=lambda p: str(p.relative_to(TESTS)))
def test_every_test_module_names_the_package_its_folder_mirrors(path):
    package = ".".join(path.relative_to(TESTS).parts[:2])
    assert names_package(path.read_text(), package), f"{path.name} never names {package}"


# -- one softmax ---------------------------------------------------------------------
def defines(source: str, names: set[str]) -> list[str]:
    """The functions of ``names`` a module defines, at any depth."""
    return [
        f"line {node.lineno}: {node.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names
    ]


SOFTMAXES = {"softmax", "_softmax", "log_softmax", "_log_softmax"}


def test_the_softmax_checker_finds_nested_definitions():
    code = "def softmax(z):\n    def _softmax(u):\n        pass\n"
    assert defines(code, SOFTMAXES) == ["line 1: softmax", "line 2: _softmax"]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in TESTS.rglob("*.py") if p.name != "oracles.py"),
    ids=lambda p: str(p.relative_to(TESTS)),
)
def test_no_test_module_defines_its_own_softmax(path):
    """The oracle is tests/oracles.py (or scipy.special); a pasted copy drifts."""
    assert defines(path.read_text(), SOFTMAXES) == []
