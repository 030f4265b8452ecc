"""The examples in the calibrators' docstrings run and say what they print.

Every module listed has examples (an empty doctest run cannot pass here), and every
other module of the package has none (a new example cannot go untested).
"""

import doctest
import importlib
import pkgutil

import pytest

import calibrators

MODULES = [
    "calibrators",
    "calibrators.base",
    "calibrators.cost",
    "calibrators.fuse",
    "calibrators.linear_softmax",
    "calibrators.numerics",
    "calibrators.onnx_export",
    "calibrators.topk",
    "calibrators.torch_export",
    "calibrators.triton",
    "calibrators.validation",
    "calibrators.evaluation.checks",
    "calibrators.evaluation.drift",
    "calibrators.evaluation.entropy",
    "calibrators.evaluation.holdout",
    "calibrators.evaluation.metrics",
    "calibrators.evaluation.pair",
    "calibrators.evaluation.shift",
    "calibrators.methods._structured",
    "calibrators.methods.ets",
    "calibrators.methods.iop",
    "calibrators.methods.matrix",
    "calibrators.methods.prior_shift",
    "calibrators.methods.pts",
    "calibrators.methods.row_entropy",
    "calibrators.methods.sms",
    "calibrators.methods.svs",
    "calibrators.methods.temperature",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(module) -> int:
    return sum(len(test.examples) for test in doctest.DocTestFinder().find(module))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS)
    assert result.attempted > 0, f"{name} has no examples: give it one or unlist it"
    assert result.failed == 0


def test_the_list_names_every_module_with_examples():
    package = ["calibrators"] + [
        info.name for info in pkgutil.walk_packages(calibrators.__path__, "calibrators.")
    ]
    unlisted = [name for name in package if name not in MODULES]
    with_examples = [name for name in unlisted if _examples(importlib.import_module(name))]
    assert with_examples == []
    assert set(MODULES) <= set(package)
