"""calibrators.evaluation.drift: the verdict on real CIFAR outputs, and the test's invariants."""

from __future__ import annotations

import json

import numpy as np
import pytest

from calibrators import CalibrationInputError, TemperatureScaler
from calibrators.evaluation import metrics
from calibrators.evaluation.drift import METHOD, as_bin_statistics, detect_drift


def _statistics(probs: np.ndarray, labels: np.ndarray) -> dict:
    return metrics.bin_statistics(probs.max(axis=1), probs.argmax(axis=1) == labels)


def _scenario(data):
    """Temperature fitted on the fit half; hold-out and live are the two quarters of the
    test half. Returns (hold-out report, calibrator, live logits, live labels)."""
    fit_probs, fit_labels = data.fit
    test_probs, test_labels = data.test
    cal = TemperatureScaler().fit(np.log(fit_probs), fit_labels)
    half = test_labels.shape[0] // 2
    holdout = metrics.report(cal.predict_proba(np.log(test_probs[:half])), test_labels[:half])
    return holdout, cal, np.log(test_probs[half:]), test_labels[half:]


@pytest.fixture(params=["cifar100", "cifar10"])
def scenario(request):
    return _scenario(request.getfixturevalue(request.param))


def test_unshifted_live_stream_is_ok(scenario):
    holdout, cal, logits, labels = scenario
    out = detect_drift(holdout["bins"], _statistics(cal.predict_proba(logits), labels))
    assert out["verdict"] == "ok"
    assert out["method"] == METHOD
    assert out["n_live"] == labels.shape[0] and out["n_holdout"] == holdout["n"]
    assert out["holdout_ece"] == pytest.approx(holdout["ece"], abs=1e-12)
    assert out["live_ece"] <= out["bound"]
    assert out["p_value"] >= out["alpha"] == 0.01


def test_overconfident_live_stream_is_drift(scenario):
    holdout, cal, logits, labels = scenario
    live = _statistics(cal.predict_proba(3.0 * logits), labels)
    out = detect_drift(holdout["bins"], live)
    assert out["verdict"] == "drift"
    assert out["live_ece"] > out["bound"] > out["holdout_ece"]
    assert out["p_value"] == 1 / (out["n_resamples"] + 1)  # no replicate reaches it
    assert out["live_ece"] == pytest.approx(
        metrics.expected_calibration_error(cal.predict_proba(3.0 * logits), labels), abs=1e-12
    )


def test_tiny_live_stream_is_insufficient_data(cifar100):
    holdout, cal, logits, labels = _scenario(cifar100)
    live = _statistics(cal.predict_proba(3.0 * logits[:50]), labels[:50])
    out = detect_drift(holdout["bins"], live)
    assert out["verdict"] == "insufficient_data"
    assert out["n_live"] == 50
    assert out["bound"] is None and out["p_value"] is None
    assert out["live_ece"] > 0.1  # reported, but no verdict drawn from it
    assert detect_drift(holdout["bins"], live, min_count=50)["verdict"] == "drift"


def test_no_live_rows_is_insufficient_data():
    hold = {"count": [10, 10], "confidence_sum": [3.0, 8.0], "correct_count": [3, 8]}
    out = detect_drift(hold, {"count": [0, 0], "confidence_sum": [0, 0], "correct_count": [0, 0]})
    assert out["verdict"] == "insufficient_data"
    assert out["live_ece"] is None and out["excess"] is None


def test_deterministic_and_json_serialisable(cifar10):
    holdout, cal, logits, labels = _scenario(cifar10)
    live = _statistics(cal.predict_proba(logits), labels)
    first = detect_drift(holdout["bins"], live)
    assert detect_drift(holdout["bins"], live) == first
    assert json.loads(json.dumps(first, allow_nan=False)) == first
    assert first["verdict"] == "ok"  # the unshifted stream (see the first test)
    assert detect_drift(holdout["bins"], live, seed=1)["bound"] != first["bound"]


def test_report_bins_and_statistics_give_the_same_verdict(cifar100):
    holdout, cal, logits, labels = _scenario(cifar100)
    probs = cal.predict_proba(np.log(cifar100.test[0][: holdout["n"]]))
    stats = _statistics(probs, cifar100.test[1][: holdout["n"]])
    live = _statistics(cal.predict_proba(logits), labels)
    from_bins = as_bin_statistics(holdout["bins"])
    assert from_bins["count"].tolist() == stats["count"].tolist()
    assert from_bins["correct_count"].tolist() == stats["correct_count"].tolist()
    np.testing.assert_allclose(from_bins["confidence_sum"], stats["confidence_sum"], rtol=1e-12)
    a, b = detect_drift(holdout["bins"], live), detect_drift(stats, live)
    assert a["verdict"] == b["verdict"] and a["p_value"] == b["p_value"]
    assert a["bound"] == pytest.approx(b["bound"], abs=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 0.05, 0.01])
def test_bound_and_p_value_agree(alpha):
    """live_ece > bound exactly when p_value < alpha, over a range of live gaps."""
    rng = np.random.default_rng(7)
    conf = rng.uniform(0.3, 1.0, 3000)
    hold = metrics.bin_statistics(conf[:1500], rng.uniform(size=1500) < conf[:1500])
    seen = set()
    for shift in np.linspace(-0.08, 0.0, 9):
        correct = rng.uniform(size=1500) < np.clip(conf[1500:] + shift, 0, 1)
        out = detect_drift(
            hold, metrics.bin_statistics(conf[1500:], correct), alpha=alpha, n_resamples=199
        )
        assert (out["verdict"] == "drift") == (out["p_value"] < alpha)
        assert (out["verdict"] == "drift") == (out["live_ece"] > out["bound"])
        seen.add(out["verdict"])
    assert seen == {"ok", "drift"}


def test_moving_rows_between_bins_is_not_drift():
    """Calibration that survives a change of the confidence distribution is not drift."""
    rng = np.random.default_rng(3)
    low, high = rng.uniform(0.4, 0.6, 4000), rng.uniform(0.8, 1.0, 4000)
    hold_conf = np.concatenate([low[:1800], high[:200]])
    live_conf = np.concatenate([low[2000:2200], high[2000:3800]])
    hold = metrics.bin_statistics(hold_conf, rng.uniform(size=2000) < hold_conf)
    live = metrics.bin_statistics(live_conf, rng.uniform(size=2000) < live_conf)
    assert detect_drift(hold, live)["verdict"] == "ok"


@pytest.mark.parametrize(
    ("holdout", "live", "kwargs", "message"),
    [
        ({"count": [1, 1]}, {"count": [1, 1]}, {}, "either confidence_sum"),
        (
            {"count": [2], "confidence_sum": [1.0], "correct_count": [3]},
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {},
            "correct counts must lie",
        ),
        (
            {"count": [2, 0], "confidence_sum": [1.0, 0], "correct_count": [1, 0]},
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {},
            "same number of bins",
        ),
        (
            {"count": [0], "confidence_sum": [0.0], "correct_count": [0]},
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {},
            "at least one row",
        ),
        (
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {"alpha": 0.0001},
            "alpha must lie",
        ),
        (
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {"count": [2], "confidence_sum": [1.0], "correct_count": [1]},
            {"min_count": 0},
            "min_count must be",
        ),
    ],
)
def test_bad_input_raises(holdout, live, kwargs, message):
    with pytest.raises(CalibrationInputError, match=message) as info:
        detect_drift(holdout, live, **kwargs)
    assert "Got" in str(info.value)
