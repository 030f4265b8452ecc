"""The queries of fit jobs: a calibrator version row is its job (:mod:`service.jobs.fitting`).

Each function is one transaction of its own, opened from a session factory: the
callers are fit workers (maybe in another process) and the pool's callbacks,
outside any request. Every write after the claim is guarded by the status it
expects, so a job marked failed (a shutdown, a crash recovery) is never
overwritten by a late worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.storage.db import CalibratorVersion, Dataset, Model, utcnow
from service.vocabulary import UNFINISHED


@dataclass(frozen=True)
class FitTask:
    """What a worker needs of the version it claimed: the keyword arguments of
    :func:`service.jobs.fitting.fit_job` and the hashes of the dataset's arrays."""

    spec: dict[str, Any]
    scores_sha256: str
    labels_sha256: str


def claim(sessions: sessionmaker, version_id: int) -> FitTask | str:
    """Flip a queued version to running and return its :class:`FitTask`; if it is not
    queued, its status instead (``"missing"`` when there is no such version)."""
    with sessions() as s, s.begin():
        row = s.get(CalibratorVersion, version_id)
        if row is None or row.status != "queued":
            return row.status if row is not None else "missing"
        dataset = s.get(Dataset, row.dataset_id)
        policy = s.get(Model, row.model_id).argmax_policy
        row.status, row.started_at, row.progress = "running", utcnow(), 0.0
        spec = {
            "kind": dataset.kind,
            "method": row.method,
            "holdout": row.holdout,
            "seed": row.seed,
            "options": dict(row.options or {}),
            "argmax_policy": policy,
        }
        return FitTask(spec, dataset.scores_sha256, dataset.labels_sha256)


def record_progress(sessions: sessionmaker, version_id: int, progress: float) -> None:
    with sessions() as s, s.begin():
        s.execute(
            update(CalibratorVersion)
            .where(CalibratorVersion.id == version_id, CalibratorVersion.status == "running")
            .values(progress=progress)
        )


def finish(sessions: sessionmaker, version_id: int, **columns: Any) -> bool:
    """Write a running job's outcome (all columns in one transaction); False if it was
    no longer running."""
    with sessions() as s, s.begin():
        res = s.execute(
            update(CalibratorVersion)
            .where(CalibratorVersion.id == version_id, CalibratorVersion.status == "running")
            .values(finished_at=utcnow(), **columns)
        )
        return res.rowcount == 1


def fail_unfinished(sessions: sessionmaker, error: str, version_id: int | None = None) -> int:
    """Mark version ``version_id`` (every version if None) failed with ``error`` if it is
    still queued or running; returns how many were."""
    with sessions() as s, s.begin():
        stmt = update(CalibratorVersion).where(CalibratorVersion.status.in_(UNFINISHED))
        if version_id is not None:
            stmt = stmt.where(CalibratorVersion.id == version_id)
        res = s.execute(stmt.values(status="failed", error=error, finished_at=utcnow()))
        return res.rowcount


def count_unfinished(session: Session) -> int:
    """Fits queued or running, in every namespace."""
    return session.scalar(
        select(func.count())
        .select_from(CalibratorVersion)
        .where(CalibratorVersion.status.in_(UNFINISHED))
    )


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
