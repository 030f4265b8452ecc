"""Label shift and label-free accuracy on the shared CIFAR outputs (issue 23, items 2-3).

For each file and each split of the quality protocol (``default_rng(seed).permutation``,
fit half / test half, seeds 0 to 4), temperature scaling is fitted on the fit half.

Label shift: the test half is resampled to skewed class priors (Dirichlet(0.5) over the
classes, seeded by the split's seed: ``tests.oracles.shifted_sample``), and the priors
of the resampled rows are estimated from their predictions alone:
BBSE with the fit half's confusion matrix (``calibrators.evaluation.shift.bbse``, what
the service can do from counts) and, for comparison, EM on the calibrated rows
(``em_priors``, which needs the rows). Printed: the L1 error of each estimate against
the resampled rows' class frequencies, the share of classes whose BBSE interval holds
the true frequency, and the NLL of the served probabilities uncorrected, corrected with
BBSE's weights (the ``prior-shift`` method) and with EM's.

Label-free accuracy on the unshifted test half: temperature fitted on 80 % of the fit
half, its top-label gap measured on the other 20 % (as a fit job holds out); the mean
confidence alone and with the gap, against the realised accuracy, in standard errors.

Usage::

    .venv/bin/python bench/label_shift.py          # about ten seconds
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrators
from calibrators.evaluation import shift
from calibrators.evaluation.holdout import split_indices
from tests.helpers import DATA_DIR
from tests.oracles import shifted_sample

FILES = ("lenet-5-cifar-10", "wideresnet-16-4-cifar-100")
SEEDS = range(5)


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(np.log(probs[np.arange(labels.size), labels])))


def label_shift(probs: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, float]:
    perm = np.random.default_rng(seed).permutation(labels.size)
    fit, test = perm[: labels.size // 2], perm[labels.size // 2 :]
    base = calibrators.create("temperature").fit(probs[fit], labels[fit], kind="probabilities")
    fitted = base.predict_proba(probs[fit], kind="probabilities")
    rows, _ = shifted_sample(labels[test], seed)
    scores, truth = probs[test][rows], labels[test][rows]
    served = base.predict_proba(scores, kind="probabilities")
    frequencies = np.bincount(truth, minlength=probs.shape[1]) / truth.size
    out = shift.bbse(shift.confusion_counts(fitted, labels[fit]), shift.predicted_counts(served))
    source = np.bincount(labels[fit], minlength=probs.shape[1]) / fit.size
    em = shift.em_priors(served, source)
    corrected = calibrators.PriorShift.from_base(base, out["weights"])
    inside = (np.array(out["lower"]) <= frequencies) & (frequencies <= np.array(out["upper"]))
    return {
        "l1_bbse": shift.prior_l1_error(out["priors"], frequencies),
        "l1_em": shift.prior_l1_error(em["priors"], frequencies),
        "covered": float(inside.mean()),
        "nll": nll(served, truth),
        "nll_bbse": nll(corrected.predict_proba(scores, kind="probabilities"), truth),
        "nll_em": nll(shift.correct_priors(served, em["weights"]), truth),
    }


def expected_accuracy(probs: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, float]:
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
    realised = float(np.mean(served.argmax(axis=1) == labels[test]))
    plain = shift.expected_accuracy(served)
    adjusted = shift.expected_accuracy(served, holdout=holdout)
    return {
        "realised": realised,
        "plain": plain["estimate"],
        "plain_z": (realised - plain["estimate"]) / plain["std"],
        "adjusted": adjusted["estimate"],
        "adjusted_z": (realised - adjusted["estimate"]) / adjusted["std"],
    }


def summary(values: list[float], digits: int = 4) -> str:
    return f"{np.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def main() -> None:
    for name in FILES:
        with np.load(DATA_DIR / f"{name}.npz") as f:
            probs, labels = f["predictions"], f["ground_truth"]
        shifted = [label_shift(probs, labels, seed) for seed in SEEDS]
        print(f"{name}: label shift, Dirichlet(0.5), mean [min, max] over seeds 0-4")
        for key in ("l1_bbse", "l1_em", "covered", "nll", "nll_bbse", "nll_em"):
            print(f"  {key:9s} {summary([r[key] for r in shifted])}")
        unshifted = [expected_accuracy(probs, labels, seed) for seed in SEEDS]
        print(f"{name}: expected accuracy on the unshifted test half")
        for key in ("realised", "plain", "plain_z", "adjusted", "adjusted_z"):
            print(f"  {key:10s} {summary([r[key] for r in unshifted])}")


if __name__ == "__main__":
    main()
