"""calibrators.evaluation.metrics: the calibration errors with intervals (debiased L2 ECE, smooth
ECE). Coverage by simulation on calibrated synthetic data (issue 23's acceptance), the
bias of the plain binned ECE there, and the smooth ECE against a loop-based oracle
written straight from the paper's definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import simpson

from calibrators.evaluation import metrics
from calibrators.validation import CalibrationInputError
from tests.oracles import softmax

N_TRIALS = 200
SIZES = (200, 1_000, 5_000)
LEVEL = 0.95
#: A 95 % interval must cover in at least 90 % of the 200 trials: the acceptance's
#: bound. Binomial(200, 0.95) falls below 180 with probability about 1e-3.
MIN_COVERED = 180


def calibrated_sample(rng: np.random.Generator, n: int, k: int = 4):
    """``n`` rows of ``k``-class probabilities and labels drawn from them: calibrated
    in every sense, so the true calibration error of the top label is 0."""
    logits = rng.normal(scale=2.0, size=(n, k))
    probs = softmax(logits)
    labels = (rng.random((n, 1)) > probs.cumsum(axis=1)).sum(axis=1)
    return probs, np.minimum(labels, k - 1)


def trials(n: int, seed: int):
    """Top-label confidences and outcomes of ``N_TRIALS`` calibrated samples of ``n``
    rows, shapes (N_TRIALS, n): drawn at once."""
    rng = np.random.default_rng(seed)
    probs, labels = calibrated_sample(rng, N_TRIALS * n)
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == labels
    return confidence.reshape(N_TRIALS, n), correct.reshape(N_TRIALS, n)


def per_bin(confidence: np.ndarray, correct: np.ndarray, n_bins: int = metrics.DEFAULT_N_BINS):
    """bin_statistics of every trial at once: three arrays of shape (N_TRIALS, n_bins)."""
    t = confidence.shape[0]
    index = np.searchsorted(metrics.bin_edges(n_bins)[1:-1], confidence, side="right")
    flat = (index + n_bins * np.arange(t)[:, None]).ravel()
    shape = (t, n_bins)
    count = np.bincount(flat, minlength=t * n_bins).reshape(shape)
    total = np.bincount(flat, confidence.ravel(), minlength=t * n_bins).reshape(shape)
    right = np.bincount(flat, correct.ravel(), minlength=t * n_bins).reshape(shape)
    return count, total, right.astype(np.int64)


# ---------------------------------------------------------------------------
# coverage on calibrated data (true calibration error 0)


@pytest.mark.parametrize("n", SIZES)
def test_debiased_interval_covers_zero_and_plain_ece_is_biased(n):
    confidence, correct = trials(n, seed=n)
    count, total, right = per_bin(confidence, correct)
    out = [
        metrics.debiased_ece_from_bin_statistics(c, s, r, level=LEVEL)
        for c, s, r in zip(count, total, right, strict=True)
    ]
    covered = sum(o["lower"] <= 0.0 <= o["upper"] for o in out)
    assert covered >= MIN_COVERED, (n, covered)
    # The plain binned ECE (and its square, the plug-in of the debiased target) sit
    # above 0 in every trial; the debiased square averages to 0 within its error.
    plain = np.array([metrics.ece_from_bin_statistics(c, s, r)["ece"] for c, s, r in
                      zip(count, total, right, strict=True)])
    squared = np.array([o["squared"] for o in out])
    plug_in = (np.abs(right - total) ** 2 / np.maximum(count, 1)).sum(axis=1) / n
    assert (plain > 0).all()
    assert plug_in.mean() > 10 * plug_in.std() / math.sqrt(N_TRIALS)
    assert abs(squared.mean()) < 3.5 * squared.std() / math.sqrt(N_TRIALS), (
        squared.mean(), squared.std()
    )
    assert plug_in.mean() > 5 * abs(squared.mean())


def test_plain_ece_shrinks_with_n_on_calibrated_data():
    """The bias is a small-sample effect: the plain ECE of a calibrated model falls
    with n (about as 1/sqrt(n)), while the debiased square stays centred on 0."""
    means = []
    for n in SIZES:
        count, total, right = per_bin(*trials(n, seed=10 + n))
        means.append(np.mean([metrics.ece_from_bin_statistics(c, s, r)["ece"] for c, s, r in
                              zip(count, total, right, strict=True)]))
    assert means[0] > 1.5 * means[1] > 1.5 * 1.5 * means[2]


@pytest.mark.parametrize("n", SIZES)
def test_smooth_interval_covers_zero(n):
    confidence, correct = trials(n, seed=100 + n)
    covered = 0
    estimates = []
    for trial in range(N_TRIALS):
        out = metrics.smooth_ece_from_confidences(
            confidence[trial], correct[trial], level=LEVEL, n_resamples=200, seed=trial
        )
        covered += out["lower"] <= 0.0 <= out["upper"]
        estimates.append(out["estimate"])
    assert covered >= MIN_COVERED, (n, covered)
    # The point estimate itself is biased upwards (an L1 norm of noise): only the
    # interval is honest at 0.
    assert min(estimates) > 0


def test_intervals_exclude_zero_for_a_miscalibrated_model():
    """Not an interval that always holds 0: an overconfident model (true accuracy
    below the confidence by 0.1 on average) gets a lower bound above 0 at n = 5,000."""
    rng = np.random.default_rng(7)
    confidence = rng.uniform(0.5, 1.0, 5_000)
    correct = rng.random(5_000) < confidence - 0.1 * (confidence - 0.5) * 4
    smooth = metrics.smooth_ece_from_confidences(confidence, correct)
    stats = metrics.bin_statistics(confidence, correct)
    debiased = metrics.debiased_ece_from_bin_statistics(
        stats["count"], stats["confidence_sum"], stats["correct_count"]
    )
    assert smooth["lower"] > 0.02
    assert debiased["lower"] > 0.02


def test_debiased_interval_covers_a_known_nonzero_error():
    """A fixed design with a known binned gap: confidences fixed, outcomes drawn at
    the confidence minus 0.05 in every bin, so the target is exactly 0.05."""
    rng = np.random.default_rng(11)
    n = 2_000
    confidence = rng.uniform(0.3, 0.95, n)
    edges = metrics.bin_edges()
    index = np.searchsorted(edges[1:-1], confidence, side="right")
    covered = 0
    for _ in range(N_TRIALS):
        correct = rng.random(n) < confidence - 0.05
        count = np.bincount(index, minlength=15)
        out = metrics.debiased_ece_from_bin_statistics(
            count, np.bincount(index, confidence, minlength=15),
            np.bincount(index[correct], minlength=15),
        )
        covered += out["lower"] <= 0.05 <= out["upper"]
    assert covered >= MIN_COVERED, covered


# ---------------------------------------------------------------------------
# the smooth ECE against the paper's definition, computed the slow way


T = np.linspace(0.0, 1.0, 40_001)


def reflected_kernel(f: float, sigma: float) -> np.ndarray:
    """K(t, f) on the points T: sum over m in -2..2 of phi_sigma(t - f - 2m) and
    phi_sigma(t + f - 2m)."""
    total = np.zeros_like(T)
    for m in range(-2, 3):
        for centre in (f + 2 * m, -f + 2 * m):
            total += np.exp(-0.5 * ((T - centre) / sigma) ** 2)
    return total / (math.sqrt(2.0 * math.pi) * sigma)


def slow_smooth_ece_at(confidence, outcome, sigma: float) -> float:
    """integral_0^1 |(1/n) sum_i K(t, f_i) (y_i - f_i)| dt: a loop over the rows, each
    adding its own kernel at its exact confidence (no grid of confidences, no FFT),
    integrated by Simpson's rule on 40,001 points."""
    field = np.zeros_like(T)
    for f, y in zip(confidence, outcome, strict=True):
        field += reflected_kernel(f, sigma) * (float(y) - f)
    return float(simpson(np.abs(field / len(confidence)), x=T))


