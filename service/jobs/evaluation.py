"""A calibrator on held-out rows, and what the policies make of it.

One home for the rules, used by a fit (:func:`service.jobs.fitting.fit_job`, for each
candidate) and by a version made from posted parameters
(:func:`service.jobs.fitting.import_job`): the hold-out metrics, the argmax report,
the NLL comparison with the raw scores, whether the policies allow it, the warning of
``warn`` and the reasons of a rejection (sentences and codes), stored on the version
at the time of its outcome.

Two policies. The model's ``argmax_policy`` (``require``: no held-out predicted class
may change). And, whatever that policy, the held-out NLL: a calibrator whose held-out
NLL is worse than the uncalibrated scores' (:func:`calibrators.evaluation.checks.nll_report`) by
more than :data:`NLL_RELATIVE_TOLERANCE` of it *and* more than
:data:`NLL_STANDARD_ERRORS` standard errors of the paired per-row difference is
rejected (:data:`~service.vocabulary.NLL_WORSE`). Both conditions, because a hold-out
is a sample: the relative floor ignores differences too small to matter (a large
hold-out makes any difference significant), the standard errors ignore differences the
rows cannot tell from noise (a small hold-out, or one dominated by a few confidently
wrong rows, makes a good calibrator look worse). Temperature scaling fitted on the
shipped real outputs is not rejected, and parameters that serve one-hot probabilities
are once the hold-out has some tens of rows: bench/holdout_policy.py measures both
(bench/README.md, "The held-out NLL policy").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

import calibrators
from calibrators import CalibrationInputError
from calibrators.base import Calibrator
from calibrators.evaluation import checks, metrics
from calibrators.evaluation.holdout import split_indices
from calibrators.methods.prior_shift import PriorShift
from service.errors import InvalidInput
from service.vocabulary import ARGMAX_CHANGED, NLL_WORSE, REJECTION_REASONS, check_text

#: How much worse than the raw scores' held-out NLL a calibrator's may be, relative to
#: the raw NLL, before the difference counts (1%).
NLL_RELATIVE_TOLERANCE = 0.01
#: How many standard errors of the paired per-row difference the held-out NLL of a
#: calibrator must exceed the raw scores' by before it counts (at 4, some temperature
#: fits on subsets of the real outputs were rejected: bench/README.md).
NLL_STANDARD_ERRORS = 5.0

#: The most bytes the ``fit_info`` of posted parameters may take, serialised as it is
#: stored (compact JSON, UTF-8): it is stored with the version and answered by every
#: GET of it. Every method's own ``fit_info`` is far inside these bounds at any K
#: (tests/service/jobs/test_import_bounds.py).
MAX_FIT_INFO_BYTES = 64 * 1024
#: The deepest nesting of objects and arrays in a posted ``fit_info`` (``fit_info``
#: itself is the first level).
MAX_FIT_INFO_DEPTH = 8
#: The longest string (key or value) in a posted ``fit_info``, in characters.
MAX_FIT_INFO_STRING = 1024


def nll_worse(nll: Mapping[str, Any]) -> bool:
    """Whether :func:`calibrators.evaluation.checks.nll_report`'s ``nll`` is worse than the raw
    scores beyond both tolerances (:data:`NLL_RELATIVE_TOLERANCE`,
    :data:`NLL_STANDARD_ERRORS`). One held-out row cannot tell (no standard error)."""
    se = nll["standard_error"]
    if se is None:
        return False
    return nll["difference"] > max(
        NLL_RELATIVE_TOLERANCE * nll["before_loss"], NLL_STANDARD_ERRORS * se
    )


def evaluate(
    cal: Calibrator,
    x_hold: np.ndarray,
    y_hold: np.ndarray,
    *,
    kind: str,
    argmax_policy: str,
    sequences: np.ndarray | None = None,
) -> dict[str, Any]:
    """``metrics`` (calibrators.evaluation.metrics.report of the calibrated held-out rows,
    per sequence too with ``sequences``, the held-out rows' sequence ids),
    ``argmax`` (calibrators.evaluation.checks.argmax_report), ``nll``
    (calibrators.evaluation.checks.nll_report), ``row_nll`` (each held-out row's NLL,
    calibrators.evaluation.metrics.nll_per_row: what ``auto``'s race compares),
    ``rejected_for`` (the reasons the policies refuse it,
    :data:`~service.vocabulary.REJECTION_REASONS`) and ``allowed`` (none)."""
    probs = cal.predict_proba(x_hold, kind=kind)
    argmax = checks.argmax_report(x_hold, probs, kind=kind)
    nll = checks.nll_report(x_hold, probs, y_hold, kind=kind)
    reasons = []
    if argmax_policy == "require" and argmax["changed"]:
        reasons.append(ARGMAX_CHANGED)
    if nll_worse(nll):
        reasons.append(NLL_WORSE)
    return {
        "metrics": metrics.report(probs, y_hold, sequences=sequences),
        "argmax": argmax,
        "nll": nll,
        "row_nll": metrics.nll_per_row(probs, y_hold),
        "rejected_for": reasons,
        "allowed": not reasons,
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


def _worse(method: str, nll: Mapping[str, Any]) -> str:
    before, after, se = nll["before_loss"], nll["after_loss"], nll["standard_error"]
    return (
        f"{method} calibration made the held-out NLL worse than the uncalibrated scores': "
        f"{after:.4g} against {before:.4g} nats on {nll['n']} held-out rows "
        f"(+{nll['difference']:.3g}, {nll['difference'] / se:.3g} standard errors), beyond "
        f"the tolerance of {NLL_RELATIVE_TOLERANCE:.0%} and {NLL_STANDARD_ERRORS:g} standard "
        "errors; a calibrator that does not improve on the raw scores is never served (fit "
        "or import other parameters, on rows they were not fitted on)."
    )


def rejection(
    results: Mapping[str, Mapping[str, Any]], argmax_policy: str
) -> dict[str, list[str] | None]:
    """Why a version whose candidates are ``results`` (method -> :func:`evaluate`'s
    answer) is rejected: its ``rejection`` (one sentence per candidate and reason) and
    ``rejected_for`` (the reasons' codes, each once, in
    :data:`~service.vocabulary.REJECTION_REASONS` order) columns; both None if one of
    the candidates is allowed."""
    if any(r["allowed"] for r in results.values()):
        return {"rejection": None, "rejected_for": None}
    sentences = []
    for m, r in results.items():
        if ARGMAX_CHANGED in r["rejected_for"]:
            sentences.append(
                f"{_changed(m, r['argmax'])}; argmax_policy {argmax_policy!r} allows no change "
                "of predicted class (PATCH the model's argmax_policy to 'warn' or 'off' and "
                "refit to accept it)."
            )
        if NLL_WORSE in r["rejected_for"]:
            sentences.append(_worse(m, r["nll"]))
    codes = {code for r in results.values() for code in r["rejected_for"]}
    return {
        "rejection": sentences,
        "rejected_for": [code for code in REJECTION_REASONS if code in codes],
    }


def from_posted_params(
    params: Mapping[str, Any], num_classes: int, kind: str | None = None
) -> Calibrator:
    """The calibrator of posted ``params`` for a model of ``num_classes`` classes;
    :class:`calibrators.CalibrationInputError` (a 422) for anything else: from
    :func:`calibrators.from_params`, which refuses whatever is not what ``to_params``
    gives (a list where an object belongs, a string where numbers do) in its own words.

    With ``kind`` (the kind of the dataset that evaluates them): params that do not say
    what kind of scores they were fitted on are taken as fitted on it, and params that
    cannot give their one answer for it (vector or matrix scaling of format 1 fitted on
    the other kind) are refused (:class:`calibrators.validation.KindError`)."""
    k = params.get("n_classes")
    if k != num_classes or isinstance(k, bool):
        raise CalibrationInputError(
            f"params n_classes must be the model's number of classes, {num_classes}. "
            f"Got {k!r}."
        )
    cal = calibrators.from_params(dict(params))
    check_fit_info(cal.fit_info_)
    if kind is not None:
        if cal.kind_ is None:
            cal.kind_ = kind
        cal.check_input_kind(kind)
    return cal


def _check_strings(value: Any, depth: int, path: str) -> None:
    """Depth and strings of ``value`` (at ``path`` in fit_info), or InvalidInput."""
    if isinstance(value, str):
        try:  # the one rule of stored text (service.vocabulary)
            check_text(value, f"params fit_info {path}", MAX_FIT_INFO_STRING)
        except ValueError as exc:
            raise InvalidInput(str(exc), limit=MAX_FIT_INFO_STRING) from None
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


def target_rows(cal: Calibrator, hold_idx: np.ndarray, labels: np.ndarray, seed: int) -> np.ndarray:
    """The rows a version is evaluated on: its hold-out rows, except for a prior-shift
    version, which is made for other class priors than the hold-out's: it is evaluated
    on the hold-out importance-resampled to the priors it corrects to (each row drawn
    with probability proportional to the weight of its label, with replacement, as many
    rows as the hold-out, ``default_rng(seed)``), and so are the uncalibrated scores it
    is compared with. On the hold-out as it is, a correction for a real shift is worse
    than the raw scores by construction, and the NLL policy would refuse every one."""
    if not isinstance(cal, PriorShift) or not np.any(cal.log_weight_):
        return hold_idx
    weight = np.exp(cal.log_weight_)[labels[hold_idx]]
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(hold_idx, size=hold_idx.size, p=weight / weight.sum()))


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
    sequences: np.ndarray | None = None,
) -> dict[str, Any]:
    """The outcome of a version made from posted ``params``: evaluated on the hold-out
    rows of ``scores``/``labels`` (the split of a fit with the same holdout, seed and
    ``sequences``, the dataset's sequence ids; resampled to its priors for a prior-shift
    version, :func:`target_rows`) and policed like a fitted one. The
    columns :func:`service.jobs.fitting.fit_job` returns (status succeeded or rejected,
    chosen_method, params, metrics, argmax, warning, rejection, rejected_for), without
    the fit's own (candidates, fit_seconds)."""
    cal = from_posted_params(params, num_classes, kind)
    _, hold_idx = split_indices(labels.shape[0], holdout, seed, groups=sequences)
    hold_idx = target_rows(cal, hold_idx, labels, seed)
    x_hold, y_hold = np.asarray(scores[hold_idx]), labels[hold_idx]
    s_hold = None if sequences is None else np.asarray(sequences[hold_idx])
    result = evaluate(
        cal, x_hold, y_hold, kind=kind, argmax_policy=argmax_policy, sequences=s_hold
    )
    return {
        "status": "succeeded" if result["allowed"] else "rejected",
        "chosen_method": cal.method,
        "params": cal.to_params(),
        "metrics_before": metrics.scores_report(x_hold, y_hold, kind, sequences=s_hold),
        "metrics_after": result["metrics"],
        "argmax": result["argmax"],
        "warning": warning(cal.method, result["argmax"], argmax_policy),
        **rejection({cal.method: result}, argmax_policy),
    }
