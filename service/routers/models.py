"""/v1/models: register a classifier, list them, read one."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from sqlalchemy import select

from service import store
from service.db import Model
from service.deps import ModelDep, SessionDep
from service.schemas import ModelCreate, ModelList, ModelOut
from service.uploads import require_json

router = APIRouter(prefix="/v1/models", tags=["models"])


def model_out(model: Model) -> ModelOut:
    return ModelOut.model_validate(model, from_attributes=True)


@router.post("", status_code=201, response_model=ModelOut, dependencies=[Depends(require_json)])
def create_model(body: ModelCreate, session: SessionDep, response: Response) -> ModelOut:
    model = store.create_model(session, body)
    response.headers["Location"] = f"/v1/models/{model.name}"
    return model_out(model)


@router.get("", response_model=ModelList)
def list_models(session: SessionDep) -> ModelList:
    return ModelList(
        models=[model_out(m) for m in session.scalars(select(Model).order_by(Model.name))]
    )


@router.get("/{model}", response_model=ModelOut)
def get_model(model: ModelDep) -> ModelOut:
    return model_out(model)
