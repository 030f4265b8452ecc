"""Cursor pagination of every list route (RFC 8288 ``Link: rel="next"``).

``GET`` of a list takes ``?limit=`` (1 to :data:`MAX_LIMIT`, default
:data:`DEFAULT_LIMIT`; a page also ends early once its answer would pass the route's
answer budget) and ``?cursor=``, the opaque ``next_cursor`` of the previous
page. The body carries ``next_cursor`` (null on the last page) and the response a
``Link: <...>; rel="next"`` header with the same query plus that cursor. Rows come
in the order of their key (:mod:`service.storage.pages`): a page never repeats or
skips a row that existed through the listing.

A cursor is the list's name and the last key seen, as base64url JSON. It is opaque
to clients, not secret: a forged one can only start a listing elsewhere in the
caller's own rows. One that does not decode, belongs to another list, or holds a key
outside the key's range is a 422 problem.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Query, Request, Response
from pydantic import BaseModel, Field

from service.errors import InvalidInput
from service.storage.pages import PageRequest
from service.vocabulary import ALIAS_PATTERN, MAX_ID

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
#: A list's answer around its items: the list's key, next_cursor, brackets.
PAGE_ENVELOPE_BYTES = 1024
#: The longest cursor a list gives out is far shorter; longer is not one of ours.
MAX_CURSOR_CHARS = 256

_ALIAS = re.compile(ALIAS_PATTERN)
T = TypeVar("T")


#: The field of every list's body that pages it (declared last in each list).
NextCursor = Annotated[
    str | None,
    Field(
        description="Give it as ?cursor= for the next page (also in the Link header, "
        'rel="next"); null on the last page.'
    ),
]


@dataclass(frozen=True)
class Page:
    """A list request's page: which list, from where, how many."""

    name: str
    request: PageRequest
    limit: int
    #: The most bytes of the page's items as JSON (the route's answer budget, less
    #: :data:`PAGE_ENVELOPE_BYTES`).
    max_bytes: int | None = None

    def finish(
        self,
        rows: Sequence[T],
        key: Callable[[T], int | str],
        request: Request,
        response: Response,
        out: Callable[[T], BaseModel],
    ) -> tuple[list[BaseModel], str | None]:
        """This page's items (``out`` of each row) and the next page's cursor (None if
        this is the last); sets the ``Link`` header. ``rows`` is what the paged query
        returned (one row more than the limit when there is a next page). A page ends
        early, at a row boundary, once its items as JSON would pass :attr:`max_bytes`:
        a page is bounded in bytes as well as in rows (at least one item a page)."""
        more = len(rows) > self.limit
        items: list[BaseModel] = []
        total = 0
        for row in rows[: self.limit]:
            item = out(row)
            total += len(item.model_dump_json()) + 1
            if items and self.max_bytes is not None and total > self.max_bytes:
                more = True
                break
            items.append(item)
        if not more:
            return items, None
        cursor = encode(self.name, key(rows[len(items) - 1]))
        url = request.url.include_query_params(cursor=cursor, limit=self.limit)
        response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'
        return items, cursor


def encode(name: str, after: int | str) -> str:
    raw = orjson.dumps({"list": name, "after": after})
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _bad(name: str, cursor: str) -> InvalidInput:
    shown = cursor if len(cursor) <= 40 else cursor[:40] + "..."
    return InvalidInput(
        f"cursor must be the next_cursor of a previous page of this list ({name}); "
        f"omit it for the first page. Got {shown!r}."
    )


def decode(name: str, key_type: type, cursor: str) -> int | str:
    """The last key seen, from a cursor of list ``name``; 422 for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data: Any = orjson.loads(raw)
    except (binascii.Error, ValueError):
        raise _bad(name, cursor) from None
    if not isinstance(data, dict) or set(data) != {"list", "after"} or data["list"] != name:
        raise _bad(name, cursor)
    after = data["after"]
    if key_type is int:
        ok = type(after) is int and 0 <= after <= MAX_ID
    else:
        ok = isinstance(after, str) and _ALIAS.match(after) is not None
    if not ok:
        raise _bad(name, cursor)
    return after


def pages(name: str, key_type: type = int) -> Callable[..., Page]:
    """The dependency that reads ``?cursor=`` and ``?limit=`` of list ``name``, whose
    rows are keyed by ``key_type`` values (ids: int; alias names: str)."""

    def page(
        request: Request,
        cursor: Annotated[
            str | None,
            Query(
                min_length=1,
                max_length=MAX_CURSOR_CHARS,
                description="next_cursor of the previous page; omit for the first.",
            ),
        ] = None,
        limit: Annotated[
            int, Query(ge=1, le=MAX_LIMIT, description="Most rows in this page.")
        ] = DEFAULT_LIMIT,
    ) -> Page:
        after = None if cursor is None else decode(name, key_type, cursor)
        limits = getattr(request.scope.get("route"), "limits", None)  # the route's budget
        max_bytes = None if limits is None else limits.answer - PAGE_ENVELOPE_BYTES
        return Page(name, PageRequest(after=after, limit=limit), limit, max_bytes)

    return page