def slow_smooth_ece(confidence, outcome) -> tuple[float, float]:
    """The fixed point sigma = smECE_sigma by plain bisection (30 halvings)."""
    low, high = 1e-3, 1.0
    for _ in range(30):
        middle = 0.5 * (low + high)
        if slow_smooth_ece_at(confidence, outcome, middle) > middle:
            low = middle
        else:
            high = middle
    return slow_smooth_ece_at(confidence, outcome, high), high


@pytest.mark.parametrize(
    ("n", "seed", "shift"), [(12, 0, 0.0), (30, 1, 0.15), (25, 2, -0.2)]
)
def test_smooth_ece_matches_the_definition(n, seed, shift):
    rng = np.random.default_rng(seed)
    confidence = rng.uniform(0.0, 1.0, n)
    confidence[:2] = (0.0, 1.0)  # the mirror images at both ends count
    outcome = rng.random(n) < np.clip(confidence + shift, 0, 1)
    expected, bandwidth = slow_smooth_ece(confidence, outcome)
    out = metrics.smooth_ece_from_confidences(confidence, outcome, n_resamples=10)
    assert out["estimate"] == pytest.approx(expected, rel=2e-3)
    assert out["bandwidth"] == pytest.approx(bandwidth, rel=2e-3)
    assert out["estimate"] == pytest.approx(out["bandwidth"], rel=1e-5)


