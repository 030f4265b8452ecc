"""/v1/models: register a classifier, list them, read one, delete one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from service.api.auth import PrincipalDep
from service.api.deps import ModelDep, QuotasDep, SessionDep, StateDep
from service.api.pagination import Page, pages
from service.api.schemas import DeletedOut, ModelCreate, ModelList, ModelOut, ModelPatch
from service.api.uploads import require_json
from service.security import limits
from service.server import budget
from service.server.budget import declare
from service.storage import registry
from service.storage.db import Model

router = APIRouter(prefix="/v1/models", tags=["models"])


def model_out(model: Model) -> ModelOut:
    return ModelOut.model_validate(model, from_attributes=True)


@declare(budget.WRITE)
@router.post("", status_code=201, response_model=ModelOut, dependencies=[Depends(require_json)])
def create_model(
    body: ModelCreate,
    session: SessionDep,
    principal: PrincipalDep,
    state: StateDep,
    quotas: QuotasDep,
    response: Response,
) -> ModelOut:
    limits.check_classes(body.num_classes, state.settings.max_classes)
    model = registry.create_model(
        session,
        principal.namespace,
        body.name,
        body.num_classes,
        body.class_names,
        body.argmax_policy,
        quotas,
        body.description,
    )
    response.headers["Location"] = f"/v1/models/{model.name}"
    return model_out(model)


@declare(budget.READ_LARGE)
@router.get("", response_model=ModelList)
def list_models(
    session: SessionDep,
    principal: PrincipalDep,
    page: Annotated[Page, Depends(pages("models"))],
    request: Request,
    response: Response,
) -> ModelList:
    """The namespace's models, oldest first, a page at a time."""
    rows = registry.list_models(session, principal.namespace, page.request)
    items, cursor = page.finish(rows, lambda m: m.id, request, response, model_out)
    return ModelList(models=items, next_cursor=cursor)


@declare(budget.WRITE)
@router.patch("/{model}", response_model=ModelOut, dependencies=[Depends(require_json)])
def patch_model(
    body: ModelPatch, model: ModelDep, session: SessionDep, state: StateDep
) -> ModelOut:
    """Change the model's class names, argmax policy or description (only the fields
    given; null clears class_names or description). Its name and number of classes never
    change; a new argmax policy applies to fits that start from now on."""
    row = registry.update_model(session, model, body.changes())
    state.serving.invalidate(model.name, model.namespace)
    return model_out(row)


@declare(budget.READ)
@router.get("/{model}", response_model=ModelOut)
def get_model(model: ModelDep) -> ModelOut:
    return model_out(model)


@declare(budget.REMOVE)
@router.delete("/{model}", response_model=DeletedOut)
def delete_model(model: ModelDep, session: SessionDep, state: StateDep) -> DeletedOut:
    """Delete the model with its datasets, calibrator versions and feedback, in one
    transaction. 409 while it has an alias or a queued or running fit."""
    deleted = registry.delete_model(session, model, state.arrays)
    state.serving.forget(model.name, model.namespace, deleted.version_ids)
    return DeletedOut.model_validate(deleted, from_attributes=True)
