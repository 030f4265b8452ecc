"""A new kind of calibrator is one class, its registration and its row of test options.

:class:`RowTemperature` is not of the ``softmax(W * phi(z) + b)`` form: each row gets
its own inverse temperature ``beta(z) = c / (1 + spread(z))`` with ``spread = max z -
mean z`` and one fitted number ``c > 0``. It implements only ``__init__``, ``_fit``,
``_forward`` and ``_onnx_forward`` (plus the class-level declarations), and gets
validation, predict_proba, the params round trip, ONNX export and the estimator
contract from :class:`calibrators.base.Calibrator`.
"""

from __future__ import annotations

import json
from typing import ClassVar

import numpy as np
import pytest

import calibrators
from calibrators.base import Calibrator
from calibrators.numerics import log_softmax
from calibrators.options import Integer
from calibrators.validation import logits64
from tests.calibrators.helpers import (
    assert_estimator_contract,
    labelled_logits,
    onnx_outputs,
)


class RowTemperature(Calibrator):
    """``softmax(beta(z) * z)`` with ``beta(z) = scale_ / (1 + max z - mean z)``, per row."""

    method = "row_temperature"
    preserves_argmax = True  # beta(z) > 0 for every row
    option_checks: ClassVar[dict] = {"n_grid": Integer(minimum=2)}
    fitted_arrays: ClassVar[dict] = {"scale": ()}

    def __init__(self, *, n_grid: int = 81):
        self.n_grid = n_grid

    @staticmethod
    def _rows(z, scale):
        spread = z.max(axis=1, keepdims=True) - z.mean(axis=1, keepdims=True)
        return z * (scale / (1.0 + spread))

    def _fit(self, x, y, *, kind, options, progress):
        z = logits64(x, kind)
        scales = np.geomspace(1e-2, 1e2, options["n_grid"])
        nll = [-log_softmax(self._rows(z, c))[np.arange(len(y)), y].mean() for c in scales]
        best = int(np.argmin(nll))
        self.scale_ = float(scales[best])
        return {"nll": float(nll[best])}

    def _forward(self, z):
        return self._rows(z, self.scale_)

    def _onnx_forward(self, graph, z):
        top = graph.node("ReduceMax", [z], "row_max", axes=[1], keepdims=1)
        mean = graph.node("ReduceMean", [z], "row_mean", axes=[1], keepdims=1)
        spread = graph.node("Sub", [top, mean], "spread")
        denominator = graph.node("Add", [spread, graph.constant(1.0, "one")], "denominator")
        beta = graph.node("Div", [graph.constant(self.scale_, "scale"), denominator], "beta")
        return graph.node("Mul", [z, beta], "u")


@pytest.fixture
def registered(monkeypatch):
    """RowTemperature in the registry, as its one registration line would put it."""
    monkeypatch.setitem(calibrators.CALIBRATORS, RowTemperature.method, RowTemperature)
    return RowTemperature


def test_only_the_hooks_are_implemented():
    own = {name for name, value in vars(RowTemperature).items() if callable(value)}
    assert own <= {"__init__", "_fit", "_forward", "_onnx_forward", "_rows"}


def test_estimator_contract():
    z, y = labelled_logits(n=60, k=4)
    assert_estimator_contract(RowTemperature, {"n_grid": 41}, z, y)


def test_predict_proba_params_round_trip_and_onnx(registered):
    z, y = labelled_logits(n=120, k=5, seed=3)
    cal = calibrators.create("row_temperature", n_grid=41).fit(z[:90], y[:90])
    assert 1e-2 < cal.scale_ < 1e2 and cal.fit_info_["nll"] > 0

    test = z[90:]  # N = 30, K = 5
    p = cal.predict_proba(test)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(p.argmax(axis=1), test.argmax(axis=1))
    spread = test.max(axis=1, keepdims=True) - test.mean(axis=1, keepdims=True)
    u = test * cal.scale_ / (1 + spread)
    np.testing.assert_allclose(p, np.exp(u - np.log(np.exp(u).sum(axis=1, keepdims=True))),
                               rtol=1e-12)
    # probabilities in: the same numbers as their log
    q = cal.predict_proba(np.exp(log_softmax(test)), kind="probabilities")
    np.testing.assert_allclose(q, cal.predict_proba(log_softmax(test)), atol=1e-12)

    params = json.loads(json.dumps(cal.to_params(), allow_nan=False))
    assert set(params) == {"format", "method", "n_classes", "kind", "options", "scale",
                           "fit_info"}
    assert params["options"] == {"n_grid": 41} and params["scale"] == cal.scale_
    again = calibrators.from_params(params)
    assert type(again) is RowTemperature
    np.testing.assert_array_equal(again.predict_proba(test), p)
    with pytest.raises(calibrators.CalibrationInputError, match="keys method, n_classes, scale"):
        calibrators.from_params({k: v for k, v in params.items() if k != "scale"})

    z32 = test.astype(np.float32)
    out = onnx_outputs(cal.to_onnx(), z32)
    want = cal.predict_proba(z32)
    np.testing.assert_allclose(out["probabilities"], want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["confidence"], want.max(axis=1), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out["label"], want.argmax(axis=1))
    entropy = -(want * np.log(want)).sum(axis=1)
    np.testing.assert_allclose(out["entropy"], entropy, rtol=0, atol=1e-6)
