"""The examples in the service's docstrings run and say what they print (the
calibrators' have their own test, tests/calibrators/test_docstrings.py)."""

import doctest
import importlib
import pkgutil

import pytest

import service


def _modules_with_examples() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(service.__path__, "service.")
        if not info.name.startswith("service.migrations")
    ]
    finder = doctest.DocTestFinder()
    return [
        name
        for name in names
        if any(test.examples for test in finder.find(importlib.import_module(name)))
    ]


MODULES = _modules_with_examples()


def test_some_modules_have_examples():
    assert "service.api.codecs.json_body" in MODULES and "service.serving.inference" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(importlib.import_module(name), optionflags=flags)
    assert result.attempted > 0 and result.failed == 0
