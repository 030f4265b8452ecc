"""The examples in the calibrators' docstrings run and say what they print."""

import doctest
import importlib

import pytest

MODULES = [
    "calibrators",
    "calibrators.base",
    "calibrators.holdout",
    "calibrators.temperature",
    "calibrators.linear",
    "calibrators.onnx_export",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
