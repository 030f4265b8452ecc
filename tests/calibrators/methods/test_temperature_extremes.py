"""Temperature scaling at the edges of float64: logits from 2**-1000 to 2**1000,
probabilities next to 0 and 1, constant rows, predictions that are all right, the
entropy target, the ONNX graph at such betas.

The fit rescales the logits by a power of two (``calibrators/methods/temperature.py``),
so logits times ``2**e`` must get exactly the answer of the logits themselves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrators import TemperatureScaler
from calibrators.methods import temperature
from calibrators.validation import PROBABILITY_FLOOR, CalibrationInputError
from tests.calibrators.helpers import onnx_outputs
from tests.strategies import logits_and_labels

#: Exponents of the scales tried: the brief's range, 2**-1000 to 2**1000.
EXPONENTS = st.integers(-1000, 1000)


def _labelled(n: int, k: int, seed: int, *, hit: float = 0.6):
    """Over-confident logits of moderate scale (N x K) with labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    z = 3.0 * rng.standard_normal((n, k))
    z[np.arange(n), np.where(rng.random(n) < hit, y, rng.integers(0, k, n))] += 6.0
    return z, y


def _fit_or_refuse(z, y, **options):
    """The fitted calibrator, or None when the fit refuses with CalibrationInputError
    (the only exception allowed); a fitted beta is a positive normal float64."""
    try:
        cal = TemperatureScaler(**options).fit(z, y)
    except CalibrationInputError as exc:
        assert "float64's normal range" in str(exc)
        return None
    assert np.finfo(np.float64).tiny <= cal.beta_ < math.inf
    return cal


@settings(max_examples=40)
@given(data=logits_and_labels(min_rows=2, max_rows=30, max_classes=6), e=EXPONENTS)
def test_logits_times_a_power_of_two_get_the_answer_of_the_logits(data, e):
    z, y = data
    w = np.ldexp(z, e)  # entries may round to subnormals or 0 for e << 0 ...
    v = np.ldexp(w, -e)  # ... so the pair compared is w and v, exactly 2**e apart
    scaled, plain = _fit_or_refuse(w, y), _fit_or_refuse(v, y)
    if scaled is None or plain is None:
        return
    p = scaled.predict_proba(w)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p, plain.predict_proba(v), rtol=0, atol=1e-12)
    if plain.fit_info_["scale"] > 0:  # (constant rows: beta stays 1 at any scale)
        assert math.ldexp(scaled.beta_, e) == pytest.approx(plain.beta_, rel=1e-12)


@pytest.mark.parametrize("e", [-1000, -300, 300, 1000])
def test_many_rows_at_extreme_scales_take_the_usual_passes(e):
    # The subsample start, one float32 pass over every row and the extrapolated
    # float64 pass, all on the rescaled logits.
    z, y = _labelled(40_000, 7, seed=1)
    plain = TemperatureScaler().fit(z, y)
    scaled = TemperatureScaler().fit(np.ldexp(z, e), y)
    for key in ("passes", "float32_passes", "start_dtype", "extrapolated"):
        assert scaled.fit_info_[key] == plain.fit_info_[key], key
    assert math.ldexp(scaled.beta_, e) == pytest.approx(plain.beta_, rel=1e-14)
    assert scaled.fit_info_["relative_gradient"] == pytest.approx(
        plain.fit_info_["relative_gradient"], abs=1e-16)


