"""The queries behind live calibration and the /metrics gauges: the ``feedback_bins``
sums, and the registry figures :mod:`service.observe.monitoring` turns into gauges.

The numerics (what a bin's sums mean, reports, drift) are the observe package's;
this module only reads and adds rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Row, func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.storage.db import Alias, CalibratorVersion, FeedbackBin, Model

#: The summed columns of ``feedback_bins``, in the order :func:`window_sums` returns them.
SUMS = ("count", "correct_count", "confidence_sum", "nll_sum", "entropy_sum", "brier_sum")


def add_feedback(session: Session, rows: Sequence[dict[str, Any]]) -> None:
    """Add each row's :data:`SUMS` to its (version_id, bucket_start, bin_index) row: one
    ``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``, in the order given. Commits.

    The increment is evaluated by the database under the row's lock (PostgreSQL) or
    the write lock (SQLite), so concurrent writers add up; give the rows in bin order,
    so that two writers on PostgreSQL lock them in the same order (no deadlock).
    """
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(FeedbackBin).values(list(rows))
    stmt = stmt.on_conflict_do_update(
        index_elements=[FeedbackBin.version_id, FeedbackBin.bucket_start, FeedbackBin.bin_index],
        set_={name: getattr(FeedbackBin, name) + getattr(stmt.excluded, name) for name in SUMS},
    )
    try:
        session.execute(stmt)
        session.commit()
    except IntegrityError:  # the version was deleted since it was looked up
        session.rollback()
        raise NotFound("The calibrator version these rows were served by was deleted.") from None


def window_sums(
    session: Session, since: int, version_ids: Iterable[int] | None = None
) -> list[Row]:
    """``(version_id, bin_index, *SUMS)`` summed over the buckets starting at or after
    ``since``, for ``version_ids`` (every version if None)."""
    query = (
        select(
            FeedbackBin.version_id,
            FeedbackBin.bin_index,
            *(func.sum(getattr(FeedbackBin, name)) for name in SUMS),
        )
        .where(FeedbackBin.bucket_start >= since)
        .group_by(FeedbackBin.version_id, FeedbackBin.bin_index)
    )
    if version_ids is not None:
        query = query.where(FeedbackBin.version_id.in_(list(version_ids)))
    return list(session.execute(query))


def fits_by_status(session: Session) -> dict[tuple[str, str], int]:
    """Calibrator versions per (namespace, status) (pairs with none are absent)."""
    rows = session.execute(
        select(Model.namespace, CalibratorVersion.status, func.count())
        .join(Model, Model.id == CalibratorVersion.model_id)
        .group_by(Model.namespace, CalibratorVersion.status)
    ).all()
    return {(namespace, status): n for namespace, status, n in rows}


def fit_workers_alive(session: Session, stalled_seconds: float) -> int | None:
    """Workers of the job engine with a heartbeat in the last ``stalled_seconds``
    (PostgreSQL); None on SQLite, which has no job engine."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    return session.scalar(
        text(
            "SELECT count(*) FROM procrastinate_workers "
            "WHERE last_heartbeat > now() - make_interval(secs => :seconds)"
        ),
        {"seconds": stalled_seconds},
    )


def aliased_holdout(session: Session) -> list[Row]:
    """``(namespace, model, version, alias, metrics_after, argmax)`` of every alias, by
    namespace, model and alias."""
    return list(
        session.execute(
            select(
                Model.namespace,
                Model.name,
                CalibratorVersion.version,
                Alias.alias,
                CalibratorVersion.metrics_after,
                CalibratorVersion.argmax,
            )
            .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
            .join(Model, Model.id == Alias.model_id)
            .order_by(Model.namespace, Model.name, Alias.alias)
        ).all()
    )


def version_labels(session: Session, version_ids: Iterable[int]) -> list[Row]:
    """``(id, namespace, model, num_classes, version, metrics_after)`` of the versions."""
    ids = list(version_ids)
    if not ids:
        return []
    return list(
        session.execute(
            select(
                CalibratorVersion.id,
                Model.namespace,
                Model.name,
                Model.num_classes,
                CalibratorVersion.version,
                CalibratorVersion.metrics_after,
            )
            .join(Model, Model.id == CalibratorVersion.model_id)
            .where(CalibratorVersion.id.in_(ids))
        ).all()
    )
