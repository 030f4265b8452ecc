"""The queries of fit jobs: a calibrator version row is its job's record (:mod:`service.jobs`).

Each function is one transaction of its own, opened from a session factory, except
the ones that take a request's ``Session``. The callers are fit attempts (maybe in
another process or on another machine), the job engine's reaper and the API.

An *attempt* is one run of a fit by one worker. :func:`claim` starts attempt
``n + 1`` (``queued`` -> ``running``); every later write of that attempt is guarded by
``status = 'running' AND attempts = n + 1``. So a late finisher of an abandoned
attempt (its worker was presumed dead and the job retried; the user cancelled it)
writes nothing: one result per version, from the attempt that owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.storage import loops
from service.storage.db import CalibratorVersion, Dataset, Model, json_bytes, utcnow
from service.vocabulary import FROM_PARAMS, UNFINISHED


@dataclass(frozen=True)
class FitTask:
    """What an attempt needs of the version it claimed: the keyword arguments of
    :func:`service.jobs.fitting.fit_job` (of :func:`~service.jobs.fitting.import_job`
    for a version from posted parameters), the hashes of the dataset's arrays (the
    labels' None for scores without labels, the sequence ids' None when it has none),
    the attempt's number, the posted parameters (None for a fit), and what a
    recalibration loop's candidate compares itself with (None for any other version)."""

    spec: dict[str, Any]
    scores_sha256: str
    labels_sha256: str | None
    attempt: int
    params: dict[str, Any] | None = None
    sequences_sha256: str | None = None
    comparing: loops.Comparing | None = None
    #: The token ids of a top-k dataset's rows (``scores_sha256`` their log-probabilities).
    topk_ids_sha256: str | None = None


def _running(version_id: int, attempt: int):
    return (
        CalibratorVersion.id == version_id,
        CalibratorVersion.status == "running",
        CalibratorVersion.attempts == attempt,
    )


def claim(sessions: sessionmaker, version_id: int, worker: str, max_attempts: int) -> FitTask | str:
    """Start the next attempt of a queued version and return its :class:`FitTask`.

    If the version is not queued, its status instead (``"missing"`` when there is no
    such version). A version that already had ``max_attempts`` attempts is marked
    failed (its workers kept dying or being stopped) and ``"failed"`` is returned.
    """
    with sessions() as s, s.begin():
        row = s.get(CalibratorVersion, version_id, with_for_update=True)
        if row is None or row.status != "queued":
            return row.status if row is not None else "missing"
        if row.attempts >= max_attempts:
            row.status, row.finished_at = "failed", utcnow()
            row.error = (
                f"gave up after {row.attempts} attempts: each one's worker stopped or was "
                "lost before the fit ended"
            )
            loops.candidate_stopped(s, version_id, f"its fit failed ({row.error})")
            return "failed"
        dataset = s.get(Dataset, row.dataset_id)
        policy = s.get(Model, row.model_id).argmax_policy
        row.status, row.started_at, row.progress = "running", utcnow(), 0.0
        row.attempts, row.worker = row.attempts + 1, worker[:128]
        spec = {
            "kind": dataset.kind,
            "holdout": row.holdout,
            "seed": row.seed,
            "argmax_policy": policy,
        }
        if dataset.top_k is not None:  # top-k rows out of a vocabulary of n_classes
            spec["vocab_size"] = dataset.n_classes
        params = None
        if row.source == FROM_PARAMS:  # posted parameters to evaluate, not a fit
            params = dict(row.params)
        else:
            spec |= {"method": row.method, "options": dict(row.options or {}), "refit": row.refit}
        return FitTask(
            spec, dataset.scores_sha256, dataset.labels_sha256, row.attempts, params,
            dataset.sequences_sha256, loops.comparing(s, version_id), dataset.topk_ids_sha256,
        )


def record_progress(sessions: sessionmaker, version_id: int, attempt: int, progress: float) -> None:
    with sessions() as s, s.begin():
        s.execute(
            update(CalibratorVersion)
            .where(*_running(version_id, attempt))
            .values(progress=progress)
        )


def finish(
    sessions: sessionmaker,
    version_id: int,
    attempt: int,
    also: Callable[[Session], Any] | None = None,
    **columns: Any,
) -> bool:
    """Write attempt ``attempt``'s outcome (all columns in one transaction, ``n_bytes``
    the size of its ``params``); False if that attempt no longer owns the version
    (cancelled, handed back, retried). ``also(session)`` writes what goes with the
    outcome (a loop run's end), in its transaction, only when it was written."""
    if columns.get("params") is not None:
        columns["n_bytes"] = json_bytes(columns["params"])
    with sessions() as s, s.begin():
        res = s.execute(
            update(CalibratorVersion)
            .where(*_running(version_id, attempt))
            .values(finished_at=utcnow(), **columns)
        )
        if res.rowcount == 1 and also is not None:
            also(s)
        return res.rowcount == 1


def hand_back(sessions: sessionmaker, version_id: int, attempt: int | None = None) -> bool:
    """Attempt ``attempt`` stopped before the end (its worker shut down or was lost):
    the version is queued again for the next attempt. False if that attempt no longer
    owned it. Without ``attempt``, whatever attempt is running (the reaper's call: the
    worker that ran it is gone and cannot say which attempt it was)."""
    with sessions() as s, s.begin():
        if attempt is None:
            where = (CalibratorVersion.id == version_id, CalibratorVersion.status == "running")
        else:
            where = _running(version_id, attempt)
        res = s.execute(
            update(CalibratorVersion).where(*where).values(status="queued", progress=0.0)
        )
        return res.rowcount == 1


