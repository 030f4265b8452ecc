"""Keyset pagination of the registry's lists: rows after a key, in the key's order.

A list query is ordered by a unique, never-reused-while-listed key (an id, or an
alias's name within its model) and cut after the last key a client saw, so a page
never repeats or skips a row that existed through the listing, whatever is inserted
or deleted meanwhile (rows added after the cursor's key appear on later pages). The
API wraps the key in an opaque cursor (:mod:`service.api.pagination`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute


@dataclass(frozen=True)
class PageRequest:
    """Rows whose key is greater than ``after`` (all when None), at most ``limit`` of
    them; the query asks for one more, which tells whether a next page exists."""

    after: int | str | None = None
    limit: int | None = None


def paged(stmt: Select, key: InstrumentedAttribute, page: PageRequest | None) -> Select:
    """``stmt`` ordered by ``key``, cut to ``page`` (``limit + 1`` rows at most)."""
    stmt = stmt.order_by(key)
    if page is None:
        return stmt
    if page.after is not None:
        stmt = stmt.where(key > page.after)
    if page.limit is not None:
        stmt = stmt.limit(page.limit + 1)
    return stmt
