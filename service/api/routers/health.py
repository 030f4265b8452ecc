"""/healthz (the process answers) and /readyz (database reachable, schema at head)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.exc import SQLAlchemyError

from service.api.deps import StateDep
from service.api.problems import problem_response
from service.storage import migrate

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready (problem+json)."}})
def readyz(request: Request, state: StateDep):
    url = state.settings.database_url
    try:
        current = migrate.current_revision(state.engine)
    except SQLAlchemyError as exc:
        return problem_response(
            request, 503, "not-ready", "Not ready", f"The database is unreachable: {exc}"
        )
    head = migrate.head_revision(url)
    if current != head:
        return problem_response(
            request,
            503,
            "not-ready",
            "Not ready",
            f"The database is at revision {current}, not {head}: run `welltempered migrate`.",
        )
    return {"status": "ready", "revision": current}
