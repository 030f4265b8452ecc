"""/v1/models/{model}/datasets: upload scores, labelled or not (JSON, .npz, multipart),
read them, delete them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy.orm import Session

from service.api.codecs import json_body, npz, rules
from service.api.deps import (
    DatasetDep,
    DtypeQuery,
    KindQuery,
    ModelDep,
    QuotasDep,
    SessionDep,
    StateDep,
)
from service.api.idempotent import idempotent
from service.api.openapi import LABELS, SCORE_PROPERTIES, SEQUENCE_IDS
from service.api.pagination import Page, pages
from service.api.schemas import DatasetList, DatasetOut, DeletedOut
from service.api.uploads import NPZ_TYPES, Upload, labelled_body
from service.errors import InvalidInput
from service.server import budget
from service.server.budget import declare
from service.storage import registry
from service.storage.db import Dataset, Model

router = APIRouter(prefix="/v1/models/{model}/datasets", tags=["datasets"])


async def receive_upload(
    request: Request, state: StateDep, model: ModelDep
) -> AsyncIterator[Upload]:
    """The body, read or spooled to disk by its media type (after the model is found)."""
    bounds = rules.bounds(state.settings, "dataset", model.num_classes, model.name)
    async with labelled_body(
        request,
        json_limit=json_body.json_body_limit(bounds, state.settings.max_json_bytes),
        temp_path=state.arrays.temp_path,
        multipart=True,
        split_scores=True,
        expected=f"Upload a dataset as application/json, a .npz body ({', '.join(NPZ_TYPES)}) "
        "or multipart/form-data with a file field 'file'.",
    ) as upload:
        yield upload


UploadDep = Annotated[Upload, Depends(receive_upload)]
IdempotentUpload = idempotent(receive_upload)

_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        **SCORE_PROPERTIES,
                        "labels": LABELS,
                        "sequence_ids": SEQUENCE_IDS,
                    },
                    "description": "Without labels: scores for label-free fits only.",
                }
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": ".npz: logits | probabilities | predictions, labels | "
                "ground_truth (optional: without them, for label-free fits only), "
                "optionally sequence_ids (integers or str)",
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}},
                    "required": ["file"],
                }
            },
        },
    }
}


def dataset_out(dataset: Dataset, model: Model, *, with_metrics: bool = True) -> DatasetOut:
    return DatasetOut(
        id=dataset.id,
        model=model.name,
        n=dataset.n_rows,
        k=dataset.n_classes,
        kind=dataset.kind,
        dtype=dataset.dtype,
        sha256=dataset.sha256,
        n_sequences=dataset.n_sequences,
        format="scores" if dataset.top_k is None else "topk",
        top_k=dataset.top_k,
        labelled=dataset.labels_sha256 is not None,
        created_at=dataset.created_at,
        metrics=dataset.metrics if with_metrics else None,
    )


@declare(budget.UPLOAD)
@router.post(
    "",
    status_code=201,
    response_model=DatasetOut,
    openapi_extra=_UPLOAD_DOC,
    responses={
        200: {
            "description": "Identical content was already uploaded: that dataset.",
            "model": DatasetOut,
        }
    },
)
def upload_dataset(
    model: ModelDep,
    upload: UploadDep,
    session: SessionDep,
    state: StateDep,
    quotas: QuotasDep,
    response: Response,
    claim: IdempotentUpload,
    kind: KindQuery = None,
    dtype: DtypeQuery = None,
) -> DatasetOut:
    """Store scores, labelled or not (optionally with the sequence id of each row): 201
    with the new dataset, or 200 with the dataset that has the same content. Scores
    without labels serve label-free fits only. With an
    ``Idempotency-Key``, a retry gets the first answer."""
    if claim.replay is not None:
        return claim.replay
    bounds = rules.bounds(state.settings, "dataset", model.num_classes, model.name, dtype)
    if upload.json is not None and json_body.is_topk(upload.json):
        if kind is not None or dtype is not None:
            raise InvalidInput("?kind and ?dtype are for full scores; top-k rows are "
                               "log-probabilities in JSON numbers. Drop them.")
        data = json_body.topk_from_json(upload.json, bounds, labelled=True)
    elif upload.json is not None:
        data, _ = json_body.labelled_from_json(upload.json, bounds, kind)
    else:
        data = npz.labelled_from_npz(upload.npz, bounds, kind)
    if isinstance(data, rules.TopKRows):  # log-probabilities, their ids beside them
        scores, labels, ids = data.rows.logprobs, data.labels, data.rows.ids
        kind_, scores_file = "logits", None
    else:
        scores, labels, ids, kind_ = data.scores, data.labels, None, data.kind
        scores_file = data.scores_file  # a split upload's member, stored as it is

    def answer(s: Session, dataset: Dataset, status_code: int) -> DatasetOut:
        out = dataset_out(dataset, model)
        location = {"Location": f"/v1/models/{model.name}/datasets/{dataset.id}"}
        claim.store(s, out, status_code=status_code, headers=location)
        response.status_code = status_code
        response.headers.update(location)
        return out

    dataset, created = registry.add_dataset(
        session, model, state.arrays, scores, labels, kind_, quotas,
        before_commit=lambda s, d: answer(s, d, 201), sequences=data.sequences,
        metrics_later=state.dataset_metrics.submit if state.dataset_metrics else None,
        scores_file=scores_file, topk_ids=ids,
    )
    if created:
        return dataset_out(dataset, model)
    out = answer(session, dataset, 200)  # nothing was written: the key commits alone
    session.commit()
    return out


@declare(budget.READ_LARGE)
@router.get("", response_model=DatasetList)
def list_datasets(
    model: ModelDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("datasets"))],
    request: Request,
    response: Response,
) -> DatasetList:
    """The model's datasets by id, a page at a time (without their metrics)."""
    rows = registry.list_datasets(session, model, page.request)
    items, cursor = page.finish(
        rows, lambda d: d.id, request, response,
        lambda d: dataset_out(d, model, with_metrics=False),
    )
    return DatasetList(datasets=items, next_cursor=cursor)


@declare(budget.READ_LARGE)
@router.get("/{dataset_id}", response_model=DatasetOut)
def get_dataset(model: ModelDep, dataset: DatasetDep) -> DatasetOut:
    return dataset_out(dataset, model)


@declare(budget.REMOVE)
@router.delete("/{dataset_id}", response_model=DeletedOut)
def delete_dataset(
    model: ModelDep,
    dataset: DatasetDep,
    session: SessionDep,
    state: StateDep,
    cascade: Annotated[
        bool,
        Query(
            description="Also delete the calibrator versions fitted on the dataset (refused "
            "while any of them has an alias or an unfinished fit)."
        ),
    ] = False,
) -> DeletedOut:
    """Delete the dataset; its array files are removed when no other dataset names them.
    409 while versions fitted on it exist, unless ``cascade=true``."""
    deleted = registry.delete_dataset(session, model, dataset, state.arrays, cascade)
    state.serving.forget(model.name, model.namespace, deleted.version_ids)
    return DeletedOut.model_validate(deleted, from_attributes=True)
