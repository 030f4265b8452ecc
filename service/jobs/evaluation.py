"""A calibrator on held-out rows, and what the model's argmax policy makes of it.

One home for the rule, used by a fit (:func:`service.jobs.fitting.fit_job`, for each
candidate) and by a version made from posted parameters
(:func:`service.jobs.fitting.import_job`): the hold-out metrics, the
argmax report, whether the policy allows it, the warning of ``warn`` and the reasons
of a rejection, stored on the version at the time of its outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

import calibrators
from calibrators import CalibrationInputError, checks, metrics
from calibrators.base import Calibrator
from calibrators.holdout import split_indices


def evaluate(
    cal: Calibrator, x_hold: np.ndarray, y_hold: np.ndarray, *, kind: str, argmax_policy: str
) -> dict[str, Any]:
    """``metrics`` (calibrators.metrics.report of the calibrated held-out rows),
    ``argmax`` (calibrators.checks.argmax_report) and ``allowed`` (by the policy)."""
    probs = cal.predict_proba(x_hold, kind=kind)
    argmax = checks.argmax_report(x_hold, probs, kind=kind)
    return {
        "metrics": metrics.report(probs, y_hold),
        "argmax": argmax,
        "allowed": argmax_policy != "require" or argmax["changed"] == 0,
    }


def _changed(method: str, argmax: Mapping[str, Any]) -> str:
    ranks = ", ".join(
        f"{count} from rank {rank}" for rank, count in argmax["changed_from_rank"].items() if count
    )
    return (
        f"{method} calibration changed the predicted class of {argmax['changed']} of "
        f"{argmax['n']} held-out rows (the new class's rank in the raw scores: {ranks})"
    )


def warning(method: str, argmax: Mapping[str, Any], argmax_policy: str) -> str | None:
    """The warning of a version allowed by ``warn`` although it changes predicted classes."""
    if argmax_policy != "warn" or not argmax["changed"]:
        return None
    return f"{_changed(method, argmax)}; argmax_policy 'warn' allows it."


def rejection(results: Mapping[str, Mapping[str, Any]], argmax_policy: str) -> list[str] | None:
    """Why the policy rejects a version whose candidates are ``results`` (method ->
    :func:`evaluate`'s answer): one sentence per candidate, or None if one is allowed."""
    if any(r["allowed"] for r in results.values()):
        return None
    return [
        f"{_changed(m, r['argmax'])}; argmax_policy {argmax_policy!r} allows no change of "
        "predicted class (PATCH the model's argmax_policy to 'warn' or 'off' and refit "
        "to accept it)."
        for m, r in results.items()
    ]


def from_posted_params(params: Mapping[str, Any], num_classes: int) -> Calibrator:
    """The calibrator of posted ``params`` for a model of ``num_classes`` classes;
    :class:`calibrators.CalibrationInputError` (a 422) for anything else: from
    :func:`calibrators.from_params`, which refuses whatever is not what ``to_params``
    gives (a list where an object belongs, a string where numbers do) in its own words."""
    k = params.get("n_classes")
    if k != num_classes or isinstance(k, bool):
        raise CalibrationInputError(
            f"params n_classes must be the model's number of classes, {num_classes}. "
            f"Got {k!r}."
        )
    return calibrators.from_params(dict(params))


def evaluate_params(
    params: Mapping[str, Any],
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    kind: str,
    holdout: float,
    seed: int,
    argmax_policy: str,
) -> dict[str, Any]:
    """The outcome of a version made from posted ``params``: evaluated on the hold-out
    rows of ``scores``/``labels`` (the split of a fit with the same holdout and seed)
    and policed like a fitted one. The columns :func:`service.jobs.fitting.fit_job`
    returns (status succeeded or rejected, chosen_method, params, metrics, argmax,
    warning, rejection), without the fit's own (candidates, fit_seconds)."""
    cal = from_posted_params(params, num_classes)
    _, hold_idx = split_indices(labels.shape[0], holdout, seed)
    x_hold, y_hold = np.asarray(scores[hold_idx]), labels[hold_idx]
    result = evaluate(cal, x_hold, y_hold, kind=kind, argmax_policy=argmax_policy)
    return {
        "status": "succeeded" if result["allowed"] else "rejected",
        "chosen_method": cal.method,
        "params": cal.to_params(),
        "metrics_before": metrics.scores_report(x_hold, y_hold, kind),
        "metrics_after": result["metrics"],
        "argmax": result["argmax"],
        "warning": warning(cal.method, result["argmax"], argmax_policy),
        "rejection": rejection({cal.method: result}, argmax_policy),
    }
