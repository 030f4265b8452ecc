"""The four scalers: exactness of temperature scaling, ODIR quality on real
data, structural invariants, serialisation, ONNX parity, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, logsumexp, softmax

import calibrators
from calibrators import (
    CALIBRATORS,
    CalibrationInputError,
    DirichletScaler,
    MatrixScaler,
    TemperatureScaler,
    VectorScaler,
    numerics,
)
from calibrators.methods import temperature as temperature_module
from calibrators.methods.temperature import _pass
from calibrators.validation import PROBABILITY_FLOOR
from tests.calibrators.helpers import (
    FIT_OPTIONS,
    LINEAR_METHODS,
    from_arrays,
    held_out_nll,
    onnx_outputs,
    random_calibrator,
)
from tests.strategies import logits_and_labels


def exact_beta(z, y):
    """The optimal inverse temperature by scipy's bounded scalar search on log(beta)."""
    zy = z[np.arange(len(y)), y]

    def nll(log_beta):
        b = math.exp(log_beta)
        return float(np.mean(logsumexp(b * z, axis=1) - b * zy))

    res = minimize_scalar(nll, bounds=(-6, 6), method="bounded", options={"xatol": 1e-12})
    return math.exp(res.x)


# ---------------------------------------------------------------- temperature, exact


def test_temperature_reaches_the_exact_optimum_on_real_data(shared):
    probs, labels = shared.fit
    cal = TemperatureScaler().fit(probs, labels, kind="probabilities")
    z = np.log(np.maximum(probs.astype(np.float64), PROBABILITY_FLOOR))
    beta = exact_beta(z, labels)
    assert cal.fit_info_["reason"] == "converged"
    assert abs(cal.fit_info_["relative_gradient"]) < 1e-10
    test_p, test_y = shared.test
    ours = held_out_nll(cal.predict_proba(test_p, kind="probabilities"), test_y)
    zt = np.log(np.maximum(test_p.astype(np.float64), PROBABILITY_FLOOR))
    exact = held_out_nll(softmax(beta * zt, axis=1), test_y)
    assert abs(ours - exact) <= 1e-7 * exact
    assert cal.beta_ == pytest.approx(beta, rel=1e-6)


def test_temperature_on_float32_probabilities_is_not_the_identity(cifar10):
    # netcal's TemperatureScaling silently returns T = 1.0 on float32
    # probabilities; ours must calibrate (and improve held-out NLL).
    probs, labels = cifar10.fit
    assert probs.dtype == np.float32
    cal = TemperatureScaler().fit(probs, labels, kind="probabilities")
    assert abs(cal.temperature_ - 1.0) > 0.1
    test_p, test_y = cifar10.test
    before = held_out_nll(test_p.astype(np.float64), test_y)
    after = held_out_nll(cal.predict_proba(test_p, kind="probabilities"), test_y)
    assert after < before


@pytest.mark.slow
def test_common_torch_lbfgs_recipe_stops_short_where_we_do_not(cifar100):
    torch = pytest.importorskip("torch")
    probs, labels = cifar100.fit
    z = np.log(np.maximum(probs.astype(np.float64), PROBABILITY_FLOOR))
    zt, yt = torch.from_numpy(z.astype(np.float32)), torch.from_numpy(labels)
    t = torch.nn.Parameter(torch.ones(1) * 1.5)
    opt = torch.optim.LBFGS([t], lr=0.01, max_iter=50)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(zt / t, yt)
        loss.backward()
        return loss

    opt.step(closure)
    exact_t = 1.0 / exact_beta(z, labels)
    ours = TemperatureScaler().fit(probs, labels, kind="probabilities")
    assert abs(float(t.detach()) - exact_t) > 1e-3 * exact_t  # the recipe is visibly off...
    assert ours.temperature_ == pytest.approx(exact_t, rel=1e-6)  # ...we are not


@pytest.mark.parametrize("target", [0.05, 0.5, 1.5])
def test_entropy_target_is_hit(shared, target):
    probs, labels = shared.fit
    cal = TemperatureScaler(target_entropy=target).fit(probs, labels, kind="probabilities")
    p = cal.predict_proba(probs, kind="probabilities")
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    assert abs(-plogp.sum(axis=1).mean() - target) < 1e-9


