"""The fit itself, the import of posted parameters, and the checks made before either
is queued.

:func:`fit_job` is pure numerics (no database): split, fit every candidate, evaluate
on the hold-out, police the argmax. :func:`import_job` is its second half alone, for
a version from posted parameters (``to_params`` JSON, fitted elsewhere). Both are the
same functions whichever queue and worker run them (:mod:`service.jobs.attempts`), so
they are tested directly. :func:`check_fit_request`, :func:`affordable` and
:func:`import_affordable` run at submission, so bad options and jobs no worker can
hold are a 422 then, not a failed job later; the jobs check the budget again where
they run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import calibrators
from calibrators import topk
from calibrators.evaluation import checks, entropy, metrics
from calibrators.evaluation.holdout import fold_indices, split_indices, split_sizes
from service.errors import FitTooLarge
from service.jobs import evaluation, selection
from service.vocabulary import ARGMAX_CHANGED, AUTO, NLL_WORSE

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


#: The one method a top-k dataset is fitted by.
TOPK_METHOD = "temperature"


def check_topk_fit(method: str, options: Any) -> topk.TopKTemperature:
    """The calibrator of a fit on top-k rows (``calibrators.topk``), or a 422: only
    temperature scaling is defined on truncated distributions (options ``tail``,
    ``tol``, ``max_passes``); every other method, and ``auto``, needs full scores."""
    if method != TOPK_METHOD:
        raise calibrators.CalibrationInputError(
            "a top-k dataset holds each row's k largest log-probabilities, not its V scores: "
            f"only {TOPK_METHOD} is fitted on it (the tail a stated model, "
            f"calibrators.topk); {method} needs full (N, K) scores. Got method {method!r}."
        )
    if not isinstance(options, dict):
        raise calibrators.CalibrationInputError(f"options must be an object. Got {options!r}.")
    allowed = ("tail", *topk.TopKTemperature.option_checks)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise calibrators.CalibrationInputError(
            f"options of a {TOPK_METHOD} fit on top-k rows are {', '.join(allowed)} "
            f"(tail: {' or '.join(topk.TAILS)}). Got {unknown!r}."
        )
    cal = topk.TopKTemperature(**options)
    cal._options()
    return cal


def check_labels(method: str, options: dict[str, Any], labelled: bool) -> None:
    """422 now for a fit that needs labels on a dataset without them: ``auto`` (it chooses
    by held-out NLL) and every method whose options need labels (``needs_labels``)."""
    if labelled:
        return
    if method == AUTO:
        raise calibrators.CalibrationInputError(
            "an 'auto' fit chooses by held-out NLL, which needs labels, and this dataset has "
            "none: choose a label-free fit (temperature with target_entropy, or "
            "row-entropy), or upload the scores with labels. Got method 'auto'."
        )
    cls = calibrators.CALIBRATORS[method]
    if cls.needs_labels(_create(method, options).checked_options()):
        raise calibrators.CalibrationInputError(
            f"{method} calibration with these options learns from labels, and this dataset "
            "has none: choose a label-free fit (temperature with target_entropy, or "
            "row-entropy), or upload the scores with labels. Got a dataset without labels."
        )


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
    held-out NLL. Under ``warn`` and ``off``, every method. Never a method that
    learns nothing from labels (``learns_from_labels``: prior-shift, a base plus
    weights from production).
    """
    learners = {m: cls for m, cls in calibrators.CALIBRATORS.items() if cls.learns_from_labels}
    if argmax_policy == "require":
        return tuple(m for m, cls in learners.items() if cls.preserves_argmax)
    return tuple(learners)


def lowest_nll(nll: Mapping[str, float]) -> str:
    """The lowest held-out NLL (the first of equals, in the candidates' order): what an
    ``auto`` fit keeps when the policies allow fewer than two of its candidates (none:
    the version is rejected, and says which). Among two or more it races them over
    folds (:func:`race_candidates`), and so does ``welltempered fit --method auto``."""
    return min(nll, key=nll.__getitem__)


