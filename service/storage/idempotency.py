"""Writes made under an ``Idempotency-Key``: applied once, answered the same on a retry.

A client that did not get an answer (a timeout, a dropped connection, a 503 whose
``applied`` is ``unknown``) cannot tell whether its write happened; repeating a
feedback post that did happen would count its rows twice. With a key, the write
and an ``idempotency_keys`` row holding its answer commit in one transaction, so
the row exists exactly when the write does:

1. :func:`find` (before the write): a live row for the key is the stored answer,
   to send back again without writing;
2. :func:`claim` (in the write's transaction, before its commit): inserts the row,
   or reports that a concurrent request with the same key got there first (the
   insert waits for that transaction; the caller then rolls back and answers
   with the winner's row).

Keys are per namespace, live ``ttl`` seconds (``WELLTEMPERED_IDEMPOTENCY_KEY_SECONDS``),
and each claim first deletes the namespace's expired keys, so the table holds about
one window of keys.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.storage.db import IdempotencyKey, utcnow


def find(session: Session, namespace: str, key: str, ttl: float) -> IdempotencyKey | None:
    """The live row of ``key`` in ``namespace`` (None if unused or expired)."""
    since = utcnow() - timedelta(seconds=ttl)
    return session.scalar(
        select(IdempotencyKey).where(
            IdempotencyKey.namespace == namespace,
            IdempotencyKey.key == key,
            IdempotencyKey.created_at >= since,
        )
    )


def claim(
    session: Session,
    namespace: str,
    key: str,
    model_id: int,
    response: dict[str, Any],
    ttl: float,
) -> bool:
    """Insert the key with the answer of the write about to commit (no commit here).

    False when a row for the key exists (a concurrent request committed it first):
    roll back and answer with :func:`find`'s row. Expired keys of the namespace are
    deleted first, so an expired key can be used again.
    """
    since = utcnow() - timedelta(seconds=ttl)
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.namespace == namespace, IdempotencyKey.created_at < since
        )
    )
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert(IdempotencyKey)
        .values(
            namespace=namespace,
            key=key,
            model_id=model_id,
            response=response,
            created_at=utcnow(),
        )
        .on_conflict_do_nothing(index_elements=[IdempotencyKey.namespace, IdempotencyKey.key])
        .returning(IdempotencyKey.key)
    )
    return session.execute(stmt).first() is not None
