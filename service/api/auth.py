"""Who is calling: the one auth dependency of every route (the keys, scopes and limits
themselves are :mod:`service.security.auth`'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from service.security.auth import Authenticator, Principal
from service.settings import Settings


async def authorize(request: Request) -> Principal:
    """401/429/403, or the caller's :class:`~service.security.auth.Principal`, for the
    scope the route's budget declares (a route always has one by the time it asks)."""
    auth: Authenticator = request.app.state.welltempered_auth
    principal = await auth.authenticate(
        request.headers.get("authorization"),
        request.scope["route"].limits.scope,
        request.app.state.welltempered.sessions,
    )
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(authorize)]


def install(
    app: FastAPI, settings: Settings, on_rate_limited: Callable[[str], None] | None = None
) -> None:
    """Put :func:`authorize` on every route of ``app`` added from now on (call before
    including routers)."""
    app.state.welltempered_auth = Authenticator(settings, on_rate_limited)
    app.router.dependencies.append(Depends(authorize))
