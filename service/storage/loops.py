"""The recalibration loop's queries: a model's settings, its kept feedback rows, its
runs and their events (the numerics and the order of the steps: :mod:`service.jobs.loop`).

Kept rows are written in the transaction of the feedback post that brought them (its
reliability sums commit with them: a post is kept whole or not at all), and trimmed in
it to the model's ``retention_rows``, oldest post first; :func:`expire` drops the
posts past ``retention_days`` (the serve process's sweeper calls it). They count against
the namespace's ``stored_bytes`` quota (:func:`service.storage.usage.usage`) and go
with the model (foreign keys ``ON DELETE CASCADE``).

A run's steps are written where they happen: ``started`` with the candidate's version
and job (:func:`add_run`, in the transaction that queues the fit), the fit's outcome,
the comparison and the promotion in the transaction that records the fit's outcome
(:func:`conclude`), a failed or cancelled fit in the transaction that records it
(:func:`candidate_stopped`). So a run never says more than its candidate's row.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from calibrators.validation import logits64
from service.storage import usage
from service.storage.db import (
    Alias,
    CalibratorVersion,
    FeedbackBatch,
    FeedbackLoop,
    LoopEvent,
    LoopRun,
    Model,
    utcnow,
)
from service.storage.pages import PageRequest, paged
from service.vocabulary import DEFAULT_ALIAS

# ---------------------------------------------------------------------------
# settings


def settings_of(session: Session, model: Model) -> FeedbackLoop | None:
    """The model's loop settings (None: it never opted in)."""
    return session.get(FeedbackLoop, model.id, populate_existing=True)


def put_settings(session: Session, model: Model, values: dict[str, Any]) -> FeedbackLoop:
    """Replace the model's settings with ``values`` (every column of
    :class:`~service.storage.db.FeedbackLoop` but the model's) and apply them to the rows
    already kept: none kept once ``keep_feedback`` is off, at most ``retention_rows``.
    Commits."""
    row = session.get(FeedbackLoop, model.id, with_for_update=True)
    if row is None:
        row = FeedbackLoop(model_id=model.id)
        session.add(row)
    for name, value in values.items():
        setattr(row, name, value)
    row.updated_at = utcnow()
    session.flush()
    if row.keep_feedback:
        _trim(session, model.id, row.retention_rows)
    else:
        session.execute(delete(FeedbackBatch).where(FeedbackBatch.model_id == model.id))
    session.commit()
    return row


def drift_triggers(session: Session, model: Model) -> bool:
    """Whether a drift verdict may start a run of the model (it keeps feedback and asks)."""
    loop = settings_of(session, model)
    return loop is not None and loop.keep_feedback and loop.on_drift


# ---------------------------------------------------------------------------
# kept rows


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _array(image: bytes) -> np.ndarray:
    return np.load(io.BytesIO(image), allow_pickle=False)


def _trim(session: Session, model_id: int, most: int) -> None:
    """Drop the oldest posts until the model keeps at most ``most`` rows."""
    kept = 0
    drop = []
    for batch_id, n_rows in session.execute(
        select(FeedbackBatch.id, FeedbackBatch.n_rows)
        .where(FeedbackBatch.model_id == model_id)
        .order_by(FeedbackBatch.id.desc())
    ):
        kept += n_rows
        if kept > most:
            drop.append(batch_id)
    if drop:
        session.execute(delete(FeedbackBatch).where(FeedbackBatch.id.in_(drop)))


def keep(
    session: Session,
    model: Model,
    version: int,
    scores: np.ndarray,
    labels: np.ndarray,
    kind: str,
    quotas: usage.Quotas | None,
) -> int:
    """Keep a feedback post's rows if the model opted in; returns how many (0 if not).

    Written in ``session``'s transaction (the caller commits with the post's sums):
    the newest ``retention_rows`` rows of the post, then the model's oldest posts
    dropped past ``retention_rows``. With ``quotas``, refused (409 ``quota-exceeded``,
    nothing written) when the namespace cannot store them, checked under its lock.
    """
    loop = settings_of(session, model)
    if loop is None or not loop.keep_feedback:
        return 0
    scores, labels = scores[-loop.retention_rows :], labels[-loop.retention_rows :]
    images = _npy(scores), _npy(np.asarray(labels, dtype=np.int64))
    n_bytes = sum(len(image) for image in images)
    _trim(session, model.id, loop.retention_rows - int(labels.shape[0]))
    if quotas is not None:
        usage.lock(session, model.namespace)
        usage.check_stored(session, model.namespace, n_bytes, quotas, "keeping these feedback rows")
    session.add(
        FeedbackBatch(
            model_id=model.id,
            version=version,
            kind=kind,
            n_rows=int(labels.shape[0]),
            scores=images[0],
            labels=images[1],
            n_bytes=n_bytes,
        )
    )
    return int(labels.shape[0])


