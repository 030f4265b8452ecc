"""service.observe.label_shift: the estimate above 1,000 classes (the most served classes
plus 'other'), the weights it gives every class, and the proposal's params."""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators.evaluation import shift
from calibrators.methods.prior_shift import PriorShift
from service.observe import label_shift
from service.observe.served import EXACT_CLASSES, OTHER, kept_counts


def pairs_of(confusion: np.ndarray) -> np.ndarray:
    """(predicted, true) of rows counted by ``confusion`` (rows: predicted)."""
    k = confusion.shape[0]
    flat = np.repeat(np.arange(k * k), confusion.ravel())
    return np.stack([flat // k, flat % k])


def test_up_to_the_limit_every_class_is_estimated():
    confusion = np.diag([40, 30, 30]) + 5
    classes, joint, counts = label_shift.coarsen(pairs_of(confusion), {0: 7, 2: 3}, 3)
    assert classes.tolist() == [0, 1, 2] and counts.tolist() == [7, 0, 3]
    assert (joint == confusion).all()


def test_above_the_limit_the_most_served_classes_and_other():
    """K = 1,200 with a diagonal-heavy confusion: the coarsened matrix keeps every count,
    the served counts (as a flush keeps them) are the tracked classes plus 'other', and
    BBSE on them finds the priors of the tracked classes and of the group."""
    k = EXACT_CLASSES + 200
    rng = np.random.default_rng(0)
    source = np.full(k, 1.0 / k)
    confusion = np.round(np.diag(source * 200_000) * 0.9 + source[None, :] * 200_000 * 0.1 / k)
    confusion = confusion.astype(np.int64)
    target = rng.dirichlet(np.full(k, 0.5))
    mu = (confusion / confusion.sum()) @ (target / source)
    served = kept_counts(np.round(mu / mu.sum() * 1_000_000).astype(np.int64))
    assert OTHER in served and len(served) == EXACT_CLASSES + 1
    pairs = pairs_of(confusion)
    classes, joint, counts = label_shift.coarsen(pairs, served, k)
    assert classes[-1] == OTHER and classes.size == EXACT_CLASSES + 1
    assert joint.sum() == confusion.sum() and counts.sum() == sum(served.values())
    out = label_shift.estimate(pairs, served, k)
    assert out["classes"] == classes.tolist() and out["estimate"] is not None
    tracked = classes[:-1]
    truth = np.append(target[tracked], 1.0 - target[tracked].sum())
    assert shift.prior_l1_error(out["estimate"]["priors"], truth) < 0.05
    weights = label_shift.class_weights(out["classes"], out["estimate"]["weights"], k)
    assert weights.shape == (k,) and (weights > 0).all()
    rest = np.setdiff1d(np.arange(k), tracked)
    assert np.all(weights[rest] == out["estimate"]["weights"][-1])
    assert np.allclose(weights[tracked], out["estimate"]["weights"][:-1])


def test_a_singular_hold_out_gives_a_verdict_and_no_estimate():
    confusion = np.array([[10, 10], [0, 0]])  # class 1 is never predicted
    out = label_shift.estimate(pairs_of(confusion), {0: 300}, 2)
    assert out["estimate"] is None and "singular" in out["unidentified"]
    assert out["verdict"]["verdict"] in ("shift", "no_shift")


@pytest.mark.parametrize("stacked", [False, True])
def test_the_proposal_is_the_served_calibrator_plus_log_weights(stacked):
    """Over a prior-shift version, the correction starts from its base (the weights are
    relative to the hold-out's priors whatever served the rows)."""
    rng = np.random.default_rng(1)
    z, y = rng.normal(size=(120, 4)) * 3, rng.integers(0, 4, 120)
    base = calibrators.create("temperature").fit(z, y)
    served = PriorShift.from_base(base, [2.0, 1.0, 1.0, 1.0]) if stacked else base
    w = np.array([0.5, 1.0, 2.0, 1.5])
    params = label_shift.corrected_params(served.to_params(), w)
    got = calibrators.from_params(params)
    assert isinstance(got, PriorShift)
    assert np.allclose(got.predict_proba(z), shift.correct_priors(base.predict_proba(z), w))
