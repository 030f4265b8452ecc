"""The fit itself and the checks made before it is queued.

:func:`fit_job` is pure numerics (no database): split, fit every candidate, evaluate
on the hold-out, police the argmax. It is the same function whichever queue and
worker run it (:mod:`service.jobs.attempts`), so it is tested directly.
:func:`check_fit_request` and :func:`affordable` run at submission, so bad options
and fits no worker can hold are a 422 then, not a failed job later.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import calibrators
from calibrators import metrics
from calibrators.holdout import split_indices, split_sizes
from service.errors import FitTooLarge
from service.jobs import evaluation
from service.vocabulary import AUTO

log = logging.getLogger("welltempered.fits")


def check_fit_request(method: str, options: dict[str, Any]) -> None:
    """Build the calibrator(s) once, so bad options are a 422 now, not a failed job later."""
    if method == AUTO:
        unknown = set(options) - set(calibrators.METHODS)
        if unknown:
            raise calibrators.CalibrationInputError(
                "options of an 'auto' fit are keyed by method "
                f"({', '.join(calibrators.METHODS)}). Got {sorted(unknown)!r}."
            )
        for m in calibrators.METHODS:
            _create(m, options.get(m) or {})
    else:
        _create(method, options)


def _create(method: str, options: Any):
    if not isinstance(options, dict):
        raise calibrators.CalibrationInputError(
            f"options for {method!r} must be an object. Got {options!r}."
        )
    return calibrators.create(method, **options)  # unknown or bad options: the error says


def auto_candidates(argmax_policy: str) -> tuple[str, ...]:
    """The methods an ``auto`` fit tries and chooses among by held-out NLL.

    Under ``require`` only the methods that keep every argmax by construction
    (``preserves_argmax``): the others would be fitted only to be rejected.
    Temperature scaling is one of them, so ``auto`` is never worse than it on the
    held-out NLL. Under ``warn`` and ``off``, every method.
    """
    if argmax_policy == "require":
        return tuple(m for m, cls in calibrators.CALIBRATORS.items() if cls.preserves_argmax)
    return tuple(calibrators.METHODS)


def memory_budget(configured: int | None, fit_workers: int) -> int:
    """Bytes one fit may use: the setting, or half the physical memory per fit worker."""
    if configured:
        return configured
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical // (2 * max(1, fit_workers))


def job_bytes(
    method: str, options: dict[str, Any], n_fit: int, n_hold: int, k: int, itemsize: int
) -> int:
    """Memory estimate of one candidate's fit job, its scores included.

    The calibrator's own model (:func:`calibrators.estimate_cost`: working memory and
    the fit rows) plus what the job holds beside it: the held-out rows and two
    float64 probability arrays of them (before and after calibration).
    """
    fit = calibrators.estimate_cost(method, n_fit, k, options, itemsize=itemsize)
    return fit.total_bytes + n_hold * k * (itemsize + 2 * 8)


def _largest_k(method, options, n_fit, n_hold, k, itemsize, budget) -> int:
    """The largest K <= k whose :func:`job_bytes` fits ``budget`` (bisection; 0 if none)."""
    lo, hi = 1, k  # job_bytes(lo) fits (or lo = 1: none does), job_bytes(hi) does not
    if job_bytes(method, options, n_fit, n_hold, 2, itemsize) > budget:
        return 0
    lo = 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if job_bytes(method, options, n_fit, n_hold, mid, itemsize) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _method_options(method: str, options: dict[str, Any], m: str) -> dict[str, Any]:
    return (options.get(m) or {}) if method == AUTO else options


def affordable(
    method: str,
    options: dict[str, Any],
    *,
    argmax_policy: str,
    n_rows: int,
    k: int,
    itemsize: int,
    holdout: float,
    budget: int | None,
) -> tuple[str, ...]:
    """The candidate methods of a fit whose memory estimate fits ``budget``.

    Raises :class:`service.errors.FitTooLarge` when none does (for an explicit method:
    when it does not), naming the method, the estimate and the largest K that fits.
    """
    candidates = auto_candidates(argmax_policy) if method == AUTO else (method,)
    if budget is None:
        return candidates
    n_fit, n_hold = split_sizes(n_rows, holdout)
    need = {
        m: job_bytes(m, _method_options(method, options, m), n_fit, n_hold, k, itemsize)
        for m in candidates
    }
    fits = tuple(m for m in candidates if need[m] <= budget)
    if fits:
        return fits
    cheapest = min(candidates, key=need.__getitem__)
    largest = _largest_k(
        cheapest, _method_options(method, options, cheapest), n_fit, n_hold, k, itemsize, budget
    )
    raise FitTooLarge(
        f"a {cheapest} fit on {n_fit:,} x {k:,} scores needs about {need[cheapest] / 2**30:.3g} "
        f"GiB (estimate), more than a fit worker's budget of {budget / 2**30:.3g} GiB "
        f"(WELLTEMPERED_FIT_MEMORY_BYTES); at {n_fit:,} rows the largest K that fits is "
        f"{largest:,}. Got K = {k:,}.",
        method=cheapest,
        estimate_bytes=need[cheapest],
        budget_bytes=budget,
        max_classes=largest,
    )


def fit_job(
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    kind: str,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
    argmax_policy: str,
    progress: Callable[[float], None] | None = None,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """Fit on the first part of the permutation, evaluate on the rest; no side effects.

    Returns the columns of the finished version: status (succeeded | rejected),
    chosen_method, params, metrics_before/after, argmax, candidates (auto only),
    warning, rejection (why, when rejected) and fit_seconds.
    """
    fit_idx, hold_idx = split_indices(labels.shape[0], holdout, seed)
    x_fit, y_fit = np.asarray(scores[fit_idx]), labels[fit_idx]
    x_hold, y_hold = np.asarray(scores[hold_idx]), labels[hold_idx]
    before = metrics.scores_report(x_hold, y_hold, kind)

    k = int(scores.shape[1])
    methods = affordable(
        method,
        options,
        argmax_policy=argmax_policy,
        n_rows=labels.shape[0],
        k=k,
        itemsize=scores.dtype.itemsize,
        holdout=holdout,
        budget=memory_budget,
    )
    skipped = [
        m for m in (auto_candidates(argmax_policy) if method == AUTO else ()) if m not in methods
    ]
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for i, m in enumerate(methods):
        opts = (options.get(m) or {}) if method == AUTO else options

        def scaled(p: float, i: int = i) -> None:
            if progress is not None:
                progress(min(1.0, (i + float(p)) / len(methods)))

        t0 = time.perf_counter()
        cal = _create(m, opts).fit(x_fit, y_fit, kind=kind, progress=scaled)
        seconds = time.perf_counter() - t0
        results[m] = {
            "cal": cal,
            **evaluation.evaluate(cal, x_hold, y_hold, kind=kind, argmax_policy=argmax_policy),
            "fit_seconds": seconds,
        }
        scaled(1.0)
    total = time.perf_counter() - started

    allowed = [m for m in methods if results[m]["allowed"]]
    pool = allowed or list(methods)
    chosen = min(pool, key=lambda m: results[m]["metrics"]["nll"])
    best = results[chosen]
    warnings = [w for w in [evaluation.warning(chosen, best["argmax"], argmax_policy)] if w]
    if skipped:
        warnings.append(
            f"auto skipped {', '.join(skipped)}: memory estimate above a fit worker's budget."
        )
    warning = " ".join(warnings) or None
    return {
        "status": "succeeded" if allowed else "rejected",
        "chosen_method": chosen,
        "params": best["cal"].to_params(),
        "metrics_before": before,
        "metrics_after": best["metrics"],
        "argmax": best["argmax"],
        "candidates": (
            {
                m: {k: r[k] for k in ("metrics", "argmax", "fit_seconds", "allowed")}
                for m, r in results.items()
            }
            if method == AUTO
            else None
        ),
        "warning": warning,
        "rejection": evaluation.rejection(results, argmax_policy),
        "fit_seconds": total,
    }