@dataclass(frozen=True)
class Kept:
    """The rows a run fits and compares on, oldest first: scores of one kind."""

    scores: np.ndarray
    labels: np.ndarray
    kind: str


def kept_rows(session: Session, model: Model, loop: FeedbackLoop) -> Kept | None:
    """The model's kept rows within its retention (None if there are none). Posts of both
    kinds are joined as float64 logits (the same distributions: every calibrator of
    params format 2 gives them one answer)."""
    since = utcnow() - timedelta(days=loop.retention_days)
    batches = session.execute(
        select(FeedbackBatch.kind, FeedbackBatch.scores, FeedbackBatch.labels)
        .where(FeedbackBatch.model_id == model.id, FeedbackBatch.created_at >= since)
        .order_by(FeedbackBatch.id)
    ).all()
    if not batches:
        return None
    kinds = {b.kind for b in batches}
    scores = [_array(b.scores) for b in batches]
    if len(kinds) > 1:
        scores = [logits64(s, b.kind) for s, b in zip(scores, batches, strict=True)]
    kind = kinds.pop() if len(kinds) == 1 else "logits"
    labels = np.concatenate([_array(b.labels) for b in batches])
    most = loop.retention_rows
    return Kept(np.concatenate(scores)[-most:], labels[-most:], kind)


def kept_summary(session: Session, model: Model) -> tuple[int, int]:
    """(rows, bytes) the model keeps."""
    rows, n_bytes = session.execute(
        select(
            func.coalesce(func.sum(FeedbackBatch.n_rows), 0),
            func.coalesce(func.sum(FeedbackBatch.n_bytes), 0),
        ).where(FeedbackBatch.model_id == model.id)
    ).one()
    return int(rows), int(n_bytes)


def expire(sessions: sessionmaker) -> int:
    """Drop every kept post past its model's ``retention_days``; returns how many."""
    now = utcnow()
    dropped = 0
    with sessions() as s, s.begin():
        kept = select(FeedbackLoop.model_id, FeedbackLoop.retention_days)
        for model_id, days in s.execute(kept):
            dropped += s.execute(
                delete(FeedbackBatch).where(
                    FeedbackBatch.model_id == model_id,
                    FeedbackBatch.created_at < now - timedelta(days=days),
                )
            ).rowcount
    return dropped


# ---------------------------------------------------------------------------
# runs and events


def _event(session: Session, run: LoopRun, step: str, message: str, details=None) -> None:
    session.add(
        LoopEvent(model_id=run.model_id, run_id=run.id, step=step, message=message, details=details)
    )


def unfinished_run(session: Session, model: Model) -> LoopRun | None:
    return session.scalar(
        select(LoopRun).where(LoopRun.model_id == model.id, LoopRun.state == "fitting")
    )


def last_started(session: Session, model: Model, trigger: str):
    """When the model's last run of ``trigger`` started (None: never)."""
    return session.scalar(
        select(func.max(LoopRun.created_at)).where(
            LoopRun.model_id == model.id, LoopRun.trigger == trigger
        )
    )


def add_run(
    session: Session,
    model: Model,
    loop: FeedbackLoop,
    trigger: str,
    production: CalibratorVersion,
    candidate: CalibratorVersion,
    details: dict[str, Any],
) -> LoopRun:
    """A run whose candidate ``candidate`` was just queued, and its ``started`` event, in
    the transaction that queues it (the caller commits)."""
    run = LoopRun(
        model_id=model.id,
        trigger=trigger,
        state="fitting",
        production_id=production.id,
        production_version=production.version,
        candidate_id=candidate.id,
        candidate_version=candidate.version,
        margin=loop.margin,
        auto_promote=loop.auto_promote,
    )
    session.add(run)
    session.flush()
    _event(
        session,
        run,
        "started",
        f"Started by {'a request' if trigger == 'request' else 'a drift verdict'}: version "
        f"{candidate.version} fits {candidate.method} on {details['rows']} kept rows, "
        f"holding back {details['holdout']:.0%} to compare it with version "
        f"{production.version}.",
        details,
    )
    return run


@dataclass(frozen=True)
class Comparing:
    """What a candidate's fit needs to compare itself with production (its run's)."""

    run_id: int
    production_params: dict[str, Any]
    margin: float


