"""Time-bucketed counts per version: served rows per predicted class
(``served_classes``) and labelled feedback rows per NLL bin (``feedback_nll_bins``).

Both tables hold one count per (version, bucket, index), added to by an upsert
(``count = count + excluded.count``) evaluated by the database, so processes and
replicas writing the same row add up; a window is one ``SUM ... GROUP BY``. The
numerics (which index means what) are the observe package's; this module only adds
and reads rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, undefer

from service.errors import NotFound
from service.storage.db import (
    CalibratorVersion,
    Dataset,
    FeedbackNllBin,
    Model,
    ServedClass,
    as_utc,
)

#: Each count table and the name of its index column.
TABLES = {ServedClass: "class_index", FeedbackNllBin: "bin_index"}

#: A count row: (version id, bucket start, index, count).
CountRow = tuple[int, int, int, int]


def add_counts(
    session: Session, table: type, rows: Iterable[CountRow], *, commit: bool = True
) -> None:
    """Add each count to its (version, bucket, index) row of ``table``: one upsert, in key
    order (two writers on PostgreSQL lock rows in the same order: no deadlock). Commits
    unless ``commit`` is False (the caller's transaction goes on).

    Raises NotFound, with nothing written, when a version was deleted since it was read.
    """
    key = TABLES[table]
    values = [
        {"version_id": v, "bucket_start": b, key: i, "count": c} for v, b, i, c in sorted(rows) if c
    ]
    if not values:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.version_id, table.bucket_start, getattr(table, key)],
        set_={"count": table.count + stmt.excluded.count},
    )
    try:
        session.execute(stmt)
        if commit:
            session.commit()
    except IntegrityError:
        session.rollback()
        raise NotFound("A calibrator version these counts belong to was deleted.") from None


def window_counts(
    session: Session, table: type, since: int, version_ids: Iterable[int] | None = None
) -> dict[int, dict[int, int]]:
    """``{version id: {index: count}}`` summed over the buckets starting at or after
    ``since``, for ``version_ids`` (every version if None)."""
    index = getattr(table, TABLES[table])
    query = (
        select(table.version_id, index, func.sum(table.count))
        .where(table.bucket_start >= since)
        .group_by(table.version_id, index)
    )
    if version_ids is not None:
        query = query.where(table.version_id.in_(list(version_ids)))
    out: dict[int, dict[int, int]] = {}
    for version_id, i, count in session.execute(query):
        out.setdefault(version_id, {})[i] = int(count)
    return out


def live_versions(
    session: Session, keys: Iterable[tuple[int, datetime]]
) -> set[tuple[int, datetime]]:
    """The (id, created_at) keys that still name a version: SQLite gives a deleted
    version's id to the next one, so the id alone could credit a successor."""
    keys = list(keys)
    if not keys:
        return set()
    rows: Mapping = dict(
        session.execute(
            select(CalibratorVersion.id, CalibratorVersion.created_at).where(
                CalibratorVersion.id.in_({i for i, _ in keys})
            )
        ).all()
    )
    return {(i, t) for i, t in keys if i in rows and as_utc(rows[i]) == as_utc(t)}


def versions_with_datasets(
    session: Session, version_ids: Iterable[int]
) -> list[tuple[CalibratorVersion, Model, Dataset]]:
    """Each version of ``version_ids`` (its params loaded), its model and its dataset."""
    return [
        tuple(found)
        for found in session.execute(
            select(CalibratorVersion, Model, Dataset)
            .join(Model, Model.id == CalibratorVersion.model_id)
            .join(Dataset, Dataset.id == CalibratorVersion.dataset_id)
            .where(CalibratorVersion.id.in_(list(version_ids)))
            .options(undefer(CalibratorVersion.params))
        )
    ]
