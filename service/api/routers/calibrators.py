"""/v1/models/{model}/calibrators: start a background fit (or the evaluation of
parameters fitted elsewhere), follow it, cancel it, download its ONNX or a classifier's
ONNX fused with it, delete a version."""

from __future__ import annotations

from typing import Annotated, Any

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy.orm import Session

from calibrators import topk
from calibrators.evaluation.holdout import split_indices
from service.api.deps import AppState, ModelDep, SessionDep, StateDep, VersionDep
from service.api.idempotent import Claim, IdempotentJson
from service.api.openapi import BINARY, OCTET_STREAM
from service.api.pagination import Page, pages
from service.api.schemas import (
    DeletedOut,
    FitAccepted,
    FitRequest,
    Kind,
    ParamsImport,
    VersionList,
    VersionOut,
    VersionSummary,
)
from service.api.uploads import media_type, read_body, require_json
from service.errors import Conflict, InvalidInput, NotReady, UnsupportedMediaType
from service.jobs import evaluation
from service.jobs.fitting import (
    affordable,
    check_fit_request,
    check_labels,
    check_topk_fit,
    import_affordable,
    resolve_refit,
)
from service.security import limits
from service.server import budget
from service.server.budget import declare
from service.serving.inference import fused_onnx, onnx_bytes, version_params
from service.storage import fits, registry
from service.storage.db import CalibratorVersion, Dataset, Model
from service.storage.usage import Quotas
from service.vocabulary import FITTED

router = APIRouter(prefix="/v1/models/{model}/calibrators", tags=["calibrators"])


def version_url(model: Model, version: int) -> str:
    return f"/v1/models/{model.name}/calibrators/{version}"


