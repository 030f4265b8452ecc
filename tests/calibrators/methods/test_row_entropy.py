"""Entropy targets without labels: temperature's ``target_entropy`` fitted on scores
alone, and ``calibrators.methods.row_entropy`` (a temperature per row): every row's
entropy on the target to 1e-9 nats after the fixed number of steps, the order of every
row kept, ONNX and torch on the numpy path, and the two facts the method rests on
(entropy falls with beta; tempering is the KL projection onto an entropy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

import calibrators
from calibrators.methods import row_entropy
from calibrators.methods.row_entropy import RowEntropyTemperature, row_temperatures
from tests.calibrators.helpers import assert_onnx_matches_numpy, assert_order_kept, onnx_outputs
from tests.oracles import softmax
from tests.strategies import logits_and_labels

TOLERANCE = 1e-9  # nats


def entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=-1)


@st.composite
def rows_and_targets(draw):
    """Logits (N, K) of a drawn profile and a reachable target per row.

    Profiles: Gaussian rows of scale 1e-6 to 1e3, heavy-tailed (Cauchy) rows, the top
    two classes 1e-12 to 1e-1 (relative) apart, log-probabilities of a Dirichlet draw
    (zeros floored); targets anywhere in (0, log K), within 1e-12 of log K, or down to
    1e-9 nats.
    """
    k = draw(st.sampled_from([2, 3, 5, 50, 1000]))
    n = draw(st.integers(1, 30).filter(lambda n: n != k))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = 10.0 ** draw(st.floats(-6, 3))
    profile = draw(st.sampled_from(["normal", "cauchy", "near-tie", "dirichlet"]))
    if profile == "cauchy":
        z = rng.standard_cauchy((n, k)) * scale
    elif profile == "dirichlet":
        alpha = 10.0 ** draw(st.floats(-2, 1))
        z = np.log(np.maximum(rng.dirichlet(np.full(k, alpha), n), 2.0**-149))
    else:
        z = rng.normal(size=(n, k)) * scale
    if profile == "near-tie":
        top = z.argmax(axis=1)
        other = (top + 1) % k
        gap = 10.0 ** draw(st.floats(-12, -1)) * np.abs(z).max(axis=1)
        z[np.arange(n), other] = z[np.arange(n), top] - gap
    where = draw(st.sampled_from(["anywhere", "near-log-k", "near-zero"]))
    if where == "near-log-k":
        target = math.log(k) - 10.0 ** rng.uniform(-12, -1, n)
    elif where == "near-zero":
        target = 10.0 ** rng.uniform(-9, -1, n)
    else:
        target = rng.uniform(0.01, 0.99, n) * math.log(k)
    ties = np.count_nonzero(z == z.max(axis=1, keepdims=True), axis=1)
    target = np.maximum(target, np.log(ties) + 1e-3)  # reachable
    return z, np.minimum(target, math.log(k) * (1 - 1e-15))


@settings(max_examples=150)
@given(data=rows_and_targets())
def test_every_row_reaches_its_target_within_the_fixed_steps(data):
    z, target = data
    u = row_entropy.row_tempered_logits(z, target)
    assert np.abs(entropy(softmax(u)) - target).max() <= TOLERANCE
    assert_order_kept(z, u)


@settings(max_examples=40)
@given(data=rows_and_targets())
def test_the_temperatures_are_those_of_the_rows_as_given(data):
    z, target = data
    temperature = row_temperatures(z, target)
    assert np.all(temperature > 0)
    p = softmax((z - z.max(axis=1, keepdims=True)) / temperature[:, None])
    assert np.abs(entropy(p) - target).max() <= 1e-8  # (c / T rounds where beta * x did not)


def test_the_calibrator_serves_one_target_for_every_row_and_keeps_the_argmax():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(300, 7)) * 3
    cal = calibrators.create("row-entropy", target_entropy=1.1).fit(z)
    p = cal.predict_proba(rng.normal(size=(50, 7)) * 5)
    assert np.abs(entropy(p) - 1.1).max() <= TOLERANCE
    assert cal.fit_info_["max_error"] <= TOLERANCE and cal.fit_info_["unreachable_rows"] == 0
    q = cal.predict_proba(softmax(z), kind="probabilities")
    np.testing.assert_array_equal(q.argmax(axis=1), z.argmax(axis=1))


def test_without_a_target_the_fit_takes_the_rows_mean_entropy():
    z = np.random.default_rng(1).normal(size=(200, 5)) * 2
    cal = RowEntropyTemperature().fit(z)
    assert cal.target_ == pytest.approx(entropy(softmax(z)).mean(), abs=1e-12)
    assert np.abs(entropy(cal.predict_proba(z)) - cal.target_).max() <= TOLERANCE


def test_rows_that_cannot_reach_the_target_end_uniform_over_their_tied_top():
    z = np.array([[1.0, 1.0, 0.0, -2.0], [0.5, 0.5, 0.5, 0.5], [3.0, 0.0, 1.0, 2.0]])
    cal = RowEntropyTemperature(target_entropy=0.3).fit(z)
    p = cal.predict_proba(z)
    np.testing.assert_allclose(p[0], [0.5, 0.5, 0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(p[1], 0.25)
    assert abs(entropy(p[2]) - 0.3) <= TOLERANCE
    assert cal.fit_info_["unreachable_rows"] == 2


def test_a_target_outside_zero_to_log_k_is_refused():
    z = np.random.default_rng(2).normal(size=(10, 3))
    for target in (math.log(3), 5.0):
        with pytest.raises(calibrators.CalibrationInputError, match="log K"):
            RowEntropyTemperature(target_entropy=target).fit(z)
    with pytest.raises(calibrators.CalibrationInputError, match="target"):
        calibrators.from_params({"method": "row-entropy", "n_classes": 3, "target": 1.2})


@pytest.mark.parametrize("k", [3, 40])
def test_onnx_runs_the_same_steps(k):
    rng = np.random.default_rng(k)
    z = (rng.normal(size=(64, k)) * rng.uniform(0.01, 20, (64, 1))).astype(np.float32)
    z[0] = 0.0  # a constant row
    z[1, :2] = z[1].max() + 1.0  # a tie at the top
    cal = RowEntropyTemperature(target_entropy=0.4 * math.log(k)).fit(z)
    assert_onnx_matches_numpy(cal, z)
    out = onnx_outputs(cal.to_onnx(), z)
    assert np.abs(out["entropy"][2:] - cal.target_).max() <= 1e-6  # float32 outputs


def test_torch_runs_the_same_steps():
    torch = pytest.importorskip("torch")
    from calibrators.torch_export import to_torch

    z = np.random.default_rng(3).normal(size=(40, 6)) * 4
    cal = RowEntropyTemperature(target_entropy=0.9).fit(z)
    module = to_torch(cal, dtype=torch.float64)
    p = module(torch.from_numpy(z))[0].numpy()
    np.testing.assert_allclose(p, cal.predict_proba(z), atol=1e-12)


# -- temperature's target entropy without labels -----------------------------------------
def test_temperature_with_a_target_entropy_needs_no_labels():
    z = np.random.default_rng(4).normal(size=(20_000, 9)) * 3
    cal = calibrators.create("temperature", target_entropy=1.3).fit(z)
    assert abs(entropy(cal.predict_proba(z)).mean() - 1.3) <= TOLERANCE
    assert cal.fit_info_["nll"] is None
    labelled = calibrators.create("temperature", target_entropy=1.3).fit(z, z.argmax(axis=1))
    assert labelled.beta_ == pytest.approx(cal.beta_, rel=1e-12)


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_methods_that_learn_from_labels_refuse_a_fit_without_them(method):
    cls = calibrators.CALIBRATORS[method]
    z = np.random.default_rng(5).normal(size=(30, 4))
    if not cls.needs_labels(cls().checked_options()):
        cls().fit(z)
        return
    with pytest.raises(calibrators.CalibrationInputError, match="Got no labels"):
        cls().fit(z)


# -- the facts the method rests on -------------------------------------------------------
@given(data=logits_and_labels(max_classes=8, max_magnitude=30.0),
       betas=st.tuples(st.floats(0.01, 50.0), st.floats(0.01, 50.0)))
def test_entropy_is_non_increasing_in_beta(data, betas):
    z, _ = data
    small, large = sorted(betas)
    assert np.all(entropy(softmax(large * z)) <= entropy(softmax(small * z)) + 1e-12)


def _kl(q, p):
    return float(np.sum(q * (np.log(np.maximum(q, 1e-300)) - np.log(p))))


@settings(max_examples=25)
@given(k=st.sampled_from([3, 4]), seed=st.integers(0, 2**32 - 1),
       fraction=st.floats(0.1, 0.9))
def test_tempering_is_the_kl_projection_onto_an_entropy(k, seed, fraction):
    """Among the distributions q of entropy h, softmax(beta z) minimises KL(q || p):
    no start of a generic constrained optimiser (SLSQP on the simplex) does better."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=k) * 2
    p = softmax(z)
    h = fraction * math.log(k)
    tempered = softmax(row_entropy.row_tempered_logits(z[None, :], h))[0]
    best = math.inf
    for start in rng.dirichlet(np.ones(k), 8):
        result = minimize(
            lambda q: _kl(q, p), start, method="SLSQP", bounds=[(1e-12, 1.0)] * k,
            constraints=[{"type": "eq", "fun": lambda q: q.sum() - 1.0},
                         {"type": "eq", "fun": lambda q: entropy(q) - h}],
            options={"ftol": 1e-12, "maxiter": 500},
        )
        if result.success and abs(entropy(result.x) - h) < 1e-7:
            best = min(best, result.fun)
    assert math.isfinite(best)
    assert _kl(tempered, p) <= best + 1e-7
