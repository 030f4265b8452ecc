"""The recalibration loop: refit production's method on the kept feedback, compare the
candidate with production on held-back rows, promote only when better by a margin.

A run (:func:`start`, on a request or on a drift verdict: :func:`after_feedback`):

1. the model's kept rows (:mod:`service.storage.loops`) become a dataset of the model
   (counted in its quotas like any upload);
2. a version of the method production's version was fitted with (its chosen method and
   options for ``auto``) is queued on it, with the model's ``holdout``: an ordinary
   fit job, under the model's argmax policy, listed with the other versions;
3. when the fit ends, its attempt calls :func:`compare` on the rows the fit held back
   (:func:`calibrators.evaluation.holdout.split_indices` of the version's holdout and
   seed, the split the fit made), and the run's end is written with the fit's outcome
   (:func:`service.storage.loops.conclude`).

**Better, by a stated margin.** Paired on the held-back rows, the candidate is better
when (a) its fit succeeded (a version rejected by the argmax policy, or for an NLL worse
than the raw scores', never is), (b) the mean per-row NLL gain over production is at
least the model's ``margin`` (nats per row) and (c) the gain's lower 95 % bound is
above 0 (a normal interval on the paired differences), and (d) its top-label ECE is not
worse beyond noise: the lower 95 % bound of the paired bootstrap of
``ece_candidate - ece_production`` is at most 0. Only then is it promoted, and only
automatically when the model's ``auto_promote`` says so; otherwise it waits for the
user (who moves the alias).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
from scipy.special import ndtri
from sqlalchemy.orm import Session

import calibrators
from calibrators.evaluation import metrics
from calibrators.evaluation.holdout import split_indices
from calibrators.validation import PROBABILITY_FLOOR
from service.errors import Conflict, NotFound, ServiceError
from service.security import limits
from service.settings import Settings
from service.storage import loops, registry
from service.storage.arrays import ArrayStore
from service.storage.db import CalibratorVersion, LoopRun, Model, as_utc, utcnow
from service.storage.usage import Quotas
from service.vocabulary import AUTO, FROM_PARAMS

log = logging.getLogger("welltempered.loop")

#: Fewest kept rows a run starts on: enough for both sides of the split to mean something.
MIN_ROWS = 100
#: Level of the comparison's intervals.
LEVEL = 0.95
#: Paired bootstrap resamples of the ECE difference (seeded by the version's seed).
N_RESAMPLES = 200


def production_method(row: CalibratorVersion) -> tuple[str, dict[str, Any]]:
    """The method and options a candidate refits: the ones ``row`` serves (an ``auto``
    fit's chosen method with its options; posted params' own method and options)."""
    if row.source == FROM_PARAMS:
        params = row.params or {}
        return str(params["method"]), dict(params.get("options") or {})
    method = row.chosen_method or row.method
    options = dict(row.options or {})
    if row.method == AUTO:
        options = dict(options.get(method) or {})
    return method, options


def start(
    session: Session,
    model: Model,
    trigger: str,
    *,
    settings: Settings,
    arrays: ArrayStore,
    queue,
    before_commit: Callable[[Session, LoopRun], None] | None = None,
) -> LoopRun:
    """Start a run of ``model``'s loop: its candidate's version queued, its ``started``
    event written; returns the run. ``before_commit(session, run)`` runs in the
    transaction that writes the run (an idempotency key's answer commits with it).

    409 when the model keeps no feedback, has a run still fitting, has too few kept
    rows, or its default alias's version is not servable; 404 without a default alias;
    the fit queue's and the quotas' refusals as for any fit.
    """
    loop = loops.settings_of(session, model)
    if loop is None or not loop.keep_feedback:
        raise Conflict(
            f"Model {model.name!r} keeps no feedback rows: PUT /v1/models/{model.name}/loop "
            'with {"keep_feedback": true} first.'
        )
    _one_at_a_time(session, model)
    production = registry.served_version(session, model)
    registry.check_servable(production, model)
    kept = loops.kept_rows(session, model, loop)
    n = 0 if kept is None else int(kept.labels.shape[0])
    if n < MIN_ROWS:
        raise Conflict(
            f"Model {model.name!r} keeps {n} feedback rows within its retention; a run needs "
            f"at least {MIN_ROWS}. Got {n}."
        )
    limits.check_fit_queue(
        session, model.namespace, settings.max_queued_fits_per_namespace, settings.max_queued_fits
    )
    method, options = production_method(production)
    quotas = Quotas.from_settings(settings)
    dataset, _ = registry.add_dataset(
        session, model, arrays, kept.scores, kept.labels, kept.kind, quotas
    )
    details = {
        "rows": n,
        "holdout": loop.holdout,
        "dataset_id": dataset.id,
        "method": method,
        "production_version": production.version,
        "margin": loop.margin,
        "auto_promote": loop.auto_promote,
    }

    runs: list[LoopRun] = []

    def enqueue(s: Session, candidate: CalibratorVersion) -> None:
        # Again under the model's row lock (create_version's UPDATE): of two runs
        # started at once, the second sees the first's.
        _one_at_a_time(s, model)
        queue.enqueue(s, candidate, model.namespace)
        runs.append(loops.add_run(s, model, loop, trigger, production, candidate, details))
        if before_commit is not None:
            before_commit(s, runs[-1])

    candidate = registry.create_version(
        session,
        model,
        dataset,
        method=method,
        holdout=loop.holdout,
        seed=secrets.randbelow(2**31),
        options=options,
        enqueue=enqueue,
        quotas=quotas,
    )
    queue.submitted(candidate.id, model.namespace)
    return runs[0]


def _one_at_a_time(session: Session, model: Model) -> None:
    running = loops.unfinished_run(session, model)
    if running is not None:
        raise Conflict(
            f"Model {model.name!r} has a loop run still fitting (run {running.id}, version "
            f"{running.candidate_version}): one run at a time."
        )


def after_feedback(
    session: Session,
    model: Model,
    served: CalibratorVersion,
    drift: dict[str, Any],
    *,
    settings: Settings,
    arrays: ArrayStore,
    queue,
) -> LoopRun | None:
    """Start a run when a feedback post found ``served``, the version production serves,
    drifted (``drift``: its verdict) and the model opted in (``on_drift``); at most one
    drift-started run per monitoring window. A run
    that cannot start (one still fitting, a quota, a full queue) does not fail the post,
    which is recorded: it is logged. Returns the run, if any."""
    if drift.get("verdict") != "drift":
        return None
    loop = loops.settings_of(session, model)
    if loop is None or not (loop.on_drift and loop.keep_feedback):
        return None
    try:
        production = registry.served_version(session, model)
    except NotFound:  # no production alias: nothing to recalibrate
        return None
    if production.id != served.id:  # another version's drift
        return None
    last = loops.last_started(session, model, "drift")
    if last is not None and utcnow() - as_utc(last) < timedelta(
        seconds=settings.monitoring_window_seconds
    ):
        return None
    try:
        return start(session, model, "drift", settings=settings, arrays=arrays, queue=queue)
    except ServiceError as exc:  # the post is recorded; a run is a consequence, not its part
        session.rollback()
        log.warning("the loop of model %r did not start on drift: %s", model.name, exc)
        return None


def _nll_rows(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return -np.log(np.maximum(probs[np.arange(labels.shape[0]), labels], PROBABILITY_FLOOR))


def compare(
    production_params: dict[str, Any],
    candidate_params: dict[str, Any],
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    kind: str,
    holdout: float,
    seed: int,
    margin: float,
    candidate_status: str,
) -> dict[str, Any]:
    """The paired comparison of a candidate with production on the rows its fit held back.

    Parameters
    ----------
    production_params, candidate_params : dict
        ``to_params()`` of both calibrators.
    scores : ndarray of shape (n_samples, n_classes)
        The run's kept rows (the candidate's dataset), of ``kind``.
    labels : ndarray of shape (n_samples,)
    holdout, seed : float, int
        The candidate version's: the held-back rows are the ones its fit held out.
    margin : float
        Nats per row the candidate's NLL must gain.
    candidate_status : str
        The candidate fit's outcome (``succeeded`` or ``rejected``).

    Returns
    -------
    dict
        ``rows``; ``nll_production``, ``nll_candidate``, ``nll_gain`` (production minus
        candidate, paired mean) with ``nll_gain_low``/``nll_gain_high`` (normal interval
        at :data:`LEVEL`); ``ece_production``, ``ece_candidate`` (15 equal-width bins),
        ``ece_change`` (candidate minus production) with ``ece_change_low``/``_high``
        (paired bootstrap, :data:`N_RESAMPLES`); ``margin``, ``level``; ``better`` and
        ``reasons`` (why not, one phrase each: the rule is the module's).
    """
    _, hold = split_indices(labels.shape[0], holdout, seed)
    x, y = np.asarray(scores[hold]), labels[hold]
    probs = {
        name: calibrators.from_params(params).predict_proba(x, kind=kind)
        for name, params in (("production", production_params), ("candidate", candidate_params))
    }
    gain = _nll_rows(probs["production"], y) - _nll_rows(probs["candidate"], y)
    n = int(y.shape[0])
    z = float(ndtri(0.5 + LEVEL / 2))
    half = z * float(gain.std(ddof=1)) / np.sqrt(n) if n > 1 else float("inf")
    mean_gain = float(gain.mean())

    top = {
        name: (p.max(axis=1), p.argmax(axis=1) == y) for name, p in probs.items()
    }

    def ece(name: str, rows: np.ndarray | None = None) -> float:
        confidence, correct = top[name]
        if rows is not None:
            confidence, correct = confidence[rows], correct[rows]
        stats = metrics.bin_statistics(confidence, correct, metrics.DEFAULT_N_BINS)
        return metrics.ece_from_bin_statistics(
            stats["count"], stats["confidence_sum"], stats["correct_count"]
        )["ece"]

    rng = np.random.default_rng(seed)
    changes = []
    for _ in range(N_RESAMPLES):
        rows = rng.integers(0, n, n)
        changes.append(ece("candidate", rows) - ece("production", rows))
    low, high = np.quantile(changes, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    out = {
        "rows": n,
        "nll_production": float(_nll_rows(probs["production"], y).mean()),
        "nll_candidate": float(_nll_rows(probs["candidate"], y).mean()),
        "nll_gain": mean_gain,
        "nll_gain_low": mean_gain - half,
        "nll_gain_high": mean_gain + half,
        "ece_production": ece("production"),
        "ece_candidate": ece("candidate"),
        "ece_change_low": float(low),
        "ece_change_high": float(high),
        "margin": margin,
        "level": LEVEL,
    }
    out["ece_change"] = out["ece_candidate"] - out["ece_production"]
    reasons = []
    if candidate_status != "succeeded":
        reasons.append(f"the candidate was {candidate_status} (the model's policies)")
    if mean_gain < margin:
        reasons.append(f"its NLL gain {mean_gain:.4f} is below the margin {margin:g}")
    elif out["nll_gain_low"] <= 0:
        reasons.append(
            f"its NLL gain's lower bound {out['nll_gain_low']:.4f} is not above 0 "
            f"({n} held-back rows)"
        )
    if out["ece_change_low"] > 0:
        reasons.append(
            f"its ECE is worse ({out['ece_candidate']:.4f} against "
            f"{out['ece_production']:.4f}, the change's lower bound above 0)"
        )
    out["better"], out["reasons"] = not reasons, reasons
    return out