def resolve_refit(method: str, refit: bool | None) -> bool:
    """A fit's ``refit``: as asked, else True for ``auto`` and False for a named method.

    ``auto`` uses its hold-out to choose; once chosen, the method fitted on every row
    is the better served calibrator (on lenet-5-cifar-10, structured matrix scaling
    fitted on 80% of the rows loses 0.0024 of held-out NLL to the same method fitted
    on all of them: bench/README.md). A named method's hold-out only evaluates it, and
    by default it serves the calibrator its metrics describe.
    """
    return method == AUTO if refit is None else bool(refit)


def memory_budget(configured: int | None, fit_workers: int) -> int:
    """Bytes one fit may use: the setting, or half the physical memory per fit worker."""
    if configured:
        return configured
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical // (2 * max(1, fit_workers))


def hold_bytes(n_hold: int, k: int, itemsize: int) -> int:
    """Memory estimate of a job's evaluation: the held-out rows and two float64
    probability arrays of them (before and after calibration). All an import holds."""
    return n_hold * k * (itemsize + 2 * 8)


def job_bytes(
    method: str, options: dict[str, Any], n_fit: int, n_hold: int, k: int, itemsize: int
) -> int:
    """Memory estimate of one candidate's fit job, its scores included.

    The calibrator's own model (:func:`calibrators.estimate_cost`: working memory and
    the fit rows) plus what the job holds beside it (:func:`hold_bytes`).
    """
    fit = calibrators.estimate_cost(method, n_fit, k, options, itemsize=itemsize)
    return fit.total_bytes + hold_bytes(n_hold, k, itemsize)


def _largest_k(need: Callable[[int], int], k: int, budget: int) -> int:
    """The largest K <= k with ``need(K) <= budget`` (bisection; 0 if none). ``need``
    must be non-decreasing in K, as every estimate here is."""
    if need(2) > budget:
        return 0
    lo, hi = 2, k  # need(lo) fits; need(hi) does not (the caller's k is over the budget)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _method_options(method: str, options: dict[str, Any], m: str) -> dict[str, Any]:
    return (options.get(m) or {}) if method == AUTO else options


def _too_large(
    job: str, method: str, n: int, rows: str, k: int, need: int, budget: int, largest: int
) -> FitTooLarge:
    """The refusal of a job of ``n`` x ``k`` scores (``rows``: what the n rows are)."""
    return FitTooLarge(
        f"{job} on {n:,} x {k:,} {rows} needs about {need / 2**30:.3g} GiB (estimate), more "
        f"than a fit worker's budget of {budget / 2**30:.3g} GiB (WELLTEMPERED_FIT_MEMORY_BYTES); "
        f"at {n:,} {rows.replace('scores', 'rows')} the largest K that fits is {largest:,}. "
        f"Got K = {k:,}.",
        method=method,
        estimate_bytes=need,
        budget_bytes=budget,
        max_classes=largest,
    )


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
    refit: bool = False,
) -> tuple[str, ...]:
    """The candidate methods of a fit whose memory estimate fits ``budget`` (with
    ``refit``, fitted on every row: the refit is the larger fit).

    Raises :class:`service.errors.FitTooLarge` when none does (for an explicit method:
    when it does not), naming the method, the estimate and the largest K that fits.
    """
    candidates = auto_candidates(argmax_policy) if method == AUTO else (method,)
    if budget is None:
        return candidates
    n_fit, n_hold = split_sizes(n_rows, holdout)
    if refit:
        n_fit = n_rows
    need = {
        m: job_bytes(m, _method_options(method, options, m), n_fit, n_hold, k, itemsize)
        for m in candidates
    }
    fits = tuple(m for m in candidates if need[m] <= budget)
    if fits:
        return fits
    cheapest = min(candidates, key=need.__getitem__)
    opts = _method_options(method, options, cheapest)
    largest = _largest_k(
        lambda kk: job_bytes(cheapest, opts, n_fit, n_hold, kk, itemsize), k, budget
    )
    raise _too_large(
        f"a {cheapest} fit", cheapest, n_fit, "scores", k, need[cheapest], budget, largest
    )