def comparing(session: Session, version_id: int) -> Comparing | None:
    """The run whose candidate is version ``version_id`` and still fitting, with the
    production version's params (None: the version is no run's candidate)."""
    row = session.execute(
        select(LoopRun.id, LoopRun.margin, CalibratorVersion.params)
        .join(CalibratorVersion, CalibratorVersion.id == LoopRun.production_id)
        .where(LoopRun.candidate_id == version_id, LoopRun.state == "fitting")
    ).one_or_none()
    return None if row is None else Comparing(row.id, dict(row.params), row.margin)


def conclude(
    session: Session, run_id: int, fitted: dict[str, Any], comparison: dict[str, Any]
) -> str:
    """Record a run's end in the transaction of its candidate's outcome: the events
    ``candidate-fitted`` and ``evaluated`` (the figures), then ``promoted`` (the default
    alias moved, only if it still points at the run's production version) or
    ``not-promoted`` and why. Returns the run's state."""
    run = session.get(LoopRun, run_id, with_for_update=True)
    _event(
        session,
        run,
        "candidate-fitted",
        f"Version {run.candidate_version} {fitted['status']}: {fitted['chosen_method']} "
        f"fitted in {fitted['fit_seconds']:.3g} s.",
        {"status": fitted["status"], "rejected_for": fitted.get("rejected_for")},
    )
    figures = {k: v for k, v in comparison.items() if k not in ("better", "reasons")}
    _event(
        session,
        run,
        "evaluated",
        f"On {comparison['rows']} held-back rows: NLL {comparison['nll_production']:.4f} "
        f"(version {run.production_version}) against {comparison['nll_candidate']:.4f} "
        f"(version {run.candidate_version}), ECE {comparison['ece_production']:.4f} against "
        f"{comparison['ece_candidate']:.4f}.",
        figures,
    )
    reasons = list(comparison["reasons"])
    if comparison["better"] and not run.auto_promote:
        state = "waiting"
        reasons.append(
            "the model does not promote automatically (auto_promote is off): PUT "
            f"aliases/{DEFAULT_ALIAS} with version {run.candidate_version} to promote it"
        )
    elif comparison["better"]:
        moved = session.execute(
            update(Alias)
            .where(
                Alias.model_id == run.model_id,
                Alias.alias == DEFAULT_ALIAS,
                Alias.version_id == run.production_id,
            )
            .values(version_id=run.candidate_id, updated_at=utcnow())
        ).rowcount
        if moved:
            state = "promoted"
        else:
            state = "not-promoted"
            reasons.append(
                f"the {DEFAULT_ALIAS!r} alias no longer points at version "
                f"{run.production_version}: it moved since the run started"
            )
    else:
        state = "not-promoted"
    if state == "promoted":
        _event(
            session,
            run,
            "promoted",
            f"Promoted: {DEFAULT_ALIAS!r} moved from version {run.production_version} to "
            f"version {run.candidate_version}.",
            {"alias": DEFAULT_ALIAS},
        )
    else:
        _event(
            session, run, "not-promoted", f"Not promoted: {'; '.join(reasons)}.",
            {"reasons": reasons},
        )
    run.state, run.comparison, run.finished_at = state, comparison, utcnow()
    return state


def candidate_stopped(session: Session, version_id: int, why: str) -> None:
    """The run of candidate ``version_id`` (if any) failed: its fit failed or was
    cancelled (``why``); in the transaction that records it."""
    run = session.scalar(
        select(LoopRun)
        .where(LoopRun.candidate_id == version_id, LoopRun.state == "fitting")
        .with_for_update()
    )
    if run is None:
        return
    _event(session, run, "failed", f"Version {run.candidate_version}: {why}.")
    run.state, run.finished_at = "failed", utcnow()


def list_runs(session: Session, model: Model, page: PageRequest | None = None) -> list[LoopRun]:
    """The model's runs, oldest first."""
    return list(session.scalars(paged(select(LoopRun).where(LoopRun.model_id == model.id),
                                      LoopRun.id, page)))


def list_events(
    session: Session, model: Model, page: PageRequest | None = None, run: int | None = None
) -> list[LoopEvent]:
    """The model's events (of run ``run`` only, if given), oldest first."""
    stmt = select(LoopEvent).where(LoopEvent.model_id == model.id)
    if run is not None:
        stmt = stmt.where(LoopEvent.run_id == run)
    return list(session.scalars(paged(stmt, LoopEvent.id, page)))


def outcomes(session: Session) -> list[tuple[str, str, str, int]]:
    """(namespace, model, state, runs) of every model's runs: the /metrics counts."""
    return [
        (ns, name, state, int(n))
        for ns, name, state, n in session.execute(
            select(Model.namespace, Model.name, LoopRun.state, func.count())
            .join(Model, Model.id == LoopRun.model_id)
            .group_by(Model.namespace, Model.name, LoopRun.state)
        )
    ]
