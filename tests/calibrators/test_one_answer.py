"""One answer per distribution, for every method (issue 21, item 1).

The same distribution given as logits with any per-row constant added, or as its
probabilities, in float64 or float32, gets the same calibrated probabilities from
every method of ``calibrators.METHODS``, whichever kind it was fitted on; and so does
its ONNX graph. Params of format 1 of vector and matrix scaling (raw logits) refuse
the kind they were not fitted on, and predict for theirs what they did before.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calibrators
from calibrators.base import PARAMS_FORMAT_1
from calibrators.validation import KINDS, KindError
from tests.calibrators.helpers import onnx_outputs
from tests.oracles import softmax
from tests.strategies import same_distribution

#: The agreement the issue asks for.
ATOL = 1e-6
#: Each method's fit is the slow part: a bounded number of examples per method.
EXAMPLES = 12


@pytest.mark.parametrize("method", calibrators.METHODS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=same_distribution(), fit_kind=st.sampled_from(KINDS))
def test_every_method_gives_one_answer_per_distribution(method, case, fit_kind):
    fit_z, labels, z, shifted = case
    fit_scores = fit_z if fit_kind == "logits" else softmax(fit_z)
    cal = calibrators.create(method).fit(fit_scores, labels, kind=fit_kind)
    assert cal.kind_ == fit_kind and cal.to_params()["kind"] == fit_kind
    assert cal.input_kinds == KINDS
    reference = cal.predict_proba(z)
    representations = {
        "logits + c": (shifted, "logits"),
        "float32 logits + c": (shifted.astype(np.float32), "logits"),
        "probabilities": (softmax(shifted), "probabilities"),
        "float32 probabilities": (softmax(z).astype(np.float32), "probabilities"),
    }
    for name, (scores, kind) in representations.items():
        got = cal.predict_proba(scores, kind=kind)
        assert np.abs(got - reference).max() <= ATOL, name
    # The graph: one input, logits or the log of probabilities; the shifted logits are
    # exact in float32 (see same_distribution), so the graph sees the same distribution.
    graph = onnx_outputs(cal.to_onnx(), shifted.astype(np.float32))["probabilities"]
    assert np.abs(graph - reference).max() <= ATOL


@pytest.mark.parametrize("method", ["vector", "matrix"])
@pytest.mark.parametrize("fit_kind", KINDS)
def test_format_1_params_serve_the_kind_they_were_fitted_on_only(method, fit_kind):
    """A vector or matrix calibrator of format 1 maps the raw logits: its answer moves
    with their per-row constant. It keeps predicting what it did for the kind it was
    fitted on, and refuses the other kind, naming the one it needs."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(80, 4)) * 2
    labels = rng.integers(0, 4, 80)
    scores = z if fit_kind == "logits" else softmax(z)
    weight = rng.uniform(0.5, 2.0, 4)
    params = {"format": PARAMS_FORMAT_1, "method": method, "n_classes": 4,
              "weight": (np.diag(weight) if method == "matrix" else weight).tolist(),
              "bias": rng.normal(size=4).tolist(), "kind": fit_kind}
    cal = calibrators.from_params(params)
    assert cal.input_kinds == (fit_kind,)
    assert cal.to_params()["format"] == PARAMS_FORMAT_1  # its map, kept
    raw = np.log(np.maximum(scores, 2.0**-149)) if fit_kind == "probabilities" else scores
    expected = softmax(raw * weight + np.asarray(params["bias"]))  # the map of format 1
    np.testing.assert_allclose(cal.predict_proba(scores, kind=fit_kind), expected, atol=1e-12)
    other = "logits" if fit_kind == "probabilities" else "probabilities"
    with pytest.raises(KindError, match=f"Give {fit_kind}") as err:
        cal.predict_proba(softmax(z) if other == "probabilities" else z, kind=other)
    assert err.value.needed == fit_kind
    assert calibrators.from_params(cal.to_params()).input_kinds == (fit_kind,)
    meta = onnx_session_metadata(cal.to_onnx())
    assert meta["input_kinds"] == fit_kind and meta["kind"] == fit_kind
    # Without a recorded kind (format 1 never wrote one), both, as before.
    del params["kind"]
    assert calibrators.from_params(params).input_kinds == KINDS
    # Refitted, the same method serves both kinds (format 2).
    refit = calibrators.create(method, reg_lambda=1.0, reg_mu=1.0).fit(scores, labels,
                                                                      kind=fit_kind)
    assert refit.input_kinds == KINDS


def onnx_session_metadata(model: bytes) -> dict[str, str]:
    import onnx

    return {p.key: p.value for p in onnx.load_from_string(model).metadata_props}


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_format_1_params_of_shift_free_maps_serve_both_kinds(method):
    """Every other method's map was already one answer per distribution in format 1."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(60, 3))
    labels = rng.integers(0, 3, 60)
    params = calibrators.create(method).fit(z, labels).to_params()
    params["format"] = PARAMS_FORMAT_1
    cal = calibrators.from_params(params)
    if method in ("vector", "matrix"):
        assert cal.input_kinds == ("logits",)
    else:
        assert cal.input_kinds == KINDS
        assert cal.to_params()["format"] == calibrators.PARAMS_FORMAT


def test_a_bad_kind_in_params_is_refused():
    params = calibrators.create("temperature").fit([[0.0, 1.0], [1.0, 0.0]], [1, 0]).to_params()
    params["kind"] = "logit"
    with pytest.raises(calibrators.CalibrationInputError, match="params kind must be"):
        calibrators.from_params(params)


@pytest.mark.parametrize("method", ["vector", "matrix"])
def test_a_logit_far_below_the_rest_and_a_zero_probability_are_one_feature(method):
    """The floor: a class 150 or 1,000 below the rest as logits, and its probability
    (below 2**-149, or 0 after underflow) as probabilities, give one answer, in numpy
    and in the graph's branch that floors (the batch's spread is above 103)."""
    rng = np.random.default_rng(2)
    cal = calibrators.create(method, reg_lambda=1.0, reg_mu=1.0).fit(
        rng.normal(size=(90, 4)) * 3, rng.integers(0, 4, 90))
    z = np.round(rng.normal(size=(5, 4)) * 3 * 1024) / 1024
    z[0, 1], z[1, 2], z[2] = -1000.0, -150.0, [0.0, -120.0, -110.0, 3.0]
    p = softmax(z)
    assert p[0, 1] == 0.0 and 0.0 < p[1, 2] < 2.0**-149
    reference = cal.predict_proba(z)
    assert np.abs(cal.predict_proba(z + 37.0) - reference).max() <= ATOL
    assert np.abs(cal.predict_proba(p, kind="probabilities") - reference).max() <= ATOL
    with np.errstate(divide="ignore"):
        log_p = np.log(p.astype(np.float32))  # -inf for the zero: the graph floors it
    for fed in (z.astype(np.float32), (z + 37.0).astype(np.float32), log_p):
        graph = onnx_outputs(cal.to_onnx(), fed)["probabilities"]
        assert np.abs(graph - reference).max() <= ATOL