def import_affordable(
    method: str, *, n_rows: int, k: int, itemsize: int, holdout: float, budget: int | None
) -> None:
    """Raise :class:`service.errors.FitTooLarge` when evaluating a ``method`` calibrator
    from posted parameters on the hold-out rows needs more than ``budget``: the same
    guard as a fit's, on the part of a fit's job an import runs (:func:`hold_bytes`;
    nothing is fitted). Its parameters are bounded by the body limit of the request
    that posted them, and not counted."""
    if budget is None:
        return
    _, n_hold = split_sizes(n_rows, holdout)
    need = hold_bytes(n_hold, k, itemsize)
    if need > budget:
        largest = _largest_k(lambda kk: hold_bytes(n_hold, kk, itemsize), k, budget)
        raise _too_large(
            f"evaluating imported {method} parameters", method, n_hold, "held-out scores", k,
            need, budget, largest,
        )


class _Progress:
    """A fit job's progress in equal units of work (one fit each), never going back.

    ``within(p)`` reports ``p`` of the current unit done; ``done()`` ends it;
    ``expect(total)`` changes how many units there are (a race's further fits, known
    after the first fold), holding the figure where it is until the work catches up.
    """

    def __init__(self, callback: Callable[[float], None] | None, total: int) -> None:
        self.callback, self.total, self.units, self.high = callback, max(1, total), 0, 0.0

    def within(self, p: float) -> None:
        figure = min(1.0, (self.units + min(1.0, max(0.0, float(p)))) / self.total)
        self.high = max(self.high, figure)
        if self.callback is not None:
            self.callback(self.high)

    def done(self) -> None:
        self.within(1.0)
        self.units += 1

    def expect(self, total: int) -> None:
        self.total = max(self.units, total, 1)

    def finish(self) -> None:
        self.high = 1.0
        if self.callback is not None:
            self.callback(1.0)