def test_entropy_target_out_of_range_and_constant_scores_raise():
    z = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    with pytest.raises(CalibrationInputError, match=r"\(0, log K\)"):
        TemperatureScaler(target_entropy=math.log(3)).fit(z, [0, 1])
    with pytest.raises(CalibrationInputError, match="constant"):
        TemperatureScaler(target_entropy=0.5).fit(np.ones((4, 3)), [0, 1, 2, 0])
    with pytest.raises(CalibrationInputError, match="target_entropy"):
        calibrators.create("temperature", target_entropy=-1.0)
    TemperatureScaler(target_entropy=-1.0)  # __init__ only stores; checked_options and fit check
    with pytest.raises(CalibrationInputError, match="target_entropy"):
        TemperatureScaler(target_entropy=-1.0).fit(z, [0, 1])


def test_temperature_stops_at_max_passes_and_says_so(cifar10):
    probs, labels = cifar10.fit
    cal = TemperatureScaler(max_passes=2).fit(probs, labels, kind="probabilities")
    assert cal.fit_info_["reason"] == "max_passes"
    assert cal.beta_ > 0


def test_temperature_with_perfect_labels_is_bounded_not_infinite():
    # Every label is its row's argmax: the NLL decreases forever in beta, and its
    # gradient vanishes as beta grows, so the search stops at a large finite beta
    # where the gradient (still negative) is below the tolerance.
    z = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 4.0], [5.0, 0.0, 1.0]])
    cal = TemperatureScaler().fit(z, [0, 1, 2, 0])
    assert math.isfinite(cal.beta_) and cal.beta_ > 10
    assert cal.fit_info_["reason"] == "converged"
    assert -1e-10 < cal.fit_info_["relative_gradient"] < 0
    assert np.isfinite(cal.predict_proba(z)).all()


