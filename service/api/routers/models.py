"""/v1/models: register a classifier, list them, read one, delete one."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from service.api.deps import ModelDep, QuotasDep, SessionDep, StateDep
from service.api.schemas import DeletedOut, ModelCreate, ModelList, ModelOut
from service.api.uploads import require_json
from service.security import limits
from service.security.auth import PrincipalDep
from service.storage import registry
from service.storage.db import Model

router = APIRouter(prefix="/v1/models", tags=["models"])


def model_out(model: Model) -> ModelOut:
    return ModelOut.model_validate(model, from_attributes=True)


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
    )
    response.headers["Location"] = f"/v1/models/{model.name}"
    return model_out(model)


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, principal: PrincipalDep) -> ModelList:
    rows = registry.list_models(session, principal.namespace)
    return ModelList(models=[model_out(m) for m in rows])


@router.get("/{model}", response_model=ModelOut)
def get_model(model: ModelDep) -> ModelOut:
    return model_out(model)


@router.delete("/{model}", response_model=DeletedOut)
def delete_model(model: ModelDep, session: SessionDep, state: StateDep) -> DeletedOut:
    """Delete the model with its datasets, calibrator versions and feedback, in one
    transaction. 409 while it has an alias or a queued or running fit."""
    deleted = registry.delete_model(session, model, state.arrays)
    state.serving.forget(model.name, model.namespace, deleted.version_ids)
    return DeletedOut.model_validate(deleted, from_attributes=True)