def race_candidates(
    scores: np.ndarray,
    labels: np.ndarray,
    first: Mapping[str, np.ndarray],
    *,
    kind: str,
    options: dict[str, Any],
    holdout: float,
    seed: int,
    sequences: np.ndarray | None = None,
    report: _Progress | None = None,
    after: int = 0,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """An ``auto`` fit's choice among the candidates of ``first`` (each one's per-row NLL
    on the hold-out of ``split_indices(n, holdout, seed, groups=sequences)``, fitted on
    the rest): :func:`service.jobs.selection.race` over
    :func:`calibrators.evaluation.holdout.fold_indices`, each further fold's candidates
    fitted (with ``options[method]``) on every row outside it. ``report`` counts the
    fits, ``after`` more units of work to come. Returns the choice and each candidate's
    part in the race."""
    n = labels.shape[0]
    parts = fold_indices(n, holdout, seed, groups=sequences, max_folds=selection.MAX_FOLDS)
    report = report or _Progress(None, 1)
    report.expect(report.units + len(first) * (len(parts) - 1) + after)

    def score(m: str, fold: int) -> np.ndarray:
        keep = np.ones(n, dtype=bool)
        keep[parts[fold]] = False
        cal = _create(m, options.get(m) or {}).fit(
            np.asarray(scores[keep]), labels[keep], kind=kind, progress=report.within)
        x = np.asarray(scores[parts[fold]])
        report.done()
        return metrics.nll_per_row(cal.predict_proba(x, kind=kind), labels[parts[fold]])

    return selection.race(first, score, len(parts))


def fit_job(
    scores: np.ndarray,
    labels: np.ndarray | None,
    *,
    kind: str,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
    argmax_policy: str,
    progress: Callable[[float], None] | None = None,
    memory_budget: int | None = None,
    refit: bool | None = None,
    sequences: np.ndarray | None = None,
    topk_ids: np.ndarray | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Fit on the first part of the permutation, evaluate on the rest; no side effects.

    With ``sequences`` (the dataset's sequence id of each row) the split is by sequence
    (:func:`calibrators.evaluation.holdout.split_indices` with ``groups``: no text on
    both sides), and the held-out metrics add ``sequences`` (the NLL per token and per
    sequence).

    ``auto`` fits every candidate (:func:`auto_candidates`) and evaluates it on the
    hold-out; among those the policies allow, it chooses by
    :func:`service.jobs.selection.race`: the hold-out is the race's first fold, and
    candidates within reach of the leader are fitted again without each further fold
    (:func:`calibrators.evaluation.holdout.fold_indices`, by sequence with
    ``sequences``) and scored on it. Each candidate's ``selection`` reports its part in
    the race.

    With ``refit`` (``None``: :func:`resolve_refit`, True for ``auto``), the chosen
    method is then fitted again on every row, and its params are the ones returned:
    ``metrics_after`` stays the hold-out estimate of the method (fitted without the
    held-out rows, the only honest figure there is), while
    ``argmax`` and the warning are the served calibrator's on the held-out rows (the
    argmax check needs no labels, so rows it was fitted on do not bias it). Under
    ``require`` every candidate keeps the argmax by construction, so the refit cannot
    break the policy the choice was made under.

    Without ``labels`` (scores alone: a label-free method, :func:`check_labels`), see
    :func:`label_free_job`; with ``topk_ids`` (``scores`` are then top-k
    log-probabilities out of ``vocab_size`` tokens), :func:`topk_job`.

    Returns the columns of the finished version: status (succeeded | rejected),
    chosen_method, params, metrics_before/after, argmax, candidates (auto only),
    warning, rejection and rejected_for (why, when rejected) and fit_seconds.
    """
    refit = resolve_refit(method, refit)
    if topk_ids is not None:
        return topk_job(
            scores, topk_ids, labels, vocab_size=vocab_size, method=method, holdout=holdout,
            seed=seed, options=options, refit=refit, sequences=sequences,
        )
    if labels is None:
        return label_free_job(
            scores, kind=kind, method=method, holdout=holdout, seed=seed, options=options,
            argmax_policy=argmax_policy, progress=progress, memory_budget=memory_budget,
            refit=refit, sequences=sequences,
        )
    fit_idx, hold_idx = split_indices(labels.shape[0], holdout, seed, groups=sequences)
    x_fit, y_fit = np.asarray(scores[fit_idx]), labels[fit_idx]
    x_hold, y_hold = np.asarray(scores[hold_idx]), labels[hold_idx]
    s_hold = None if sequences is None else np.asarray(sequences[hold_idx])
    before = metrics.scores_report(x_hold, y_hold, kind, sequences=s_hold)

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
        refit=refit,
    )
    skipped = [
        m for m in (auto_candidates(argmax_policy) if method == AUTO else ()) if m not in methods
    ]
    results: dict[str, dict[str, Any]] = {}
    report = _Progress(progress, len(methods) + refit)
    started = time.perf_counter()
    for m in methods:
        t0 = time.perf_counter()
        cal = _create(m, _method_options(method, options, m)).fit(
            x_fit, y_fit, kind=kind, progress=report.within)
        seconds = time.perf_counter() - t0
        results[m] = {
            "cal": cal,
            **evaluation.evaluate(
                cal, x_hold, y_hold, kind=kind, argmax_policy=argmax_policy, sequences=s_hold
            ),
            "fit_seconds": seconds,
        }
        report.done()
    del x_fit, y_fit  # the race's and the refit's fits take their own rows

    allowed = [m for m in methods if results[m]["allowed"]]
    raced: dict[str, dict[str, Any]] = {}
    if method == AUTO and len(allowed) > 1:
        chosen, raced = race_candidates(
            scores, labels, {m: results[m]["row_nll"] for m in allowed}, kind=kind,
            options=options, holdout=holdout, seed=seed, sequences=sequences, report=report,
            after=refit,
        )
    else:
        chosen = lowest_nll({m: results[m]["metrics"]["nll"] for m in allowed or methods})
    total = time.perf_counter() - started
    best = results[chosen]
    served, argmax = best["cal"], best["argmax"]
    if refit and allowed:
        served = _create(chosen, _method_options(method, options, chosen)).fit(
            np.asarray(scores), labels, kind=kind, progress=report.within)
        argmax = checks.argmax_report(x_hold, served.predict_proba(x_hold, kind=kind), kind=kind)
        total = time.perf_counter() - started
    report.finish()
    warnings = [w for w in [evaluation.warning(chosen, argmax, argmax_policy)] if w]
    if skipped:
        warnings.append(
            f"auto skipped {', '.join(skipped)}: memory estimate above a fit worker's budget."
        )
    warning = " ".join(warnings) or None
    return {
        "status": "succeeded" if allowed else "rejected",
        "chosen_method": chosen,
        "params": served.to_params(),
        "metrics_before": before,
        "metrics_after": best["metrics"],
        "argmax": argmax,
        "candidates": (
            {
                m: {
                    **{
                        k: r[k]
                        for k in ("metrics", "argmax", "fit_seconds", "allowed", "rejected_for")
                        if k in r
                    },
                    **({"selection": raced[m]} if m in raced else {}),
                }
                for m, r in results.items()
            }
            if method == AUTO
            else None
        ),
        "warning": warning,
        **evaluation.rejection(results, argmax_policy),
        "fit_seconds": total,
    }


def topk_job(
    logprobs: np.ndarray,
    ids: np.ndarray,
    labels: np.ndarray,
    *,
    vocab_size: int,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
    refit: bool = False,
    sequences: np.ndarray | None = None,
) -> dict[str, Any]:
    """:func:`fit_job` on top-k rows (``calibrators.topk``): temperature fitted on the
    split's first part (every row with ``refit``), the held-out rows reported before
    (beta 1) and after by :func:`calibrators.topk.report` under the fit's tail model, and
    rejected as any fit whose held-out NLL is worse than the rows as given
    (:func:`service.jobs.evaluation.nll_worse`). Tempering keeps the order of the top-k,
    so no predicted token changes (the argmax report measures it on the top-k)."""
    started = time.perf_counter()
    cal = check_topk_fit(method, options)
    fit_idx, hold_idx = split_indices(labels.shape[0], holdout, seed, groups=sequences)

    def part(idx) -> topk.TopK:
        return topk.as_topk(np.asarray(ids[idx]), np.asarray(logprobs[idx]), vocab_size)

    x_fit, x_hold = part(fit_idx), part(hold_idx)
    y_fit, y_hold = labels[fit_idx], labels[hold_idx]
    s_hold = None if sequences is None else np.asarray(sequences[hold_idx])
    cal.fit(x_fit, y_fit)
    tail, beta = cal.tail, cal.beta_
    before = topk.report(x_hold, y_hold, tail=tail, sequences=s_hold)
    after = topk.report(x_hold, y_hold, beta=beta, tail=tail, sequences=s_hold)
    nll = checks.nll_rows_report(topk.nll_rows(x_hold, y_hold, 1.0, tail),
                                 topk.nll_rows(x_hold, y_hold, beta, tail))
    probs, _ = cal.predict(x_hold)
    argmax = checks.argmax_report(x_hold.logprobs, probs / probs.sum(axis=1, keepdims=True))
    served = cal
    if refit and not evaluation.nll_worse(nll):
        served = check_topk_fit(method, options).fit(part(slice(None)), labels)
    reasons = [NLL_WORSE] if evaluation.nll_worse(nll) else []
    result = {"allowed": not reasons, "argmax": argmax, "nll": nll, "rejected_for": reasons}
    return {
        "status": "rejected" if reasons else "succeeded",
        "chosen_method": method,
        "params": served.to_params(),
        "metrics_before": before,
        "metrics_after": after,
        "argmax": argmax,
        "candidates": None,
        "warning": None,
        **evaluation.rejection({method: result}, "off"),
        "fit_seconds": time.perf_counter() - started,
    }


def label_free_job(
    scores: np.ndarray,
    *,
    kind: str,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
    argmax_policy: str,
    progress: Callable[[float], None] | None = None,
    memory_budget: int | None = None,
    refit: bool = False,
    sequences: np.ndarray | None = None,
) -> dict[str, Any]:
    """:func:`fit_job` for scores without labels: a method that needs none, fitted on the
    first part of the split (every row with ``refit``), reported without labels.

    There is no NLL or ECE to report or police. ``metrics_before`` is the held-out rows'
    :func:`calibrators.evaluation.entropy.entropy_report`; ``metrics_after`` is their
    :func:`~calibrators.evaluation.entropy.tempering_report` (entropies after, and
    ``KL(q || p)``), with ``label_free`` True, the ``target_entropy``, and ``fit``: the
    same report on the rows the served calibrator was fitted on, where the target is
    met (``entropy_reached``: their mean entropy after; for ``row-entropy`` every row's).
    The held-out figures say how the target carries to rows it was not fitted on. The
    argmax policy applies as to any fit (both label-free methods keep every argmax).
    """
    n, k = scores.shape
    fit_idx, hold_idx = split_indices(n, holdout, seed, groups=sequences)
    affordable(method, options, argmax_policy=argmax_policy, n_rows=n, k=int(k),
               itemsize=scores.dtype.itemsize, holdout=holdout, budget=memory_budget,
               refit=refit)
    x_fit = np.asarray(scores) if refit else np.asarray(scores[fit_idx])
    x_hold = np.asarray(scores[hold_idx])
    started = time.perf_counter()
    cal = _create(method, options).fit(x_fit, None, kind=kind, progress=progress)
    probs = cal.predict_proba(x_hold, kind=kind)
    argmax = checks.argmax_report(x_hold, probs, kind=kind)
    fitted = entropy.tempering_report(x_fit, lambda b: cal.predict_proba(b, kind=kind), kind)
    target = getattr(cal, "target_", None) or cal.checked_options()["target_entropy"]
    changed = argmax_policy == "require" and argmax["changed"]
    rejected = {"rejection": None, "rejected_for": None}
    if changed:
        rejected = evaluation.rejection(
            {method: {"allowed": False, "argmax": argmax, "rejected_for": [ARGMAX_CHANGED]}},
            argmax_policy,
        )
    return {
        "status": "rejected" if changed else "succeeded",
        "chosen_method": method,
        "params": cal.to_params(),
        "metrics_before": {"label_free": True, **entropy.entropy_report(x_hold, kind)},
        "metrics_after": {
            "label_free": True,
            "target_entropy": target,
            "entropy_reached": fitted["entropy_after"]["mean"],
            **entropy.tempering_report(x_hold, probs, kind),
            "fit": fitted,
        },
        "argmax": argmax,
        "candidates": None,
        "warning": evaluation.warning(method, argmax, argmax_policy),
        **rejected,
        "fit_seconds": time.perf_counter() - started,
    }


def import_job(
    params: dict[str, Any],
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    kind: str,
    holdout: float,
    seed: int,
    argmax_policy: str,
    memory_budget: int | None = None,
    sequences: np.ndarray | None = None,
) -> dict[str, Any]:
    """A version from posted ``params``: the budget checked again where it runs (the
    worker's may differ from the API's), then :func:`service.jobs.evaluation.evaluate_params`
    (by sequence with ``sequences``, as :func:`fit_job`); no side effects. Returns the
    columns of the finished version, as :func:`fit_job`."""
    import_affordable(
        str(params.get("method")),
        n_rows=labels.shape[0],
        k=int(scores.shape[1]),
        itemsize=scores.dtype.itemsize,
        holdout=holdout,
        budget=memory_budget,
    )
    return evaluation.evaluate_params(
        params,
        scores,
        labels,
        num_classes=int(scores.shape[1]),
        kind=kind,
        holdout=holdout,
        seed=seed,
        argmax_policy=argmax_policy,
        sequences=sequences,
    )
