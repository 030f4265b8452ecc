"""The queries of the ``api_keys`` table: add, find by digest, list, revoke.

Only a key's sha256 is ever stored or looked up; making keys, and deciding what
a key may do, is :mod:`service.security`'s.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.storage.db import ApiKey, utcnow
from service.storage.pages import PageRequest, paged


def add_key(
    session: Session,
    *,
    prefix: str,
    digest: str,
    namespace: str,
    scope: str,
    description: str | None,
    expires_at: datetime | None,
) -> ApiKey:
    """A new key row, committed."""
    row = ApiKey(
        prefix=prefix,
        key_sha256=digest,
        namespace=namespace,
        scope=scope,
        description=description,
        created_at=utcnow(),
        expires_at=expires_at,
    )
    session.add(row)
    session.commit()
    return row


def live_key(session: Session, digest: str) -> ApiKey | None:
    """The key whose sha256 is ``digest``, unless revoked (expiry is the caller's check)."""
    return session.scalar(
        select(ApiKey).where(ApiKey.key_sha256 == digest, ApiKey.revoked_at.is_(None))
    )


def list_keys(
    session: Session, namespace: str | None = None, page: PageRequest | None = None
) -> list[ApiKey]:
    """The keys of ``namespace`` (of every namespace if None), oldest first."""
    query = select(ApiKey)
    if namespace is not None:
        query = query.where(ApiKey.namespace == namespace)
    return list(session.scalars(paged(query, ApiKey.id, page)))


def revoke_key(session: Session, key_id: int, namespace: str | None = None) -> None:
    """Mark the key revoked (the row is kept for the record); 404 if there is no such
    live key (in ``namespace``, when given)."""
    stmt = update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
    if namespace is not None:
        stmt = stmt.where(ApiKey.namespace == namespace)
    res = session.execute(stmt.values(revoked_at=utcnow()))
    session.commit()
    if res.rowcount != 1:
        where = " in this namespace" if namespace is not None else ""
        raise NotFound(f"No active key with id {key_id}{where}.")
