"""/v1/models/{model}/loop: the recalibration loop, opt-in per model (:mod:`service.jobs.loop`).

Its settings (``GET``/``PUT .../loop``), a run on request (``POST .../loop/runs``), the
runs and every step of them as events (``GET .../loop/runs``, ``GET .../loop/events``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from service.api.deps import ModelDep, SessionDep, StateDep
from service.api.idempotent import IdempotentJson
from service.api.pagination import Page, pages
from service.api.schemas import (
    LoopEventList,
    LoopEventOut,
    LoopOut,
    LoopRunList,
    LoopRunOut,
    LoopSettings,
    LoopStarted,
)
from service.api.uploads import require_json
from service.errors import InvalidInput
from service.jobs import loop
from service.server import budget
from service.server.budget import declare
from service.storage import loops
from service.storage.db import LoopEvent, LoopRun, Model
from service.vocabulary import MAX_ID

router = APIRouter(prefix="/v1/models/{model}/loop", tags=["loop"])


def loop_out(session, model: Model) -> LoopOut:
    """The model's settings (the defaults with ``keep_feedback`` off before it opted in)
    and what it keeps."""
    row = loops.settings_of(session, model)
    rows, n_bytes = loops.kept_summary(session, model)
    if row is None:
        settings = LoopSettings(keep_feedback=False)
        return LoopOut(
            **settings.model_dump(), model=model.name, kept_rows=rows, kept_bytes=n_bytes,
            updated_at=None,
        )
    settings = LoopSettings.model_validate(
        {name: getattr(row, name) for name in LoopSettings.model_fields}
    )
    return LoopOut(
        **settings.model_dump(), model=model.name, kept_rows=rows, kept_bytes=n_bytes,
        updated_at=row.updated_at,
    )


def run_out(row: LoopRun) -> LoopRunOut:
    return LoopRunOut(
        run=row.id,
        trigger=row.trigger,
        state=row.state,
        production_version=row.production_version,
        candidate_version=row.candidate_version,
        margin=row.margin,
        auto_promote=row.auto_promote,
        comparison=row.comparison,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


def event_out(row: LoopEvent) -> LoopEventOut:
    return LoopEventOut(
        id=row.id, run=row.run_id, step=row.step, message=row.message, details=row.details,
        created_at=row.created_at,
    )


@declare(budget.READ)
@router.get("", response_model=LoopOut)
def get_loop(model: ModelDep, session: SessionDep) -> LoopOut:
    """The model's loop settings and the feedback rows it keeps."""
    return loop_out(session, model)


@declare(budget.WRITE)
@router.put("", response_model=LoopOut, dependencies=[Depends(require_json)])
def put_loop(
    body: LoopSettings, model: ModelDep, session: SessionDep, state: StateDep
) -> LoopOut:
    """Set the model's loop (every field; an omitted one takes its default). Applied at
    once to the rows kept: all deleted when ``keep_feedback`` is false, the oldest
    dropped past ``retention_rows``."""
    if body.retention_rows > state.settings.max_dataset_rows:
        raise InvalidInput(
            "retention_rows must be at most WELLTEMPERED_MAX_DATASET_ROWS "
            f"({state.settings.max_dataset_rows}): a run's rows become a dataset. "
            f"Got {body.retention_rows}."
        )
    loops.put_settings(session, model, body.model_dump())
    return loop_out(session, model)


@declare(budget.Budget("write"))  # no body
@router.post("/runs", status_code=202, response_model=LoopStarted)
def start_run(
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    response: Response,
    claim: IdempotentJson,
) -> LoopStarted:
    """Start a run: refit production's method on the kept rows (an ordinary fit job,
    its version listed with the others), compare it with production on the held-back
    rows, promote it when better by the margin (automatically only with
    ``auto_promote``). 409 when the model keeps no feedback, has a run still fitting
    or too few kept rows. With an ``Idempotency-Key``, a retry gets the first answer."""
    if claim.replay is not None:
        return claim.replay
    base = f"/v1/models/{model.name}"

    def answer_of(run: LoopRun) -> LoopStarted:
        return LoopStarted(
            model=model.name,
            run=run.id,
            candidate_version=run.candidate_version,
            status_url=f"{base}/calibrators/{run.candidate_version}",
            events_url=f"{base}/loop/events?run={run.id}",
        )

    def store(s, run: LoopRun) -> None:
        answer = answer_of(run)
        claim.store(s, answer, status_code=202, headers={"Location": answer.events_url})

    run = loop.start(
        session, model, "request", settings=state.settings, arrays=state.arrays,
        queue=state.fits.queue, before_commit=store,
    )
    answer = answer_of(run)
    response.headers["Location"] = answer.events_url
    return answer


@declare(budget.READ_LARGE)
@router.get("/runs", response_model=LoopRunList)
def list_runs(
    model: ModelDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("loop-runs"))],
    request: Request,
    response: Response,
) -> LoopRunList:
    """The model's runs, oldest first, a page at a time, each with its comparison."""
    rows = loops.list_runs(session, model, page.request)
    items, cursor = page.finish(rows, lambda r: r.id, request, response, run_out)
    return LoopRunList(runs=items, next_cursor=cursor)


@declare(budget.READ_LARGE)
@router.get("/events", response_model=LoopEventList)
def list_events(
    model: ModelDep,
    session: SessionDep,
    page: Annotated[Page, Depends(pages("loop-events"))],
    request: Request,
    response: Response,
    run: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Only this run's.")] = None,
) -> LoopEventList:
    """Every step of the model's runs (started, candidate fitted, evaluated with its
    figures, promoted or not and why), oldest first, a page at a time."""
    rows = loops.list_events(session, model, page.request, run)
    items, cursor = page.finish(rows, lambda e: e.id, request, response, event_out)
    return LoopEventList(events=items, next_cursor=cursor)
