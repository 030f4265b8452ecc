"""calibrators.methods.prior_shift: a base calibrator's map plus class log-weights,
through numpy and ONNX Runtime, and its params."""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators import CalibrationInputError, PriorShift
from tests.calibrators.helpers import assert_onnx_matches_numpy, labelled_logits, onnx_outputs
from tests.oracles import softmax

WEIGHTS = [4.0, 0.5, 1.0, 2.0]


@pytest.fixture(params=["temperature", "vector", "dirichlet"])
def base(request):
    z, y = labelled_logits(n=80, k=4)
    return calibrators.create(request.param).fit(z, y)


def test_probabilities_are_the_base_ones_reweighted(base):
    z, _ = labelled_logits(n=30, k=4, seed=1)
    p = base.predict_proba(z)
    out = PriorShift.from_base(base, WEIGHTS).predict_proba(z)
    expected = p * WEIGHTS / (p @ WEIGHTS)[:, None]
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_onnx_adds_the_log_weights_to_the_base_graph(base):
    z, _ = labelled_logits(n=30, k=4, seed=2)
    shifted = PriorShift.from_base(base, WEIGHTS)
    z32 = z.astype(np.float32)
    out = onnx_outputs(shifted.to_onnx(), z32)["probabilities"]
    np.testing.assert_allclose(out, shifted.predict_proba(z32), atol=1e-6)


def test_the_weights_can_change_the_argmax():
    z = np.array([[1.0, 0.9, -2.0, -2.0]] * 3)
    base = calibrators.create("temperature").fit(*labelled_logits(n=80, k=4))
    shifted = PriorShift.from_base(base, [1.0, 3.0, 1.0, 1.0])
    assert (base.predict_proba(z).argmax(axis=1) == 0).all()
    assert (shifted.predict_proba(z).argmax(axis=1) == 1).all()
    assert not PriorShift.preserves_argmax


def test_params_round_trip_bit_for_bit(base):
    shifted = PriorShift.from_base(base, WEIGHTS)
    again = calibrators.from_params(shifted.to_params())
    z, _ = labelled_logits(n=20, k=4, seed=3)
    np.testing.assert_array_equal(again.predict_proba(z), shifted.predict_proba(z))
    assert again.to_params() == shifted.to_params()
    assert again.input_kinds == base.input_kinds


def test_fit_is_the_base_with_unit_weights():
    z, y = labelled_logits(n=80, k=4)
    fitted = calibrators.create("prior-shift", base="temperature").fit(z, y)
    base = calibrators.create("temperature").fit(z, y)
    np.testing.assert_allclose(fitted.predict_proba(z), base.predict_proba(z), rtol=1e-12)
    np.testing.assert_array_equal(fitted.log_weight_, 0.0)


@pytest.mark.parametrize(
    "weights", [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0], [1.0, np.inf, 1.0, 1.0]]
)
def test_bad_weights_are_refused(base, weights):
    with pytest.raises(CalibrationInputError, match="weights"):
        PriorShift.from_base(base, weights)


def test_a_prior_shift_base_and_disagreeing_params_are_refused(base):
    shifted = PriorShift.from_base(base, WEIGHTS)
    with pytest.raises(CalibrationInputError, match="multiply"):
        PriorShift.from_base(shifted, WEIGHTS)
    params = shifted.to_params()
    with pytest.raises(CalibrationInputError, match="must be one of"):
        calibrators.create("prior-shift", base="prior-shift")
    bad = {**params, "options": {"base": "matrix"}}
    with pytest.raises(CalibrationInputError, match="options base"):
        calibrators.from_params(bad)
    with pytest.raises(CalibrationInputError, match="classes"):
        calibrators.from_params({**params, "log_weight": [0.0] * 3, "n_classes": 3})


def test_identity_base_gives_the_bayes_rule_on_logits():
    """With temperature 1 the corrected probabilities are softmax(z + log w)."""
    base = calibrators.from_params(
        {"method": "temperature", "n_classes": 4, "weight": 1.0, "bias": None}
    )
    z, _ = labelled_logits(n=10, k=4, seed=4)
    shifted = PriorShift.from_base(base, WEIGHTS)
    np.testing.assert_allclose(
        shifted.predict_proba(z), softmax(z + np.log(WEIGHTS)), rtol=1e-12
    )
    assert_onnx_matches_numpy(PriorShift.from_base(base, [1.0] * 4), z.astype(np.float32))
