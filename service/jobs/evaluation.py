"""A calibrator on held-out rows, and what the model's argmax policy makes of it.

One home for the rule, used by a fit (:func:`service.jobs.fitting.fit_job`, for each
candidate) and by a version made from posted parameters
(:func:`service.jobs.fitting.import_job`): the hold-out metrics, the
argmax report, whether the policy allows it, the warning of ``warn`` and the reasons
of a rejection, stored on the version at the time of its outcome.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

import calibrators
from calibrators import CalibrationInputError, checks, metrics
from calibrators.base import Calibrator
from calibrators.holdout import split_indices
from service.errors import InvalidInput

#: The most bytes the ``fit_info`` of posted parameters may take, serialised as it is
#: stored (compact JSON, UTF-8): it is stored with the version and answered by every
#: GET of it. Every method's own ``fit_info`` is far inside these bounds at any K
#: (tests/service/test_import_bounds.py).
MAX_FIT_INFO_BYTES = 64 * 1024
#: The deepest nesting of objects and arrays in a posted ``fit_info`` (``fit_info``
#: itself is the first level).
MAX_FIT_INFO_DEPTH = 8
#: The longest string (key or value) in a posted ``fit_info``, in characters.
MAX_FIT_INFO_STRING = 1024
#: Characters refused in ``fit_info``'s strings: C0 and C1 controls (newline and tab
#: included) and the bidirectional marks, embeddings, overrides and isolates that
#: reorder text in a terminal or a log ("Trojan Source", CVE-2021-42574).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


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
    cal = calibrators.from_params(dict(params))
    check_fit_info(cal.fit_info_)
    return cal


def _check_strings(value: Any, depth: int, path: str) -> None:
    """Depth and strings of ``value`` (at ``path`` in fit_info), or InvalidInput."""
    if isinstance(value, str):
        if len(value) > MAX_FIT_INFO_STRING:
            raise InvalidInput(
                f"params fit_info strings hold at most {MAX_FIT_INFO_STRING} characters. "
                f"Got {len(value)} at {path}.",
                limit=MAX_FIT_INFO_STRING,
            )
        bad = _UNSAFE.search(value)
        if bad is not None:
            raise InvalidInput(
                "params fit_info strings may not hold control or bidirectional-override "
                f"characters. Got U+{ord(bad.group()):04X} at {path}."
            )
        return
    if not isinstance(value, dict | list):
        return
    if depth >= MAX_FIT_INFO_DEPTH:
        raise InvalidInput(
            f"params fit_info nests objects and arrays at most {MAX_FIT_INFO_DEPTH} deep. "
            f"Got deeper at {path}.",
            limit=MAX_FIT_INFO_DEPTH,
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, depth + 1, f"{path} (a key)")
            _check_strings(item, depth + 1, f"{path}.{key[:40]}")
    else:
        for i, item in enumerate(value):
            _check_strings(item, depth + 1, f"{path}[{i}]")


def check_fit_info(fit_info: Mapping[str, Any]) -> None:
    """Refuse (:class:`service.errors.InvalidInput`, a 422) the ``fit_info`` of posted
    parameters unless it is small and plain: at most :data:`MAX_FIT_INFO_DEPTH` deep,
    strings of at most :data:`MAX_FIT_INFO_STRING` characters without control or
    bidirectional-override characters, numbers the stored JSON can hold (integers
    within 64 bits), and :data:`MAX_FIT_INFO_BYTES` serialised. It is stored and
    answered with the version: facts about a fit, not a place for payloads."""
    try:  # the size first: it bounds the walk below
        size = len(orjson.dumps(fit_info))
    except orjson.JSONEncodeError as exc:  # an integer beyond 64 bits, or nesting past 255
        _check_strings(dict(fit_info), 0, "fit_info")
        raise InvalidInput(
            f"params fit_info must be JSON the service can store. Got {exc}."
        ) from None
    if size > MAX_FIT_INFO_BYTES:
        raise InvalidInput(
            f"params fit_info takes at most {MAX_FIT_INFO_BYTES} bytes as JSON. Got {size}.",
            limit=MAX_FIT_INFO_BYTES,
        )
    _check_strings(dict(fit_info), 0, "fit_info")


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
