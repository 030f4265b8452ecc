"""Issue 21's bar on the shared CIFAR outputs, on the 5-split protocol.

For seeds 0 to 4 the service's fit job runs ``auto`` under ``argmax_policy="off"``
with ``holdout=0.5`` on a whole file: every method is fitted with its defaults on
the first half of ``split_indices(N, 0.5, seed)`` and scored on the second half,
which is the protocol. Over the five splits,

* every method's mean held-out NLL is at most temperature scaling's + ``MARGIN``
  (the penalised searches start at temperature scaling and can choose it);
* the held-out NLL of ``auto``'s choice (a race over the two halves) is within
  ``MARGIN`` of the best single method's: no candidate is skipped, rejected or
  lost on the way.

One job per split gives both (the fits are the slowest part of the suite's
real-data tests). And the strict reading: ``auto`` given only the fit half, with
its defaults (its own inner hold-out of 0.2, its race, its refit), scored on the
other half. ``bench/search_splits.py`` prints the same tables for both files.
"""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators.evaluation.holdout import DEFAULT_HOLDOUT, split_indices
from calibrators.evaluation.metrics import nll_loss
from service.jobs.fitting import auto_candidates, fit_job
from tests.helpers import load_shared

SEEDS = (0, 1, 2, 3, 4)
MARGIN = 0.002
#: Every method auto tries under "off": all but those that learn nothing from labels.
LEARNERS = auto_candidates("off")


def held_out_nll(cal, probs, labels) -> float:
    return nll_loss(cal.predict_proba(probs, kind="probabilities"), labels)


def five_splits(stem: str) -> tuple[dict[str, float], float]:
    """Each method's mean held-out NLL over the splits, and auto's."""
    data = load_shared(stem)
    nll = {m: [] for m in LEARNERS}
    auto = []
    for seed in SEEDS:
        job = fit_job(data.probs, data.labels, kind="probabilities", method="auto",
                      holdout=0.5, seed=seed, options={}, argmax_policy="off", refit=False)
        assert set(job["candidates"]) == set(LEARNERS), job["warning"]
        for m, candidate in job["candidates"].items():
            nll[m].append(candidate["metrics"]["nll"])
        auto.append(job["metrics_after"]["nll"])
    return {m: float(np.mean(v)) for m, v in nll.items()}, float(np.mean(auto))


@pytest.mark.slow
@pytest.mark.parametrize("stem", ["wideresnet-16-4-cifar-100", "lenet-5-cifar-10"])
def test_no_method_loses_to_temperature_and_auto_keeps_up_with_the_best(stem):
    means, auto = five_splits(stem)
    table = ", ".join(f"{m} {v:.4f}" for m, v in means.items())
    worse = {m: v for m, v in means.items() if v > means["temperature"] + MARGIN}
    assert not worse, f"{stem}: worse than temperature + {MARGIN}: {worse} ({table})"
    best = min(means, key=means.get)
    assert auto <= means[best] + MARGIN, (
        f"{stem}: auto {auto:.4f} against the best single method, {best} {means[best]:.4f} "
        f"({table})"
    )


@pytest.mark.slow
def test_auto_given_only_the_fit_half_keeps_up_with_the_best():
    """The strict reading of ``auto`` on the protocol: given only the fit half, with
    the service's defaults (inner hold-out 0.2, seed 0, the race over folds, the refit
    of its choice on the whole fit half), scored on the other half, its mean is within
    ``MARGIN`` of the best single method fitted on the fit half. On lenet-5-cifar-10,
    where the methods are closest (K = 10) and the fits are quick; CIFAR-100's figure
    (minutes of fits) is bench/search_splits.py's, in bench/README.md. One hold-out
    without the race missed here (+0.0051 served as fitted on 80% of the fit half,
    +0.0012 refitted: bench/README.md)."""
    data = load_shared("lenet-5-cifar-10")
    nll = {m: [] for m in LEARNERS}
    auto = []
    for seed in SEEDS:
        fit, test = split_indices(len(data.labels), 0.5, seed)
        p_fit, y_fit = data.probs[fit], data.labels[fit]
        for m in LEARNERS:
            cal = calibrators.create(m).fit(p_fit, y_fit, kind="probabilities")
            nll[m].append(held_out_nll(cal, data.probs[test], data.labels[test]))
        job = fit_job(p_fit, y_fit, kind="probabilities", method="auto",
                      holdout=DEFAULT_HOLDOUT, seed=0, options={}, argmax_policy="off")
        served = calibrators.from_params(job["params"])
        auto.append(held_out_nll(served, data.probs[test], data.labels[test]))
    means = {m: float(np.mean(v)) for m, v in nll.items()}
    best = min(means, key=means.get)
    assert float(np.mean(auto)) <= means[best] + MARGIN, (
        f"auto {np.mean(auto):.4f} against {best} {means[best]:.4f} ({means})"
    )
