"""Requests made under an ``Idempotency-Key``: applied once, answered the same on a retry.

A client that did not get an answer (a timeout, a dropped connection, a 503 whose
``applied`` is ``unknown``) cannot tell whether its write happened; repeating a write
that did happen would apply it twice. The IETF draft "The Idempotency-Key HTTP Header
Field" (draft-ietf-httpapi-idempotency-key-header, "Idempotency Fingerprint",
"Idempotency Enforcement Scenarios", "Error Scenarios") gives the rules this module
keeps. A key's row records the request it was made for (its route and a fingerprint:
the sha256 of the route, path and query parameters and body digest, computed by the
API) and, once the write is done, the answer:

1. :func:`begin` (after the body is read, before any work) commits the row
   ``in_flight``, holding this attempt's token, or finds the key used. Same
   fingerprint and done: the stored answer, to send again without doing anything. A
   different fingerprint: :class:`~service.errors.IdempotencyKeyReused` (422), in
   flight or not. Same fingerprint, in flight: :class:`~service.errors.IdempotencyKeyInFlight`
   (409), until the lease of the attempt holding it passes (``lease`` seconds after it
   began); then that attempt is presumed lost (its process died, or its failure could
   not release the key) and this one takes the key over.
2. :func:`complete` (in the write's transaction, before its commit) stores the answer
   and marks the row done, so the answer exists exactly when the write does. If the
   attempt no longer holds the key (a retry took it over after the lease) it raises
   :class:`~service.errors.IdempotencyKeyInFlight`: the write rolls back.
3. :func:`release` (after a failure) deletes the row the attempt still holds in
   flight: an error is not stored, so the key may be used again (with a corrected
   request, or the same one).

The in-flight row and its release are bookkeeping, not the request's change: they stay
out of the request's write log (:class:`service.storage.retry.unrecorded`), so a write
that fails after :func:`begin` still reports ``applied: no``.

Keys are per namespace, live ``ttl`` seconds (``WELLTEMPERED_IDEMPOTENCY_KEY_SECONDS``)
from the time they were claimed, and each :func:`begin` first deletes the namespace's
expired keys, so the table holds about one window of keys.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.errors import IdempotencyKeyInFlight, IdempotencyKeyReused
from service.storage.db import IdempotencyKey, as_utc, utcnow
from service.storage.retry import unrecorded
from service.vocabulary import DONE, IN_FLIGHT


@dataclass(frozen=True)
class Attempt:
    """A key held in flight by this request: its row is ours while ``token`` is in it."""

    namespace: str
    key: str
    token: str


def _row(namespace: str, key: str):
    return (IdempotencyKey.namespace == namespace, IdempotencyKey.key == key)


def begin(
    session: Session,
    namespace: str,
    key: str,
    *,
    model_id: int,
    route: str,
    fingerprint: str,
    ttl: float,
    lease: float,
) -> IdempotencyKey | Attempt:
    """Claim ``key`` for this request (committed), or the done row whose answer to replay.

    Raises :class:`~service.errors.IdempotencyKeyReused` when the key was used for a
    request with another fingerprint, and :class:`~service.errors.IdempotencyKeyInFlight`
    while the request holding it is within its lease.
    """
    with unrecorded():
        try:
            found = _begin(session, namespace, key, model_id, route, fingerprint, ttl, lease)
            session.commit()  # the claim, and the deletion of expired keys
        except BaseException:
            session.rollback()
            raise
    return found


def _begin(session, namespace, key, model_id, route, fingerprint, ttl, lease):
    now = utcnow()
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.namespace == namespace,
            IdempotencyKey.created_at < now - timedelta(seconds=ttl),
        )
    )
    attempt = Attempt(namespace, key, uuid.uuid4().hex)
    for _ in range(2):  # the row may go between the insert and the read (a release)
        if _insert(session, attempt, model_id, route, fingerprint, now):
            return attempt
        row = session.scalar(
            select(IdempotencyKey)
            .where(*_row(namespace, key))
            .execution_options(populate_existing=True)
        )
        if row is not None:
            break
    else:
        raise _in_flight(key, 1)
    if not _same_request(row, model_id, route, fingerprint):
        raise IdempotencyKeyReused(
            f"Idempotency-Key {key!r} was already used for a different request (its "
            f"route, model, query or body differ; the key's request was {row.route}): "
            "nothing was done. Use a new key for each request, and the same request for "
            "each retry of it.",
            idempotency_key=key,
        )
    if row.state == DONE:
        return row
    left = lease - (now - as_utc(row.created_at)).total_seconds()
    if left > 0:
        raise _in_flight(key, math.ceil(left))
    # The attempt holding the key outlived its lease: presumed lost, this one takes over.
    taken = session.execute(
        update(IdempotencyKey)
        .where(*_row(namespace, key), IdempotencyKey.state == IN_FLIGHT)
        .where(IdempotencyKey.attempt == row.attempt)
        .values(attempt=attempt.token, created_at=now)
        .execution_options(synchronize_session=False)
    ).rowcount
    if taken != 1:  # another retry took it over first
        raise _in_flight(key, math.ceil(lease))
    return attempt


def _insert(
    session: Session,
    attempt: Attempt,
    model_id: int,
    route: str,
    fingerprint: str,
    now: datetime,
) -> bool:
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert(IdempotencyKey)
        .values(
            namespace=attempt.namespace,
            key=attempt.key,
            model_id=model_id,
            route=route,
            fingerprint=fingerprint,
            state=IN_FLIGHT,
            attempt=attempt.token,
            created_at=now,
        )
        .on_conflict_do_nothing(index_elements=[IdempotencyKey.namespace, IdempotencyKey.key])
        .returning(IdempotencyKey.key)
    )
    return session.execute(stmt).first() is not None


def _same_request(row: IdempotencyKey, model_id: int, route: str, fingerprint: str) -> bool:
    if row.fingerprint is None:  # stored before fingerprints: a feedback post
        return row.route == route and row.model_id == model_id
    return row.fingerprint == fingerprint


def _in_flight(key: str, retry_after: int) -> IdempotencyKeyInFlight:
    return IdempotencyKeyInFlight(
        f"A request with Idempotency-Key {key!r} is still being processed: retry this "
        f"request with the same key after {retry_after} s, or later.",
        retry_after=max(1, retry_after),
        idempotency_key=key,
    )


def complete(
    session: Session,
    attempt: Attempt,
    status_code: int,
    response: dict[str, Any],
    headers: dict[str, str],
) -> None:
    """Store the answer and mark the key done, in the write's transaction (no commit).

    Raises :class:`~service.errors.IdempotencyKeyInFlight` when the attempt no longer
    holds the key (a retry took it over after its lease): roll the write back."""
    done = session.execute(
        update(IdempotencyKey)
        .where(*_row(attempt.namespace, attempt.key), IdempotencyKey.state == IN_FLIGHT)
        .where(IdempotencyKey.attempt == attempt.token)
        .values(state=DONE, status_code=status_code, response=response, headers=headers)
        .execution_options(synchronize_session=False)
    ).rowcount
    if done != 1:
        raise _in_flight(attempt.key, 1)


def release(session: Session, attempt: Attempt) -> None:
    """Delete the key's row if this attempt still holds it in flight (commits): after a
    failure, so the key may be used again. A done row (the write committed) stays."""
    with unrecorded():
        try:
            session.execute(
                delete(IdempotencyKey)
                .where(*_row(attempt.namespace, attempt.key), IdempotencyKey.state == IN_FLIGHT)
                .where(IdempotencyKey.attempt == attempt.token)
            )
            session.commit()
        except BaseException:
            session.rollback()
            raise
