"""Limits and back-pressure, beyond the body sizes of :mod:`service.uploads`.

Rows per predict and per dataset (413), classes per model (422), and fits
waiting or running (429 with ``Retry-After``). The fit count is read from the
database, so it is the same for every worker process and replica.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db import CalibratorVersion
from service.problems import ContentTooLarge, InvalidInput, TooManyRequests

#: Seconds a client is told to wait when the fit queue is full.
FIT_RETRY_AFTER_SECONDS = 30


def check_rows(rows: int, limit: int, what: str) -> None:
    if rows > limit:
        raise ContentTooLarge(
            f"A {what} request holds at most {limit} rows (WELLTEMPERED_MAX_"
            f"{what.upper()}_ROWS); split it. Got {rows}.",
            max_rows=limit,
        )


def check_classes(num_classes: int, limit: int) -> None:
    if num_classes > limit:
        raise InvalidInput(
            f"num_classes must be at most {limit} (WELLTEMPERED_MAX_CLASSES). Got {num_classes}."
        )


def check_fit_queue(session: Session, limit: int) -> None:
    """429 when ``limit`` fits are already queued or running (all namespaces)."""
    busy = session.scalar(
        select(func.count())
        .select_from(CalibratorVersion)
        .where(CalibratorVersion.status.in_(("queued", "running")))
    )
    if busy >= limit:
        raise TooManyRequests(
            f"{busy} fits are queued or running, the limit (WELLTEMPERED_MAX_QUEUED_FITS) is "
            f"{limit}: try again later.",
            headers={"Retry-After": str(FIT_RETRY_AFTER_SECONDS)},
        )
