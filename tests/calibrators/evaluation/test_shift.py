"""calibrators.evaluation.shift: expected accuracy and label shift. The formulas against
direct computations, coverage by simulation, and issue 23's acceptance on the shared
CIFAR outputs (five splits of the quality protocol)."""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators.evaluation import shift
from calibrators.evaluation.holdout import split_indices
from calibrators.validation import CalibrationInputError
from tests.oracles import shifted_sample, softmax

SEEDS = range(5)


def calibrated(rng: np.random.Generator, n: int, k: int = 5):
    """Probabilities and labels drawn from them (calibrated by construction)."""
    logits = rng.normal(scale=1.5, size=(n, k))
    probs = softmax(logits)
    labels = np.minimum((rng.random((n, 1)) > probs.cumsum(axis=1)).sum(axis=1), k - 1)
    return probs, labels


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(np.log(probs[np.arange(labels.size), labels])))


# ---------------------------------------------------------------------------
# expected accuracy


def test_expected_accuracy_is_the_mean_confidence_with_the_poisson_binomial_variance():
    rng = np.random.default_rng(0)
    probs, _ = calibrated(rng, 300)
    c = probs.max(axis=1)
    out = shift.expected_accuracy(probs, level=0.9)
    assert out["estimate"] == pytest.approx(c.mean())
    assert out["std"] == pytest.approx(np.sqrt(np.sum(c * (1 - c))) / c.size)
    assert out["upper"] - out["estimate"] == pytest.approx(1.6448536 * out["std"])
    assert out["holdout_gap"] is None


def test_the_sums_add_up_across_batches():
    rng = np.random.default_rng(1)
    probs, _ = calibrated(rng, 500)
    parts = [shift.confidence_sums(part) for part in np.array_split(probs, 7)]
    total = np.sum(parts, axis=0)
    whole = shift.expected_accuracy(probs)
    again = shift.expected_accuracy_from_sums(int(total[0]), total[1], total[2])
    assert again["estimate"] == pytest.approx(whole["estimate"])
    assert again["std"] == pytest.approx(whole["std"])


def test_the_interval_covers_the_realised_accuracy_of_calibrated_rows():
    rng = np.random.default_rng(2)
    covered = 0
    for _ in range(200):
        probs, labels = calibrated(rng, 400)
        out = shift.expected_accuracy(probs)
        realised = np.mean(probs.argmax(axis=1) == labels)
        covered += out["lower"] <= realised <= out["upper"]
    assert covered >= 180  # a 95 % interval; Binomial(200, 0.95) < 180 w.p. about 1e-3


def test_the_holdout_gap_moves_the_estimate_and_widens_the_interval():
    probs = np.array([[0.9, 0.1], [0.2, 0.8]] * 50)
    plain = shift.expected_accuracy(probs)
    holdout = {"n": 100, "correct": 80, "confidence_sum": 85.0}
    out = shift.expected_accuracy(probs, holdout=holdout)
    assert out["holdout_gap"] == pytest.approx(-0.05)
    assert out["estimate"] == pytest.approx(plain["estimate"] - 0.05)
    assert out["std"] ** 2 == pytest.approx(plain["std"] ** 2 + 0.8 * 0.2 / 100)


@pytest.mark.parametrize(
    "args",
    [(-1, 0.0, 0.0), (10, 11.0, 5.0), (10, 5.0, 6.0), (10, float("nan"), 1.0), (1.5, 1.0, 1.0)],
)
def test_impossible_sums_are_refused(args):
    with pytest.raises(CalibrationInputError):
        shift.expected_accuracy_from_sums(*args)


def test_no_rows_no_estimate():
    out = shift.expected_accuracy_from_sums(0, 0.0, 0.0)
    assert out["estimate"] is None and out["lower"] is None and out["n"] == 0