def version_out(row: CalibratorVersion, model: Model) -> VersionOut:
    fitted = row.status in FITTED
    return VersionOut(
        model=model.name,
        version=row.version,
        status=row.status,
        progress=row.progress,
        dataset_id=row.dataset_id,
        method=row.method,
        kind=row.kind,
        format=None if not row.params else (
            "topk" if row.params.get("format") == topk.PARAMS_FORMAT else "scores"),
        chosen_method=row.chosen_method,
        holdout=row.holdout,
        seed=row.seed,
        options=row.options,
        refit=row.refit,
        params=row.params if fitted else None,
        metrics=({"before": row.metrics_before, "after": row.metrics_after} if fitted else None),
        argmax=row.argmax,
        candidates=row.candidates if fitted else None,
        warning=row.warning,
        rejection=row.rejection,
        rejected_for=row.rejected_for,
        error=row.error,
        source=row.source,
        fit_seconds=row.fit_seconds,
        attempts=row.attempts,
        worker=row.worker,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def check_split(dataset: Dataset, holdout: float, seed: int, state: AppState) -> None:
    """422 now, not a failed job later, when the split the job will make is impossible:
    a part would be empty, or (by sequence) hold no whole sequence."""
    groups = registry.dataset_sequences(state.arrays, dataset)
    split_indices(dataset.n_rows, holdout, seed, groups=groups)


@declare(budget.WRITE)
@router.post("", status_code=202, response_model=FitAccepted, dependencies=[Depends(require_json)])
def start_fit(
    body: FitRequest,
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    response: Response,
    claim: IdempotentJson,
) -> FitAccepted:
    """Queue a fit; it runs in the background. Poll the status URL."""
    if claim.replay is not None:
        return claim.replay
    dataset = registry.find_dataset(session, model, body.dataset_id)
    check_split(dataset, body.holdout, body.seed, state)
    refit = resolve_refit(body.method, body.refit)
    if dataset.top_k is not None:  # top-k rows: temperature alone, in memory O(N (k + G))
        check_topk_fit(body.method, body.options)
        return _enqueue(
            model, dataset, session, state, response, claim, method=body.method,
            holdout=body.holdout, seed=body.seed, options=body.options, refit=refit,
        )
    check_fit_request(body.method, body.options)  # 422 now for unknown options
    check_labels(body.method, body.options, dataset.labels_sha256 is not None)
    affordable(  # 422 now for a fit no worker can hold (auto: if no candidate fits)
        body.method,
        body.options,
        argmax_policy=model.argmax_policy,
        n_rows=dataset.n_rows,
        k=dataset.n_classes,
        itemsize=np.dtype(dataset.dtype).itemsize,
        holdout=body.holdout,
        budget=state.fits.config.memory_budget,
        refit=refit,
    )
    return _enqueue(
        model, dataset, session, state, response, claim, method=body.method,
        holdout=body.holdout, seed=body.seed, options=body.options, refit=refit,
    )


def _enqueue(
    model: Model,
    dataset: Dataset,
    session: Session,
    state: AppState,
    response: Response,
    claim: Claim,
    **version: Any,
) -> FitAccepted:
    """A queued version of ``model`` (429 when the fit queue is full; 409/413 past the
    ``versions`` or ``stored_bytes`` quota), its job submitted; the answer stored under
    the request's Idempotency-Key with the job's row."""
    limits.check_fit_queue(
        session,
        model.namespace,
        state.settings.max_queued_fits_per_namespace,
        state.settings.max_queued_fits,
    )
    queue = state.fits.queue

    def accepted(v: CalibratorVersion) -> FitAccepted:
        url = version_url(model, v.version)
        return FitAccepted(model=model.name, version=v.version, status="queued", status_url=url)

    def enqueue(s: Session, v: CalibratorVersion) -> None:
        queue.enqueue(s, v, model.namespace)
        answer = accepted(v)  # stored with the job's row
        claim.store(s, answer, status_code=202, headers={"Location": answer.status_url})

    row = registry.create_version(
        session,
        model,
        dataset,
        enqueue=enqueue,
        quotas=Quotas.from_settings(state.settings),
        **version,
    )
    queue.submitted(row.id, model.namespace)
    answer = accepted(row)
    response.headers["Location"] = answer.status_url
    return answer


@declare(budget.Budget("write", body="max_json_bytes", decoded="max_json_bytes"))
@router.post(
    "/import", status_code=202, response_model=FitAccepted, dependencies=[Depends(require_json)]
)
def import_params(
    body: ParamsImport,
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    response: Response,
    claim: IdempotentJson,
) -> FitAccepted:
    """Queue a version from a calibrator fitted elsewhere (its to_params() JSON): its job
    evaluates it on the dataset's hold-out rows and polices it by the model's argmax
    policy like a fit ('succeeded' or 'rejected'), without fitting. Poll the status URL.

    In the fit queue, like a fit: the evaluation of a large hold-out takes a fit
    worker's memory and time, which the fit budget and the queue's limits bound."""
    if claim.replay is not None:
        return claim.replay
    dataset = registry.find_dataset(session, model, body.dataset_id)
    return enqueue_import(
        model, dataset, session, state, response, claim, body.params, body.holdout, body.seed
    )


def enqueue_import(
    model: Model,
    dataset: Dataset,
    session: Session,
    state: AppState,
    response: Response,
    claim: Claim,
    params: dict[str, Any],
    holdout: float,
    seed: int,
) -> FitAccepted:
    """A queued version made from ``params``, evaluated and policed on the hold-out of
    ``dataset`` (``holdout``, ``seed``): posted params, and label shift's proposed
    correction. 422 now for params, a split or an evaluation that cannot be."""
    if dataset.top_k is not None:
        raise InvalidInput(
            f"dataset {dataset.id} holds top-k rows: posted parameters are evaluated on full "
            "(N, K) scores. Fit temperature on it instead, or import with a dataset of full "
            "scores. Got a top-k dataset."
        )
    if dataset.labels_sha256 is None:
        raise InvalidInput(
            "posted parameters are evaluated by their held-out NLL and ECE, which need "
            f"labels, and dataset {dataset.id} has none: import them with a labelled "
            "dataset. Got a dataset without labels."
        )
    check_split(dataset, holdout, seed, state)
    # 422 now; params that do not say what kind they were fitted on: the dataset's
    cal = evaluation.from_posted_params(params, model.num_classes, dataset.kind)
    import_affordable(  # 422 now for an evaluation no worker can hold
        cal.method,
        n_rows=dataset.n_rows,
        k=dataset.n_classes,
        itemsize=np.dtype(dataset.dtype).itemsize,
        holdout=holdout,
        budget=state.fits.config.memory_budget,
    )
    return _enqueue(
        model, dataset, session, state, response, claim, method=cal.method,
        holdout=holdout, seed=seed, options={}, params=cal.to_params(), kind=cal.kind_,
    )


@declare(budget.READ_LARGE)
@router.get("", response_model=VersionList)
def list_versions(
    model: ModelDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("calibrators"))],
    request: Request,
    response: Response,
) -> VersionList:
    """The model's versions by number, a page at a time."""
    rows = registry.list_versions(session, model, page.request)
    items, cursor = page.finish(
        rows, lambda v: v.version, request, response,
        lambda v: VersionSummary.model_validate(v, from_attributes=True),
    )
    return VersionList(calibrators=items, next_cursor=cursor)


