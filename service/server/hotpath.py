"""The serving routes' short way through the ASGI stack.

A request to FastAPI passes about ten layers before its endpoint runs: FastAPI's
telemetry check, Starlette's error middleware, FastAPI's exception-telemetry, body-limit
and exit-stack middlewares, the exception middleware, the router and the route's own
wrappers, each adding a call per ASGI message. For /v1 predict and /v2 infer on a
1 x 1,000 request, where the calibration itself takes tens of microseconds, that is a
tenth of the request's time (bench/README.md, "Serving against peers").

:class:`ServingApp` is FastAPI with one change: a POST that one of its hot routes
(:func:`add_hot_route`) matches goes straight to the
service's own middlewares (metrics, body timeout, body limit, database faults: the
same instances' classes and arguments as the full stack) and from them to the
endpoint. What the skipped layers did for such a request is done here:

- the route's path parameters, ``scope["route"]`` (the metrics' route template) and
  ``scope["app"]``, as the router sets them;
- an error the endpoint raises is answered by the app's exception handler for its
  class (problem+json, or the Open Inference Protocol's shape under /v2), as the
  exception middleware does; a transient database error passes on to the database
  fault middleware, as in the full stack;
- anything else is a 500 from the app's ``Exception`` handler, then raised again for
  uvicorn to log, as Starlette's error middleware does.

Everything else, a GET of the same path included, takes the full stack. So does every
request once FastAPI's OpenTelemetry instrumentation is active when the first hot
request arrives (a tracer, meter or logger provider configured): the spans are its.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from service.server.exchange import Exchange

Endpoint = Callable[[Request], Awaitable[Response]]


class ServingApp(FastAPI):
    """FastAPI whose hot routes skip Starlette's and FastAPI's layers (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hot_routes: list[Route] = []
        self._hot_stacks: list[tuple[Route, ASGIApp]] | None = None

    def add_hot_route(self, route: Route) -> None:
        """Take POSTs that ``route`` matches the short way (before the first request)."""
        self.hot_routes.append(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.hot_routes:
            stacks = self._hot_stacks
            if stacks is None:
                stacks = self._hot_stacks = self._build_hot_stacks()
            for route, stack in stacks:
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    scope["app"] = self
                    if self.root_path:
                        scope["root_path"] = self.root_path
                    await self._serve(stack, scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    # -- the short stack -------------------------------------------------------

    def _build_hot_stacks(self) -> list[tuple[Route, ASGIApp]]:
        """Each hot route's endpoint inside the service's middlewares; none (the full
        stack for everything) while FastAPI's OpenTelemetry instrumentation is on."""
        telemetry = getattr(self, "_native_telemetry", None)  # FastAPI 0.16x's own
        if telemetry is not None and telemetry.enabled():
            return []
        handlers = {
            key: handler
            for key, handler in self.exception_handlers.items()
            if isinstance(key, type) and key is not Exception
        }
        stacks = []
        for route in self.hot_routes:
            app: ASGIApp = _endpoint_app(route.endpoint, handlers)
            for cls, args, kwargs in reversed(self.user_middleware):
                app = cls(app, *args, **kwargs)
            stacks.append((route, app))
        return stacks

    async def _serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """``app`` with Starlette's last resort: a 500 from the ``Exception`` handler when
        nothing was sent yet, and the error raised again (uvicorn logs it)."""
        exchange, tracked = Exchange.of(scope, send)
        try:
            await app(scope, receive, tracked)
        except Exception as exc:
            if not exchange.started:
                response = await self.exception_handlers[Exception](Request(scope), exc)
                await response(scope, receive, send)
            raise


def _endpoint_app(endpoint: Endpoint, handlers: dict[type, Callable]) -> ASGIApp:
    """The endpoint as an ASGI app, its errors answered by ``handlers`` (by the nearest
    class in the error's method resolution order); errors without one propagate."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)

    return app


class _HotRoute(Route):
    """A Starlette route that names itself in ``scope["route"]`` when it matches, as
    FastAPI's routes do (FastAPI's router does not; the request metrics read it)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child


def add_hot_route(app: FastAPI, path: str, endpoint, **documented) -> None:
    """Serve POST ``path`` with ``endpoint(request) -> Response`` through a plain Starlette
    route, ahead of every other route; FastAPI's route for it only documents it.

    FastAPI's handler solves the endpoint's parameters, opens an exit stack and checks
    the response, per request, even for an endpoint that takes the bare Request: about
    a fifth of a 1 x 1,000 predict's time in the process (bench/README.md, "Serving
    against peers"). Starlette's route calls the endpoint and sends its answer; errors
    take the app's exception handlers either way. The documented route (``documented``
    are :meth:`FastAPI.add_api_route`'s arguments) stays in the app for /openapi.json,
    matched by no request, since the plain route matches first. On a
    :class:`ServingApp` (the service's app), its POSTs skip
    Starlette's and FastAPI's middleware layers as well.
    """
    app.add_api_route(path, endpoint, methods=["POST"], **documented)
    route = _HotRoute(path, endpoint, methods=["POST"])
    app.router.routes.insert(0, route)
    if isinstance(app, ServingApp):  # and past Starlette's layers
        app.add_hot_route(route)