def _without_subsample(z, y, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(temperature, "SUBSAMPLE_ROWS", 0)
        return TemperatureScaler().fit(z, y)


@pytest.mark.parametrize("factor", [1e300, 1e-300])
def test_a_row_beyond_the_subsample_scale_is_not_missed(factor, monkeypatch):
    # Row 1 is not in the strided subsample (rows 0, step, 2 step, ...): the scale
    # and bracket taken from the subsample do not hold for it, and the fit starts
    # again from every row; the answer is the one found without a subsample.
    z, y = _labelled(40_000, 4, seed=2)
    z[1] *= factor
    cal = TemperatureScaler().fit(z, y)
    assert cal.beta_ == pytest.approx(_without_subsample(z, y, monkeypatch).beta_, rel=1e-13)


def test_a_constant_subsample_takes_its_scale_from_every_row(monkeypatch):
    z, y = np.zeros((40_000, 4)), np.zeros(40_000, dtype=np.int64)
    z[1] = [1e300, 0.0, 0.0, -1e300]
    z[3] = [0.0, 2e299, 0.0, 0.0]
    y[3] = 1
    cal = TemperatureScaler().fit(z, y)
    assert cal.fit_info_["start_rows"] == z.shape[0]
    assert cal.beta_ == pytest.approx(_without_subsample(z, y, monkeypatch).beta_, rel=1e-13)
    assert np.isfinite(cal.predict_proba(z)).all()


@pytest.mark.parametrize("z", [
    np.array([[1.5e308, -1.5e308, 0.0], [0.0, 1.0e308, -1.0e308]]),  # beta below 2**-1022
    np.array([[5e-324, 0.0, 0.0], [0.0, 1e-323, 0.0]]),  # beta beyond 2**1024
], ids=["near-max", "subnormal"])
def test_logits_whose_beta_float64_cannot_hold_are_refused(z):
    # Labels below their rows' mean: the optimum is beta -> 0, the bracket's lower end,
    # 1e-8 over the spread of the logits.
    with pytest.raises(CalibrationInputError, match="float64's normal range"):
        TemperatureScaler().fit(z, [1, 2])


@pytest.mark.parametrize("value", [0.0, 3.0, 1e300, -1e-300])
def test_equal_logits_keep_beta_one(value):
    # Every beta gives the uniform prediction (a flat NLL): beta stays 1.
    z = np.full((6, 3), value)
    cal = TemperatureScaler().fit(z, [0, 1, 2, 0, 1, 2])
    assert cal.beta_ == 1.0
    np.testing.assert_array_equal(cal.predict_proba(z), np.full((6, 3), 1 / 3))


@pytest.mark.parametrize("e", [-1000, 0, 1000])
def test_all_right_predictions_stop_at_a_finite_beta(e):
    # Every label is its row's argmax: the NLL decreases for ever in beta. The fit
    # stops where the gradient is below tol, relative to the logits' spread: a
    # finite beta, the same at every scale, and predictions without NaN.
    rng = np.random.default_rng(3)
    z = rng.standard_normal((50, 5))
    y = z.argmax(axis=1)
    plain = TemperatureScaler().fit(z, y)
    cal = TemperatureScaler().fit(np.ldexp(z, e), y)
    assert cal.fit_info_["reason"] == "converged"
    assert -1e-10 < cal.fit_info_["relative_gradient"] < 0
    assert math.ldexp(cal.beta_, e) == pytest.approx(plain.beta_, rel=1e-12)
    p = cal.predict_proba(np.ldexp(z, e))
    assert np.isfinite(p).all() and (p.argmax(axis=1) == y).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_probabilities_next_to_zero_and_one(dtype):
    # 1 - 1e-16 (1 in float32), 1e-16, 1e-300 (0 in float32), exact zeros and ties.
    p = np.array([[1 - 1e-16, 1e-16, 0.0], [1e-300, 1.0, 0.0], [0.5, 0.5, 0.0],
                  [1 / 3, 1 / 3, 1 / 3], [0.2, 0.7, 0.1], [0.6, 0.1, 0.3]], dtype=dtype)
    y = [0, 1, 0, 2, 2, 1]
    cal = TemperatureScaler().fit(p, y, kind="probabilities")
    out = cal.predict_proba(p, kind="probabilities")
    assert math.isfinite(cal.beta_) and cal.beta_ > 0
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    # One answer per distribution: the same fit given log(max(p, floor)) as logits.
    logits = np.log(np.maximum(p.astype(np.float64), PROBABILITY_FLOOR))
    as_logits = TemperatureScaler().fit(logits, y)
    assert as_logits.beta_ == pytest.approx(cal.beta_, rel=1e-12)


@pytest.mark.parametrize("e", [-1000, -300, 0, 300, 1000])
@pytest.mark.parametrize("k", [2, 6])
def test_entropy_target_at_extreme_scales(e, k):
    z, y = _labelled(200, k, seed=4)
    target = 0.5 * math.log(k)
    cal = TemperatureScaler(target_entropy=target).fit(np.ldexp(z, e), y)
    p = cal.predict_proba(np.ldexp(z, e))
    entropy = -np.sum(p * np.log(np.maximum(p, np.finfo(np.float64).tiny)), axis=1).mean()
    assert entropy == pytest.approx(target, abs=1e-9)
    plain = TemperatureScaler(target_entropy=target).fit(z, y)
    assert math.ldexp(cal.beta_, e) == pytest.approx(plain.beta_, rel=1e-12)


@pytest.mark.parametrize("e", [-1000, -120, -20, 0, 20, 100, 1000])
def test_onnx_at_extreme_betas_is_finite_and_matches_numpy(e):
    # The graph takes float32 logits: fitted on logits times 2**e, it is fed float32
    # logits (those logits when float32 holds them, else moderate ones, for which
    # beta * z is far below or above 1).
    z, y = _labelled(300, 5, seed=5)
    cal = TemperatureScaler().fit(np.ldexp(z, e), y)
    with np.errstate(over="ignore"):
        fed = np.ldexp(z, e).astype(np.float32)
    if not (np.isfinite(fed).all() and np.all((fed != 0) == (z != 0))):
        fed = z.astype(np.float32)
    p, conf, label, entropy = onnx_outputs(cal.to_onnx(), fed).values()
    ref = cal.predict_proba(fed)
    for out in (p, conf, entropy):
        assert np.isfinite(out).all()
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(conf, ref.max(axis=1), rtol=0, atol=1e-6)
    # A top class (rows can be uniform to float32: beta * z below its resolution).
    assert (ref[np.arange(len(label)), label] >= ref.max(axis=1) - 1e-6).all()
