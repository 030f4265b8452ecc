"""/v1/models/{model}/aliases: movable names for versions (predict serves the default alias);
deleting one stops its serving."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from service.api.deps import AliasDep, ModelDep, SessionDep, StateDep
from service.api.pagination import Page, pages
from service.api.schemas import AliasList, AliasOut, AliasPut, DeletedOut
from service.api.uploads import require_json
from service.server import budget
from service.server.budget import declare
from service.storage import registry
from service.storage.db import Alias, CalibratorVersion, Model
from service.vocabulary import ALIAS_PATTERN

router = APIRouter(prefix="/v1/models/{model}/aliases", tags=["aliases"])


def alias_out(alias: Alias, model: Model, version: CalibratorVersion) -> AliasOut:
    return AliasOut(
        model=model.name, alias=alias.alias, version=version.version, updated_at=alias.updated_at
    )


@declare(budget.WRITE)
@router.put("/{alias}", response_model=AliasOut, dependencies=[Depends(require_json)])
def put_alias(
    alias: Annotated[str, Path(pattern=ALIAS_PATTERN)],
    body: AliasPut,
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
) -> AliasOut:
    """Point the alias at a version, atomically (creates the alias if needed)."""
    row = registry.find_version(session, model, body.version)
    registry.check_servable(row, model)
    saved = registry.set_alias(session, model, alias, row)
    state.serving.invalidate(model.name, model.namespace)
    return alias_out(saved, model, row)


@declare(budget.READ)
@router.get("", response_model=AliasList)
def list_aliases(
    model: ModelDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("aliases", str))],
    request: Request,
    response: Response,
) -> AliasList:
    """The model's aliases by name, a page at a time."""
    rows = registry.list_aliases(session, model, page.request)
    items, cursor = page.finish(
        rows, lambda row: row[0].alias, request, response,
        lambda row: alias_out(row[0], model, row[1]),
    )
    return AliasList(aliases=items, next_cursor=cursor)


@declare(budget.READ)
@router.get("/{alias}", response_model=AliasOut)
def get_alias(alias: AliasDep, model: ModelDep) -> AliasOut:
    row, version = alias
    return alias_out(row, model, version)


@declare(budget.REMOVE)
@router.delete("/{alias}", response_model=DeletedOut)
def delete_alias(
    alias: AliasDep, model: ModelDep, session: SessionDep, state: StateDep
) -> DeletedOut:
    """Delete the alias (not the version): predict through it answers 404 from now on
    (other worker processes: within ALIAS_CACHE_SECONDS)."""
    row, _ = alias
    deleted = registry.delete_alias(session, model, row.alias)
    state.serving.forget(model.name, model.namespace)
    return DeletedOut.model_validate(deleted, from_attributes=True)