def cancel(session: Session, version: CalibratorVersion) -> str | None:
    """Mark a queued or running version cancelled in ``session``'s transaction (the
    caller commits, with the job engine's own cancel); returns the status it had, or
    None if it was no longer queued or running."""
    before = version.status
    res = session.execute(
        update(CalibratorVersion)
        .where(CalibratorVersion.id == version.id, CalibratorVersion.status.in_(UNFINISHED))
        .values(status="cancelled", finished_at=utcnow(), error="cancelled by a user")
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:
        return None
    loops.candidate_stopped(session, version.id, "its fit was cancelled by a user")
    return before


def requeue_running(sessions: sessionmaker) -> int:
    """Queue again every running version; returns how many. For the embedded (SQLite)
    mode only, before its workers start: the process that ran them is gone, and they go
    again as their next attempt."""
    with sessions() as s, s.begin():
        return s.execute(
            update(CalibratorVersion)
            .where(CalibratorVersion.status == "running")
            .values(status="queued", progress=0.0)
        ).rowcount


def queued(sessions: sessionmaker) -> list[tuple[int, str]]:
    """(id, namespace) of every queued version, oldest first."""
    with sessions() as s:
        rows = s.execute(
            select(CalibratorVersion.id, Model.namespace)
            .join(Model, Model.id == CalibratorVersion.model_id)
            .where(CalibratorVersion.status == "queued")
            .order_by(CalibratorVersion.id)
        ).all()
    return [(r.id, r.namespace) for r in rows]


def fail(sessions: sessionmaker, version_id: int, error: str, attempt: int | None = None) -> bool:
    """Mark a version failed with ``error``: attempt ``attempt``'s if given (guarded as
    :func:`finish`), else whatever unfinished state it is in."""
    with sessions() as s, s.begin():
        if attempt is None:
            where = (CalibratorVersion.id == version_id, CalibratorVersion.status.in_(UNFINISHED))
        else:
            where = _running(version_id, attempt)
        res = s.execute(
            update(CalibratorVersion)
            .where(*where)
            .values(status="failed", error=error, finished_at=utcnow())
        )
        if res.rowcount == 1:
            loops.candidate_stopped(s, version_id, f"its fit failed ({error})")
        return res.rowcount == 1


def set_job_id(session: Session, version: CalibratorVersion, job_id: int) -> None:
    session.execute(
        update(CalibratorVersion)
        .where(CalibratorVersion.id == version.id)
        .values(job_id=job_id)
        .execution_options(synchronize_session=False)
    )
    version.job_id = job_id


def count_unfinished(session: Session, namespace: str | None = None) -> int:
    """Fits queued or running, in ``namespace`` (every namespace if None)."""
    stmt = (
        select(func.count())
        .select_from(CalibratorVersion)
        .where(CalibratorVersion.status.in_(UNFINISHED))
    )
    if namespace is not None:
        stmt = stmt.join(Model, Model.id == CalibratorVersion.model_id).where(
            Model.namespace == namespace
        )
    return session.scalar(stmt)


@dataclass(frozen=True)
class QueueRow:
    """One unfinished or recently finished fit, for the queue's gauges."""

    namespace: str
    status: str
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    fit_seconds: float | None


def queue_rows(session: Session, since: datetime, limit: int = 10_000) -> list[QueueRow]:
    """Every unfinished fit, and the fits finished since ``since`` (at most ``limit``
    of those, newest first): what the fit gauges of /metrics are computed from."""
    cols = (
        Model.namespace,
        CalibratorVersion.status,
        CalibratorVersion.attempts,
        CalibratorVersion.created_at,
        CalibratorVersion.started_at,
        CalibratorVersion.finished_at,
        CalibratorVersion.fit_seconds,
    )
    base = select(*cols).join(Model, Model.id == CalibratorVersion.model_id)
    unfinished = session.execute(base.where(CalibratorVersion.status.in_(UNFINISHED))).all()
    finished = session.execute(
        base.where(
            CalibratorVersion.status.not_in(UNFINISHED), CalibratorVersion.finished_at >= since
        )
        .order_by(CalibratorVersion.finished_at.desc())
        .limit(limit)
    ).all()
    return [QueueRow(*r) for r in (*unfinished, *finished)]


def fit_duration(sessions: sessionmaker, version_id: int) -> tuple[str, float] | None:
    """The method and fit seconds of a finished job (None if missing or not timed)."""
    with sessions() as s:
        row = s.execute(
            select(CalibratorVersion.method, CalibratorVersion.fit_seconds).where(
                CalibratorVersion.id == version_id
            )
        ).one_or_none()
    if row is None or row.fit_seconds is None:
        return None
    return row.method, row.fit_seconds


def status_of(sessions: sessionmaker, version_id: int) -> str:
    """A version's status (``"missing"`` when there is none)."""
    with sessions() as s:
        status = s.scalar(
            select(CalibratorVersion.status).where(CalibratorVersion.id == version_id)
        )
    return status if status is not None else "missing"