def test_smooth_ece_top_label_equals_confidences():
    rng = np.random.default_rng(3)
    probs, labels = calibrated_sample(rng, 500)
    a = metrics.smooth_calibration_error(probs, labels, n_resamples=50)
    b = metrics.smooth_ece_from_confidences(
        probs.max(axis=1), probs.argmax(axis=1) == labels, n_resamples=50
    )
    assert a == b


def test_debiased_equals_kumar_formula_by_loop():
    """The bin-statistics formula against a loop over the rows of each bin."""
    rng = np.random.default_rng(5)
    probs, labels = calibrated_sample(rng, 300, k=3)
    out = metrics.debiased_calibration_error(probs, labels, n_bins=10)
    confidence, predicted = probs.max(axis=1), probs.argmax(axis=1)
    expected = 0.0
    for b in range(10):
        rows = [i for i in range(300) if min(int(confidence[i] * 10), 9) == b]
        if len(rows) < 2:
            continue
        acc = sum(predicted[i] == labels[i] for i in rows) / len(rows)
        conf = sum(confidence[i] for i in rows) / len(rows)
        expected += len(rows) / 300 * ((acc - conf) ** 2 - acc * (1 - acc) / (len(rows) - 1))
    assert out["squared"] == pytest.approx(expected, abs=1e-12)
    assert out["estimate"] == pytest.approx(math.sqrt(max(expected, 0.0)), abs=1e-12)


# ---------------------------------------------------------------------------
# input checking


@pytest.mark.parametrize("level", [0.0, 1.0, 1.5, True, "0.9", float("nan")])
def test_bad_level(level):
    with pytest.raises(CalibrationInputError, match="level must be"):
        metrics.debiased_calibration_error([[0.6, 0.4]], [0], level=level)
    with pytest.raises(CalibrationInputError, match="level must be"):
        metrics.smooth_calibration_error([[0.6, 0.4]], [0], level=level)


def test_smooth_confidences_outside_unit_interval():
    with pytest.raises(CalibrationInputError, match=r"confidence must lie in \[0, 1\]"):
        metrics.smooth_ece_from_confidences([0.5, 1.2], [True, False])


def test_report_has_the_intervals_and_keeps_the_old_keys():
    rng = np.random.default_rng(9)
    probs, labels = calibrated_sample(rng, 400)
    out = metrics.report(probs, labels)
    debiased = metrics.debiased_calibration_error(probs, labels)
    smooth = metrics.smooth_calibration_error(probs, labels)
    assert out["ece"] == metrics.expected_calibration_error(probs, labels)
    assert (out["ece_debiased"], out["ece_debiased_lower"], out["ece_debiased_upper"]) == (
        debiased["estimate"], debiased["lower"], debiased["upper"]
    )
    assert (out["smooth_ece"], out["smooth_ece_lower"], out["smooth_ece_upper"]) == (
        smooth["estimate"], smooth["lower"], smooth["upper"]
    )
    assert out["smooth_ece_bandwidth"] == smooth["bandwidth"]
    assert out["interval_level"] == LEVEL
    logits = np.log(probs)
    assert metrics.scores_report(logits, labels)["smooth_ece"] == pytest.approx(
        out["smooth_ece"], rel=1e-9
    )


def test_bounds_stay_in_the_unit_interval_on_tiny_inputs():
    """Three one-hot rows, all wrong: the error is 1 and no bound passes it; one-hot
    rows carry no outcome noise, so the smooth interval is the estimate itself."""
    probs, labels = np.eye(3), [1, 2, 0]
    debiased = metrics.debiased_calibration_error(probs, labels)
    smooth = metrics.smooth_calibration_error(probs, labels)
    assert 0.0 <= debiased["lower"] <= debiased["estimate"] == 1.0 == debiased["upper"]
    assert smooth["lower"] == smooth["estimate"] == smooth["upper"] > 0