@declare(budget.READ_LARGE)
@router.get("/{version}", response_model=VersionOut)
def get_version(model: ModelDep, version: VersionDep) -> VersionOut:
    return version_out(version, model)


@declare(budget.REMOVE)
@router.delete("/{version}", response_model=DeletedOut)
def delete_version(
    model: ModelDep, version: VersionDep, session: SessionDep, state: StateDep
) -> DeletedOut:
    """Delete a calibrator version and its feedback statistics. 409 while an alias points
    at it or its fit is queued or running. Its number is never given again."""
    deleted = registry.delete_version(session, model, version)
    state.serving.forget(model.name, model.namespace, deleted.version_ids)
    return DeletedOut.model_validate(deleted, from_attributes=True)


@declare(budget.REMOVE)
@router.post("/{version}/cancel", response_model=VersionOut)
def cancel_fit(
    model: ModelDep, version: VersionDep, session: SessionDep, state: StateDep
) -> VersionOut:
    """Cancel a queued or running fit: a queued one never starts, a running one stops
    within seconds and frees its worker. 409 when the fit has already ended."""
    queue = state.fits.queue
    if fits.cancel(session, version) is None:
        session.rollback()
        raise Conflict(
            f"Version {version.version} of {model.name!r} is {version.status}: only a queued "
            "or running fit can be cancelled.",
            version_status=version.status,
        )
    queue.cancel(session, version)
    session.commit()
    queue.cancelled(version.id)
    session.refresh(version)
    return version_out(version, model)


@declare(budget.Budget("predict", answer="max_body_bytes"))
@router.get(
    "/{version}/onnx",
    response_class=Response,
    responses={200: {"content": {OCTET_STREAM: BINARY}, "description": "ONNX model"}},
)
def get_onnx(model: ModelDep, version: VersionDep) -> Response:
    _require_fitted(model, version)
    name = f"{model.name}-v{version.version}.onnx"
    return Response(
        onnx_bytes(version_params(version)),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


def _require_fitted(model: Model, version: CalibratorVersion) -> None:
    if version.status not in FITTED:
        raise NotReady(
            f"Version {version.version} of {model.name!r} is {version.status}: only a fitted "
            "version has an ONNX model.",
            version_status=version.status,
        )


OutputQuery = Annotated[
    str | None,
    Query(max_length=1024, description="The classifier's output holding the scores (default: "
          "detected, its one float output of shape [N, K])."),
]
FuseKindQuery = Annotated[
    Kind | None,
    Query(description="What that output holds (default: the kind the version was fitted on)."),
]


@declare(budget.Budget("predict", body="max_model_bytes", decoded="max_model_bytes",
                       answer="max_fused_bytes"))
@router.post(
    "/{version}/fuse",
    response_class=Response,
    responses={200: {"content": {OCTET_STREAM: BINARY}, "description": "The fused ONNX model"}},
    openapi_extra={"requestBody": {"required": True, "content": {OCTET_STREAM: BINARY}}},
)
async def fuse_model(
    request: Request,
    model: ModelDep,
    version: VersionDep,
    state: StateDep,
    output: OutputQuery = None,
    kind: FuseKindQuery = None,
) -> Response:
    """A classifier's ONNX model (the body) followed by this version's calibrator, as one
    ONNX model: the classifier's inputs, the four outputs of every calibrator
    (calibrators.fuse). 422 for a body that is not an ONNX model this can fuse (the
    problem says why: no or several score outputs, an unsupported opset...)."""
    _require_fitted(model, version)
    if media_type(request) != OCTET_STREAM:
        raise UnsupportedMediaType(
            f"This endpoint takes the classifier's ONNX file as {OCTET_STREAM}. Got "
            f"{media_type(request) or 'no Content-Type'!r}."
        )
    raw = await read_body(request, state.settings.max_model_bytes)
    params = version_params(version)
    fused = await anyio.to_thread.run_sync(fused_onnx, bytes(raw), params, output, kind)
    budget.check_answer(request, len(fused), "Raise WELLTEMPERED_MAX_FUSED_BYTES.")
    name = f"{model.name}-v{version.version}-fused.onnx"
    return Response(
        fused,
        media_type=OCTET_STREAM,
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