def test_expected_accuracy_on_the_unshifted_test_half(shared):
    """Issue 23's acceptance: fitted as the service fits (temperature scaling on 80 % of
    the fit half, its top-label gap measured on the other 20 %), the expected accuracy
    of the test half covers its realised accuracy on each of the five splits."""
    probs, labels = shared.probs, shared.labels
    for seed in SEEDS:
        perm = np.random.default_rng(seed).permutation(labels.size)
        fit, test = perm[: labels.size // 2], perm[labels.size // 2 :]
        train, hold = split_indices(fit.size, 0.2, seed=seed)
        cal = calibrators.create("temperature").fit(
            probs[fit[train]], labels[fit[train]], kind="probabilities"
        )
        holdout = shift.holdout_sums(
            cal.predict_proba(probs[fit[hold]], kind="probabilities"), labels[fit[hold]]
        )
        served = cal.predict_proba(probs[test], kind="probabilities")
        out = shift.expected_accuracy(served, holdout=holdout)
        realised = np.mean(served.argmax(axis=1) == labels[test])
        assert out["lower"] <= realised <= out["upper"], (shared.name, seed, out, realised)


# ---------------------------------------------------------------------------
# label shift


def test_bbse_recovers_known_priors_from_exact_frequencies():
    confusion = np.array([[30, 5, 2], [6, 20, 3], [4, 5, 25]])
    q = np.array([0.6, 0.1, 0.3])
    source = confusion.sum(axis=0) / confusion.sum()
    served = (confusion / confusion.sum()) @ (q / source) * 1e6
    out = shift.bbse(confusion, served)
    np.testing.assert_allclose(out["priors"], q, atol=1e-9)
    np.testing.assert_allclose(out["source_priors"], source)
    assert all(lo <= p <= hi for lo, p, hi in zip(out["lower"], q, out["upper"], strict=True))


def test_bbse_clips_negative_weights_and_smooths_the_correction():
    confusion = np.array([[40, 10], [10, 40]])
    out = shift.bbse(confusion, [100, 0])  # more skewed than any prior explains
    assert out["priors"] == [1.0, 0.0]
    assert 0.0 < out["weights"][1] < 0.1 and out["weights"][0] > 1.0


def test_bbse_interval_covers_at_its_level():
    """Simulated label shift (rows of a calibrated pool resampled by class, so p(x | y)
    is the pool's): the delta-method interval of each prior covers the drawn prior in
    about 95 % of (trial, class) pairs, with hold-out and served rows both random."""
    rng = np.random.default_rng(3)
    probs, labels = calibrated(rng, 200_000, k=4)
    hits = total = 0
    for trial in range(100):
        hold = rng.choice(labels.size, 2000, replace=False)
        rows, priors = shifted_sample(labels, trial, concentration=2.0, n=2000)
        out = shift.bbse(
            shift.confusion_counts(probs[hold], labels[hold]), shift.predicted_counts(probs[rows])
        )
        inside = (np.array(out["lower"]) <= priors) & (priors <= np.array(out["upper"]))
        hits += int(inside.sum())
        total += inside.size
    assert hits / total >= 0.9, hits / total


def test_a_singular_confusion_matrix_is_refused():
    with pytest.raises(CalibrationInputError, match="singular"):
        shift.bbse([[10, 10], [10, 10]], [5, 5])


def test_shift_verdict_under_no_shift_holds_its_size():
    rng = np.random.default_rng(4)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    alarms = sum(
        shift.shift_test(rng.multinomial(3000, p), rng.multinomial(3000, p))["verdict"] == "shift"
        for _ in range(300)
    )
    assert alarms <= 9  # alpha 0.01: 3 expected, Binomial(300, 0.01) > 9 w.p. about 1e-3


def test_shift_verdict_needs_enough_rows():
    out = shift.shift_test([500, 500], [100, 0])
    assert out["verdict"] == "insufficient_data" and out["p_value"] is None


def test_em_finds_the_priors_of_calibrated_shifted_rows():
    rng = np.random.default_rng(5)
    q = np.array([0.55, 0.25, 0.15, 0.05])
    # Calibrated under uniform priors, then shifted: p(y|x) of the source, rows of q.
    probs, labels = calibrated(rng, 200_000, k=4)
    keep = rng.random(labels.size) < (q / q.max())[labels]
    out = shift.em_priors(probs[keep], np.full(4, 0.25))
    truth = np.bincount(labels[keep], minlength=4) / keep.sum()
    assert out["converged"]
    assert shift.prior_l1_error(out["priors"], truth) < 0.02


def test_correct_priors_is_bayes_rule():
    p = np.array([[0.2, 0.3, 0.5]])
    out = shift.correct_priors(p, [2.0, 1.0, 0.5])
    np.testing.assert_allclose(out, [[0.4, 0.3, 0.25]] / np.float64(0.95))


def test_corrected_nll_is_lower_under_label_shift(shared):
    """Issue 23's acceptance: on each split, the test half resampled to Dirichlet(0.5)
    priors, BBSE with the fit half's confusion matrix from the served predictions alone;
    the prior-corrected probabilities (served by the prior-shift method) have a lower
    NLL than the uncorrected ones, and the predicted mix is found to have moved."""
    probs, labels = shared.probs, shared.labels
    for seed in SEEDS:
        perm = np.random.default_rng(seed).permutation(labels.size)
        fit, test = perm[: labels.size // 2], perm[labels.size // 2 :]
        base = calibrators.create("temperature").fit(probs[fit], labels[fit], kind="probabilities")
        fitted = base.predict_proba(probs[fit], kind="probabilities")
        rows, _ = shifted_sample(labels[test], seed)
        scores, truth = probs[test][rows], labels[test][rows]
        served = base.predict_proba(scores, kind="probabilities")
        counts = shift.predicted_counts(served)
        out = shift.bbse(shift.confusion_counts(fitted, labels[fit]), counts)
        corrected = calibrators.PriorShift.from_base(base, out["weights"])
        after = corrected.predict_proba(scores, kind="probabilities")
        assert nll(after, truth) < nll(served, truth), (shared.name, seed)
        verdict = shift.shift_test(shift.predicted_counts(fitted), counts)["verdict"]
        assert verdict == "shift", (shared.name, seed)
