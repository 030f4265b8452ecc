"""/v1/keys: an ``admin`` key manages the keys of its own namespace (see service.security.auth)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from service.api.auth import PrincipalDep
from service.api.deps import SessionDep
from service.api.pagination import Page, pages
from service.api.schemas import KeyCreate, KeyCreated, KeyList, KeyOut
from service.api.uploads import require_json
from service.security import keys
from service.server import budget
from service.server.budget import declare
from service.storage import keys as key_rows
from service.storage.db import ApiKey
from service.vocabulary import MAX_ID

router = APIRouter(prefix="/v1/keys", tags=["keys"])


def key_out(row: ApiKey) -> dict:
    return {
        "id": row.id,
        "prefix": row.prefix,
        "namespace": row.namespace,
        "scope": row.scope,
        "state": keys.key_state(row),
        "description": row.description,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
    }


@declare(budget.Budget("admin", body="max_metadata_bytes"))
@router.post("", status_code=201, response_model=KeyCreated, dependencies=[Depends(require_json)])
def create_key(body: KeyCreate, principal: PrincipalDep, session: SessionDep) -> KeyCreated:
    """A new key in the caller's namespace; the response is the only place it appears."""
    expires = timedelta(seconds=body.expires_in_seconds) if body.expires_in_seconds else None
    row, key = keys.create_key(session, principal.namespace, body.scope, expires, body.description)
    return KeyCreated(**key_out(row), key=key)


@declare(budget.Budget("admin", answer="max_json_bytes"))
@router.get("", response_model=KeyList)
def list_keys(
    principal: PrincipalDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("keys"))],
    request: Request,
    response: Response,
) -> KeyList:
    """The namespace's keys by id (revoked and expired ones too), a page at a time."""
    rows = key_rows.list_keys(session, principal.namespace, page.request)
    items, cursor = page.finish(
        rows, lambda r: r.id, request, response, lambda r: KeyOut(**key_out(r))
    )
    return KeyList(keys=items, next_cursor=cursor)


@declare(budget.Budget("admin"))
@router.delete("/{key_id}", status_code=204, response_class=Response)
def revoke_key(
    key_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
) -> Response:
    """Revoke: at once in this process, within KEY_CACHE_SECONDS in the others."""
    key_rows.revoke_key(session, key_id, principal.namespace)
    request.app.state.welltempered_auth.cache.clear()
    return Response(status_code=204)
