"""/healthz (the process answers) and /readyz (database reachable, schema at head)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from sqlalchemy.exc import SQLAlchemyError

from service.api.deps import AppState, StateDep
from service.server import budget
from service.server.budget import declare
from service.server.problems import problem_response
from service.storage import migrate
from service.storage.retry import retry_read

router = APIRouter(tags=["health"])
log = logging.getLogger("welltempered.health")
#: The problem type of a 503 from /readyz (not the 409 "not-ready" of a version).
UNAVAILABLE = "service-unavailable"


@declare(budget.OPEN)
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def readiness(state: AppState) -> tuple[bool, str]:
    """``(True, revision)`` when the database is reachable and at the latest revision,
    else ``(False, why)``; also the readiness of /v2/health/ready."""
    try:
        # Once more on a fresh connection if a pooled one was dropped: a killed
        # connection is not an unreachable database.
        current = retry_read(migrate.current_revision, state.engine)
    except SQLAlchemyError:
        # The driver's message can hold host names and SQL: it goes to the log only.
        log.warning("readiness check: the database is unreachable", exc_info=True)
        return False, "The database is unreachable."
    head = migrate.head_revision(state.settings.database_url)
    if current != head:
        return False, (
            f"The database is at revision {current}, not {head}: run `welltempered migrate`."
        )
    return True, current


@declare(budget.OPEN)
@router.get("/readyz", responses={503: {"description": "Not ready (problem+json)."}})
def readyz(request: Request, state: StateDep):
    ready, detail = readiness(state)
    if not ready:
        return problem_response(request, 503, UNAVAILABLE, "Service unavailable", detail)
    return {"status": "ready", "revision": detail}