def _gradient_and_nll(z, y, beta):
    """Mean dNLL/dbeta and NLL at beta, by scipy in float64 (the oracle)."""
    u = beta * z
    p = softmax(u, axis=1)
    zy = z[np.arange(len(y)), y]
    return float(np.mean((p * z).sum(axis=1) - zy)), float(np.mean(logsumexp(u, axis=1) - u[
        np.arange(len(y)), y]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_temperature_on_many_rows_is_the_float64_root_after_its_float32_start(dtype):
    # More than 2 * SUBSAMPLE_ROWS rows: the float32 start on the subsample, one
    # float32 pass over every row, then float64 passes with the last step
    # extrapolated. The answer must be float64's root to the last digits, and the
    # figures reported at it (extrapolated) the true ones.
    rng = np.random.default_rng(5)
    n, k = 40_000, 7
    y = rng.integers(0, k, n)
    z = 3.0 * rng.standard_normal((n, k))
    z[np.arange(n), np.where(rng.random(n) < 0.6, y, rng.integers(0, k, n))] += 6.0
    z = z.astype(dtype)
    cal = TemperatureScaler().fit(z, y)
    info = cal.fit_info_
    assert (info["start_dtype"], info["float32_passes"], info["extrapolated"]) == (
        "float32", 1, True)
    assert info["passes"] <= 2
    z64 = z.astype(np.float64)
    grad, nll = _gradient_and_nll(z64, y, cal.beta_)
    assert abs(grad) < 1e-13 * info["scale"]
    assert info["nll"] == pytest.approx(nll, rel=1e-14)
    assert abs(info["gradient"] - grad) < 1e-13 * info["scale"]
    # The root itself, by bisection on the oracle's gradient (monotone in beta).
    lo, hi = 0.5 * cal.beta_, 2.0 * cal.beta_
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _gradient_and_nll(z64, y, mid)[0] < 0 else (lo, mid)
    assert cal.beta_ == pytest.approx(lo, rel=4e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_temperature_passes_run_on_the_calling_thread_with_the_same_sums(
        dtype, monkeypatch):
    """Up to SERIAL_ELEMENTS entries a pass sweeps its chunks on the calling thread (no
    pool: its many small calls hold the GIL); above, on the pool. The same chunks in
    the same order: the same sums to the bit."""
    rng = np.random.default_rng(8)
    n, k = 3_000, 50  # 150,000 entries: 3 chunks of PASS_CHUNK_ELEMENTS
    y = rng.integers(0, k, n)
    z = (3.0 * rng.standard_normal((n, k))).astype(dtype)
    monkeypatch.setattr(numerics, "n_threads", lambda: 2)
    pooled = []
    original = temperature_module.map_chunks
    monkeypatch.setattr(temperature_module, "map_chunks",
                        lambda *a, **kw: pooled.append(1) or original(*a, **kw))
    serial = _pass(z, y, "logits", 0.7, dtype)
    assert pooled == []
    monkeypatch.setattr(temperature_module, "SERIAL_ELEMENTS", n * k - 1)
    assert _pass(z, y, "logits", 0.7, dtype) == serial
    assert pooled == [1]


def test_temperature_on_logits_beyond_float32_is_fitted_rescaled():
    # float64 logits whose within-row differences overflow float32: fitted times a
    # power of two (exact), so the float32 start serves them too, and the answer is
    # the one for the same logits scaled down.
    rng = np.random.default_rng(6)
    n, k = 40_000, 5
    y = rng.integers(0, k, n)
    z = rng.standard_normal((n, k))
    z[np.arange(n), y] += 1.0
    small = TemperatureScaler().fit(z, y)
    huge = TemperatureScaler().fit(z * 1e39, y)
    assert huge.fit_info_["start_dtype"] == small.fit_info_["start_dtype"] == "float32"
    shift = small.fit_info_["rescale_exponent"] - huge.fit_info_["rescale_exponent"]
    assert abs(shift - math.log2(1e39)) < 1
    assert huge.beta_ * 1e39 == pytest.approx(small.beta_, rel=1e-13)


@given(logits_and_labels(min_rows=2, max_classes=8), st.floats(0.01, 10.0), st.floats(1.01, 3))
def test_entropy_is_strictly_decreasing_in_beta(data, beta, factor):
    z, y = data
    rows_vary = (z.max(axis=1) - z.min(axis=1)) > 1e-3
    if not rows_vary.any():
        return
    z, y = z[rows_vary], y[rows_vary]
    first, second = _pass(z, y, "logits", beta), _pass(z, y, "logits", beta * factor)
    assert second.entropy <= first.entropy
    # dH/dbeta = -beta Var_p(z): strict wherever the softmax is not saturated
    # (saturated rows sit at log(number of tied maxima) in float64).
    if second.var > 1e-6:
        assert second.entropy < first.entropy


@given(logits_and_labels(max_magnitude=1e4))
def test_temperature_never_changes_the_argmax(data):
    z, y = data
    cal = TemperatureScaler().fit(z, y)
    p = cal.predict_proba(z)
    assert cal.beta_ > 0 and cal.preserves_argmax
    # Ties can resolve differently only when the calibrated row has ties too.
    changed = p.argmax(axis=1) != z.argmax(axis=1)
    assert not changed.any() or np.all(
        p[changed, z.argmax(axis=1)[changed]] == p[changed].max(axis=1)
    )


# ---------------------------------------------------------------- ODIR family on real data


@pytest.mark.slow
@pytest.mark.parametrize("method", ["matrix", "dirichlet"])
def test_odir_beats_uncalibrated_and_is_close_to_temperature(shared, method):
    probs, labels = shared.fit
    test_p, test_y = shared.test
    cal = calibrators.create(method).fit(probs, labels, kind="probabilities")
    temp = TemperatureScaler().fit(probs, labels, kind="probabilities")
    ours = held_out_nll(cal.predict_proba(test_p, kind="probabilities"), test_y)
    uncal = held_out_nll(test_p.astype(np.float64), test_y)
    by_temperature = held_out_nll(temp.predict_proba(test_p, kind="probabilities"), test_y)
    assert ours < uncal
    if shared.name.startswith("wideresnet"):
        assert ours <= 1.01 * by_temperature
    info = cal.fit_info_
    assert info["converged"]
    assert len(info["cross_validation"]["candidates"]) >= 2


@pytest.mark.slow
def test_unregularised_matrix_scaling_overfits_at_k100_and_odir_does_not(cifar100):
    # Peers fit matrix scaling without a penalty: at K = 100 on 5,000 rows the
    # held-out NLL is worse than no calibration. A fixed strong ODIR penalty
    # keeps it below (the cross-validated choice is tested above).
    probs, labels = cifar100.fit
    test_p, test_y = cifar100.test
    uncal = held_out_nll(test_p.astype(np.float64), test_y)
    weak = MatrixScaler(reg_lambda=1e-3, reg_mu=1e-3, max_iter=300, tol=1e-6)
    strong = MatrixScaler(reg_lambda=1e4, reg_mu=1e4, tol=1e-6)
    weak_nll = held_out_nll(
        weak.fit(probs, labels, kind="probabilities").predict_proba(test_p, kind="probabilities"),
        test_y,
    )
    strong_nll = held_out_nll(
        strong.fit(probs, labels, kind="probabilities").predict_proba(test_p, kind="probabilities"),
        test_y,
    )
    assert weak_nll > uncal > strong_nll


def test_odir_search_is_deterministic_for_a_seed():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(120, 4)) * 3
    y = rng.integers(0, 4, 120)
    a = DirichletScaler(grid=[10.0, 1.0], seed=5).fit(z, y)
    b = DirichletScaler(grid=[10.0, 1.0], seed=5).fit(z, y)
    np.testing.assert_array_equal(a.weight_, b.weight_)
    np.testing.assert_array_equal(a.bias_, b.bias_)


def test_linear_scalers_can_change_the_argmax_and_say_they_may():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(300, 3))
    y = (z.argmax(axis=1) + 1) % 3  # the model is systematically off by one class
    cal = MatrixScaler(reg_lambda=1e-2, reg_mu=1e-2).fit(z, y)
    assert not cal.preserves_argmax
    assert (cal.predict_proba(z).argmax(axis=1) != z.argmax(axis=1)).mean() > 0.5


def test_progress_is_reported_up_to_one():
    rng = np.random.default_rng(1)
    z, y = rng.normal(size=(60, 3)), rng.integers(0, 3, 60)
    seen = []
    VectorScaler(grid=[1.0, 0.1]).fit(z, y, progress=seen.append)
    assert seen and seen[-1] == 1.0 and all(0 <= s <= 1 for s in seen)
    assert seen == sorted(seen)


# ---------------------------------------------------------------- structural invariants


@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_identity_parameters_equal_plain_softmax(method):
    k = 5
    z = np.random.default_rng(2).normal(size=(7, k)) * 4
    cls = CALIBRATORS[method]
    weight = {"scalar": 1.0, "diagonal": np.ones(k), "full": np.eye(k)}[cls.structure]
    cal = from_arrays(method, k, weight=weight, bias=np.zeros(k) if cls.has_bias else None)
    np.testing.assert_allclose(cal.predict_proba(z), softmax(z, axis=1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("method", ["temperature", "dirichlet"])
def test_per_row_shifts_do_not_change_temperature_or_dirichlet(method):
    rng = np.random.default_rng(4)
    k = 6
    z = rng.normal(size=(9, k)) * 3
    shift = rng.normal(size=(9, 1)) * 100
    cal = random_calibrator(method, k, rng)
    np.testing.assert_allclose(cal.predict_proba(z + shift), cal.predict_proba(z), atol=1e-12)


@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_rows_sum_to_one_without_nan_on_extreme_inputs(method):
    rng = np.random.default_rng(5)
    k = 4
    cal = random_calibrator(method, k, rng)
    huge = rng.normal(size=(11, k)) * 1e4
    p = cal.predict_proba(huge)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    tiny = np.full((3, k), 1e-38)
    tiny[:, 0] = 1.0 - (k - 1) * 1e-38
    tiny[1, 1] = 0.0
    q = cal.predict_proba(tiny, kind="probabilities")
    assert np.isfinite(q).all()
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-12)


def test_matrix_scaling_multiplies_matrices_not_vectors():
    # K >= 3, N != K: a full W must mix classes row by row (u = clr(z) W^T + b).
    w = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.0, 1.0]])
    b = np.array([0.1, -0.2, 0.3])
    z = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 1.0], [3.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    cal = from_arrays("matrix", 3, weight=w, bias=b)
    clr = log_softmax(z, axis=1) - log_softmax(z, axis=1).mean(axis=1, keepdims=True)
    np.testing.assert_allclose(cal.predict_proba(z), softmax(clr @ w.T + b, axis=1), atol=1e-15)
    dcal = from_arrays("dirichlet", 3, weight=w, bias=b)
    np.testing.assert_allclose(
        dcal.predict_proba(z), softmax(log_softmax(z, axis=1) @ w.T + b, axis=1), atol=1e-15
    )


# ---------------------------------------------------------------- serialisation


@pytest.mark.parametrize("method", calibrators.METHODS)
@settings(max_examples=15)
@given(data=logits_and_labels(min_rows=8, max_rows=30, min_classes=3, max_classes=6))
def test_params_round_trip_through_json_reproduces_outputs_exactly(method, data):
    z, y = data
    cal = calibrators.create(method, **FIT_OPTIONS[method]).fit(z, y)
    params = cal.to_params()
    again = calibrators.from_params(json.loads(json.dumps(params, allow_nan=False)))
    np.testing.assert_array_equal(again.predict_proba(z), cal.predict_proba(z))
    assert type(again) is type(cal) and again.to_params() == params


@pytest.mark.parametrize(
    "params, message",
    [
        ({"method": "nope", "n_classes": 3, "weight": 1.0}, "method must be one of"),
        ({"method": "temperature", "n_classes": 1, "weight": 1.0}, "n_classes"),
        ({"method": "vector", "n_classes": 3, "weight": [1.0, 1.0], "bias": [0, 0, 0]}, "shape"),
        ({"method": "matrix", "n_classes": 2, "weight": [[1, 0], [0, 1]]}, "bias"),
        ({"method": "temperature", "n_classes": 2, "weight": float("nan")}, "finite"),
        ({"method": "temperature", "n_classes": 2}, "keys"),
        ({"format": "pickle", "method": "temperature", "n_classes": 2, "weight": 1.0}, "format"),
        ({"method": "temperature", "n_classes": 2, "weight": 1.0, "bias": [0, 0]}, "null"),
        ({"method": "temperature", "n_classes": 2, "weight": "x"}, "numbers"),
        ({"method": "temperature", "n_classes": 2, "weight": 1.0, "options": {"tol": -1}}, "tol"),
        ({"method": "vector", "n_classes": 2, "weight": [1, 1], "bias": [0, 0],
          "options": {"lambda": 1}}, "options of vector must be among"),
        ({"method": "temperature", "n_classes": 2, "weight": 1.0, "options": [1]}, "mapping"),
        ([("method", "temperature")], "must be a dict"),
    ],
)
def test_from_params_rejects_malformed_params(params, message):
    with pytest.raises(CalibrationInputError, match=message):
        calibrators.from_params(params)


def test_create_rejects_unknown_methods_and_options():
    with pytest.raises(CalibrationInputError, match="method must be one of"):
        calibrators.create("platt")
    with pytest.raises(CalibrationInputError, match="options of temperature must be among"):
        calibrators.create("temperature", reg_lambda=1.0)
    with pytest.raises(CalibrationInputError, match="n_folds"):
        calibrators.create("matrix", n_folds=1)


# ---------------------------------------------------------------- ONNX parity


@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_onnx_matches_predict_proba_on_real_data(shared, method):
    probs, labels = shared.fit
    searched = "reg_mu" in CALIBRATORS[method].option_checks
    options = {"reg_lambda": 1e3, "reg_mu": 1e3, "tol": 1e-6} if searched else {}
    cal = calibrators.create(method, **options).fit(probs, labels, kind="probabilities")
    test_p, _ = shared.test
    with np.errstate(divide="ignore"):
        fed = np.log(test_p)
    p, conf, label, entropy = onnx_outputs(cal.to_onnx(), fed).values()
    ref = cal.predict_proba(test_p, kind="probabilities")
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(conf, ref.max(axis=1), rtol=0, atol=1e-6)
    plogp = np.where(ref > 0, ref * np.log(np.where(ref > 0, ref, 1.0)), 0.0)
    np.testing.assert_allclose(entropy, -plogp.sum(axis=1), rtol=0, atol=1e-6)
    assert (label == ref.argmax(axis=1)).mean() > 0.9999


@pytest.mark.parametrize("method", LINEAR_METHODS)
@settings(max_examples=12)
@given(
    n=st.sampled_from([1, 2, 7, 33]),
    k=st.sampled_from([2, 3, 10]),
    magnitude=st.sampled_from([1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_onnx_parity_on_random_shapes(method, n, k, magnitude, seed):
    rng = np.random.default_rng(seed)
    cal = random_calibrator(method, k, rng)
    z = (rng.normal(size=(n, k)) * magnitude).astype(np.float32)
    p, conf, label, entropy = onnx_outputs(cal.to_onnx(), z).values()
    ref = cal.predict_proba(z)
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(conf, ref.max(axis=1), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(label, ref.argmax(axis=1))
    assert np.isfinite(entropy).all()


@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_onnx_parity_with_a_thousand_classes(method):
    rng = np.random.default_rng(9)
    k = 1000
    cal = random_calibrator(method, k, rng)
    z = (rng.normal(size=(5, k)) * 1e4).astype(np.float32)
    p, _, label, _ = onnx_outputs(cal.to_onnx(), z).values()
    ref = cal.predict_proba(z)
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(label, ref.argmax(axis=1))


# ---------------------------------------------------------------- bad input, one per case


GOOD = np.array([[1.0, 2.0, 0.5], [0.0, 1.0, 3.0], [2.0, 2.0, 1.0], [1.0, 0.0, 0.0]])
GOOD_Y = np.array([0, 2, 1, 0])


@pytest.mark.parametrize(
    "scores, labels, kind, message",
    [
        (np.where(np.arange(12).reshape(4, 3) == 7, np.nan, GOOD), GOOD_Y, "logits",
         r"finite .*nan at row 2, column 1"),
        (np.where(np.arange(12).reshape(4, 3) == 3, np.inf, GOOD), GOOD_Y, "logits",
         r"finite .*inf at row 1, column 0"),
        (GOOD[0], GOOD_Y, "logits", "2-D array"),
        (GOOD[:, :1], GOOD_Y, "logits", "at least 2 classes"),
        (GOOD, GOOD_Y[:3], "logits", r"one entry per row of the scores \(4\)\. Got 3"),
        (GOOD, np.array([0, 3, 1, 0]), "logits", r"\[0, 3\)\. Got 3 at row 1"),
        (GOOD, np.array([0, -1, 1, 0]), "logits", r"\[0, 3\)\. Got -1 at row 1"),
        (np.empty((0, 3)), np.empty(0, dtype=int), "logits", "at least one row"),
        (GOOD, np.array([0.0, 1.5, 1.0, 0.0]), "logits", r"integers .*Got 1\.5 at row 1"),
        (GOOD, np.array(["a", "b", "c", "d"]), "logits", "integers"),
        (np.array([[0.5, 0.6, -0.1], [0.2, 0.3, 0.5]]), [0, 1], "probabilities",
         r"non-negative\. Got -0\.1 at row 0, column 2"),
        (np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.6]]), [0, 1], "probabilities",
         r"sum to 1 .*Got a sum of 1\.1 at row 1"),
        ([[1.0, 2.0], [1.0]], [0, 1], "logits", "rectangular"),
        (GOOD, GOOD_Y, "logprobs", "kind must be"),
    ],
    ids=["nan", "inf", "ndim", "k<2", "length", "label>=K", "label<0", "empty", "non-integer",
         "string-labels", "negative-prob", "row-sum", "ragged", "kind"],
)
def test_bad_input_raises_a_useful_error(scores, labels, kind, message):
    with pytest.raises(CalibrationInputError, match=message):
        TemperatureScaler().fit(scores, labels, kind=kind)


def test_zero_probability_is_legal():
    p = np.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.2, 0.0, 0.8], [0.1, 0.9, 0.0]])
    cal = TemperatureScaler().fit(p, [0, 1, 2, 1], kind="probabilities")
    assert np.isfinite(cal.predict_proba(p, kind="probabilities")).all()


def test_predicting_with_a_different_k_is_refused():
    cal = TemperatureScaler().fit(GOOD, GOOD_Y)
    with pytest.raises(CalibrationInputError, match="must have 3 columns"):
        cal.predict_proba(np.zeros((2, 4)))
