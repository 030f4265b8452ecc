"""Every route's request budget: declared next to its handler, enforced in one place.

A route states, with :func:`declare` on its handler, what a request to it may cost:

- ``scope``: the key scope it needs (``None``: open, no key);
- ``body``: the most bytes of its body as sent (a :class:`~service.settings.Settings`
  field; ``None``: no body);
- ``decoded``: the most bytes of its body once a ``Content-Encoding`` (gzip or deflate)
  is undone (a settings field; ``None``: the route takes no ``Content-Encoding``);
- ``answer``: the most bytes of its answer (a settings field).

The numbers are resolved against the app's settings once, when the app is built
(:func:`attach`): a route without a budget is an error there, so a new route cannot
start unbounded. They are published in ``/openapi.json`` as each operation's
``x-budget`` (bytes), which is what the hostile-request harness reads.

:class:`BudgetMiddleware` enforces them for every route and every encoding, from the
first time the route asks for its body (routing has happened: ``scope["route"]`` is
the route), before a byte is read:

- a declared ``Content-Length`` over ``body``, or a body that passes it while
  streaming: 413;
- a ``Content-Encoding`` the route does not take: 415; one it takes is undone while
  the body streams, in steps of at most :data:`INFLATE_STEP` bytes, and the decoded
  bytes are counted against ``decoded`` (413 the moment they pass it: a 1 MB body
  that inflates to 1 GiB costs at most the decoded limit, never 1 GiB);
- a handler that knows more (the model's K and the row limit) narrows the decoded
  limit of its request with :func:`narrow` before it reads: the narrower limit is
  enforced the same way.

An answer's size is checked before it is computed, by the handler, against the
route's ``answer`` with :func:`check_answer` (predict and infer compute theirs from
the rows, the outputs, ``top_k`` and the longest class name). The middleware counts
what is actually sent: an answer over its bound is logged as a bug.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ContentTooLarge, MalformedBody, ServiceError, UnsupportedMediaType
from service.server.exchange import Exchange
from service.server.problems import error_response
from service.settings import Settings
from service.vocabulary import METRICS_SCOPE, TENANT_SCOPES

log = logging.getLogger("welltempered.budget")

#: zlib ``wbits`` of each ``Content-Encoding`` a route may take (gzip header, zlib header).
ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
#: Decoded bytes produced per inflate call at most: what one step of a bomb costs.
INFLATE_STEP = 64 * 1024
#: Steps of one chunk between two yields to the event loop (1 MiB of output): a 64 KB
#: chunk may inflate to 64 MiB, and the loop serves other requests meanwhile.
YIELD_STEPS = 16
#: Where a request's narrowed decoded limit lives in its ASGI scope (:func:`narrow`).
_NARROWED = "welltempered.decoded_limit"
_SCOPES = (*TENANT_SCOPES, METRICS_SCOPE)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Budget:
    """What a request to a route may cost (module docstring). Limits are names of
    :class:`~service.settings.Settings` fields, resolved by :meth:`resolve`."""

    scope: str | None
    body: str | None = None
    decoded: str | None = None
    answer: str = "max_metadata_bytes"

    def __post_init__(self) -> None:
        if self.scope is not None and self.scope not in _SCOPES:
            raise ValueError(f"scope must be one of {_SCOPES} or None. Got {self.scope!r}.")
        if self.decoded is not None and self.body is None:
            raise ValueError(f"A route without a body decodes none. Got decoded={self.decoded!r}.")
        for name in (self.body, self.decoded, self.answer):
            if name is not None and name not in Settings.model_fields:
                raise ValueError(f"Limits are Settings fields. Got {name!r}.")

    def resolve(self, settings: Settings) -> Limits:
        def get(name: str | None) -> int:
            return 0 if name is None else int(getattr(settings, name))

        return Limits(
            self.scope, get(self.body), get(self.decoded) if self.decoded else None,
            get(self.answer),
        )


@dataclass(frozen=True)
class Limits:
    """A :class:`Budget` in bytes, for one app's settings."""

    scope: str | None
    body: int
    decoded: int | None  # None: identity only
    answer: int

    def document(self) -> dict[str, Any]:
        """The operation's ``x-budget`` in /openapi.json."""
        return {
            "scope": self.scope,
            "body_bytes": self.body,
            "decoded_bytes": self.decoded,
            "encodings": sorted(ENCODINGS) if self.decoded is not None else [],
            "answer_bytes": self.answer,
        }


#: Routes that are not the service's own (static files): no body, a file as the answer.
STATIC = Budget(scope=None, answer="max_body_bytes")
#: What a request that matched no route may send (nothing: it is answered 404 or 405).
UNROUTED = Budget(scope=None)

# The budgets that many routes share; a route with other needs declares its own.
#: Open (probes, the API's description): no key, no body.
OPEN = Budget(scope=None)
#: A read of small metadata (a model, an alias, readiness).
READ = Budget("predict")
#: A read whose answer may hold large stored JSON (params, fit_info, lists of them).
READ_LARGE = Budget("predict", answer="max_json_bytes")
#: A change described by a small JSON body.
WRITE = Budget("write", body="max_metadata_bytes")
#: A change without a body (delete, cancel).
REMOVE = Budget("write")
#: Scores in, calibrated scores out (predict, infer): JSON or binary, any encoding.
SCORES = Budget("predict", body="max_body_bytes", decoded="max_body_bytes", answer="max_body_bytes")
#: Labelled scores in, a small answer: feedback (``predict`` keys send it).
FEEDBACK = Budget("predict", body="max_body_bytes", decoded="max_body_bytes")
#: Labelled scores stored as a dataset.
UPLOAD = Budget("write", body="max_body_bytes", decoded="max_body_bytes")


def declare(budget: Budget) -> Callable[[F], F]:
    """Give the handler below its route's budget (read by :func:`attach`)."""

    def mark(handler: F) -> F:
        handler.__budget__ = budget  # type: ignore[attr-defined]
        return handler

    return mark


def budget_of(route: Any) -> Budget | None:
    """The budget declared on a route's handler (a mount: :data:`STATIC`)."""
    endpoint = getattr(route, "endpoint", None)
    if endpoint is None:
        return STATIC if hasattr(route, "app") else None
    return getattr(endpoint, "__budget__", None)


class MissingBudget(TypeError):
    """A route was added without a declared budget."""


def flatten(routes: list) -> Iterator[Any]:
    """Every route of ``routes``, those of included routers (FastAPI) included."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is None:
            yield route
        else:
            yield from flatten(included.routes)


def attach(routes: list, settings: Settings) -> None:
    """Resolve every route's budget onto the route (``route.limits``); raise
    :class:`MissingBudget` naming the routes that declare none."""
    missing = []
    for route in flatten(routes):
        budget = budget_of(route)
        if budget is None:
            missing.append(f"{','.join(sorted(getattr(route, 'methods', ()) or ()))} "
                           f"{getattr(route, 'path', route)}")
            continue
        route.limits = budget.resolve(settings)
    if missing:
        names = ", ".join(missing)
        raise MissingBudget(
            "Every route declares its budget (service.server.budget.declare on its handler). "
            f"Got routes without one: {names}."
        )


def limits_of(scope: Scope) -> Limits | None:
    """The limits of the request's route (None before routing, or when nothing matched)."""
    return getattr(scope.get("route"), "limits", None)


def narrow(request: Request, limit: int) -> None:
    """Bound the rest of this request's body, once decoded, to ``limit`` bytes (what the
    handler now knows the request can need); the narrowest limit given applies."""
    scope = request.scope
    scope[_NARROWED] = min(limit, scope.get(_NARROWED, limit))


def check_answer(request: Request, nbytes: int, fix: str, limit: int | None = None) -> None:
    """Refuse (413, the limit named) an answer that could take ``nbytes``, before it is
    computed; ``limit`` defaults to the route's declared answer limit."""
    if limit is None:
        limits = limits_of(request.scope)
        limit = limits.answer if limits is not None else 0
    if nbytes > limit:
        raise ContentTooLarge(
            f"The answer could take {nbytes:,} bytes, more than its limit of {limit:,} "
            f"bytes. {fix}",
            answer_bytes=nbytes,
            limit=limit,
            fix=fix,
        )


def _too_large(limit: int, what: str = "request body") -> ContentTooLarge:
    return ContentTooLarge(f"The {what} is larger than the limit of {limit} bytes.", limit=limit)


class _Inflater:
    """A ``Content-Encoding`` undone a step at a time (at most :data:`INFLATE_STEP` bytes
    of output per step, whatever a chunk inflates to)."""

    def __init__(self, encoding: str):
        self.encoding = encoding
        self.zlib = zlib.decompressobj(ENCODINGS[encoding])

    def steps(self, data: bytes):
        pending = data
        while True:
            try:
                out = self.zlib.decompress(pending, INFLATE_STEP)
            except zlib.error as exc:
                raise MalformedBody(f"The {self.encoding} body is corrupt: {exc}.") from None
            if out:
                yield out
            pending = self.zlib.unconsumed_tail
            if not pending:
                return

    def finish(self) -> None:
        if not self.zlib.eof:
            raise MalformedBody(f"The {self.encoding} body is truncated.")
        if self.zlib.unused_data:
            raise MalformedBody(f"The {self.encoding} body has bytes after its end.")


class BudgetMiddleware:
    """Enforce the route's body, encoding and decoded limits while the body streams, and
    count its answer (module docstring). Nothing happens until the app reads its body."""

    def __init__(self, app: ASGIApp, default: Limits, routes: Callable[[], list] = list):
        self.app = app
        self.default = default  # routes that match nothing
        self.routes = routes  # the app's routes, once they are all in (after attach())
        self._flat: list | None = None

    def route_for(self, scope: Scope) -> Any:
        """The route that will serve ``scope`` (None: a 404 or 405 is coming)."""
        if self._flat is None:
            self._flat = list(flatten(self.routes()))
        for route in self._flat:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = _Request(self, scope, receive, send)
        body = False  # a body comes (declared or chunked)
        for key, value in scope["headers"]:
            if key == b"content-length":
                state.declared = value
                body = body or value != b"0"
            elif key == b"content-encoding":
                state.encoding = value.strip().lower()
            elif key == b"transfer-encoding":
                body = True
        encoded = bool(state.encoding) and state.encoding != b"identity"
        if encoded:
            # The app sees the decoded body, whose length is unknown until it has arrived
            # (and a Request made before the first read caches its headers: strip now).
            scope["headers"] = [
                (k, v) for k, v in scope["headers"]
                if k not in (b"content-encoding", b"content-length")
            ]
        if (body or encoded) and "route" not in scope:
            # Before routing (the short way routes first): a body or an encoding the route
            # cannot take is refused now, before its handler runs, read or not.
            route = self.route_for(scope)
            if route is not None:
                state.limits = route.limits
                error = state.check_headers()
                if error is None and body and route.limits.body == 0:
                    error = _too_large(0)  # chunked, to a route without a body
                if error is not None:
                    await state.refuse(error)
                    return
        await self.app(scope, state.receive, state.send_next)
        state.check_sent()


class _Request:
    """One request's budget state (the middleware's ``receive`` and ``send``)."""

    __slots__ = (
        "declared", "decoded", "encoding", "exchange", "inflater", "limits", "middleware",
        "raw", "receive_next", "refused", "scope", "send_next",
    )

    def __init__(self, middleware: BudgetMiddleware, scope: Scope, receive: Receive, send: Send):
        self.middleware = middleware
        self.scope = scope
        self.receive_next = receive
        # What the app sends is seen by the request's exchange: the bytes counted
        # against the answer's bound, and dropped once a refusal is out.
        self.exchange, self.send_next = Exchange.of(scope, send)
        self.limits: Limits | None = None
        self.inflater: _Inflater | None = None
        self.declared: bytes | None = None  # Content-Length as sent
        self.encoding: bytes | None = None  # Content-Encoding as sent
        self.raw = self.decoded = 0
        self.refused = False

    def check_sent(self) -> None:
        limits = self.limits or limits_of(self.scope)
        sent = self.exchange.sent
        if limits is not None and sent > limits.answer and not self.refused:
            log.error(
                "answer over its budget: %s %s sent %d bytes, its limit is %d",
                self.scope.get("method"), getattr(self.scope.get("route"), "path", "?"),
                sent, limits.answer,
            )

    async def refuse(self, error: ServiceError) -> Message:
        """Answer ``error`` now and tell the app the client left (raising instead would
        reach FastAPI's body parsing, which turns any error into a 400); once the answer
        has started, raise it."""
        if self.exchange.started:
            raise error
        response = error_response(Request(self.scope), error, headers={"Connection": "close"})
        await response(self.scope, self.receive_next, self.send_next)
        self.refused = self.exchange.closed = True
        return {"type": "http.disconnect"}

    def check_headers(self) -> ServiceError | None:
        """The refusals known from the headers alone (``limits`` known); the
        ``Content-Encoding`` taken, if any, set up."""
        limits = self.limits
        declared = self.declared
        if declared is not None and declared.isdigit() and int(declared) > limits.body:
            return _too_large(limits.body)
        encoding = self.encoding
        if encoding and encoding != b"identity":
            name = encoding.decode("latin-1")
            if limits.decoded is None:
                return UnsupportedMediaType(
                    f"This endpoint takes no Content-Encoding. Got {name!r}."
                )
            if name not in ENCODINGS:
                return UnsupportedMediaType(
                    f"Content-Encoding must be identity, {', '.join(ENCODINGS)}. Got {name!r}."
                )
            self.inflater = _Inflater(name)
        return None

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        if self.limits is None:  # the first read: routing has happened
            self.limits = limits_of(self.scope) or self.middleware.default
            error = self.check_headers()
            if error is not None:
                return await self.refuse(error)
        limits = self.limits
        message = await self.receive_next()
        if message["type"] != "http.request":
            return message
        body = message.get("body", b"")
        self.raw += len(body)
        if self.raw > limits.body:
            return await self.refuse(_too_large(limits.body))
        narrowed = self.scope.get(_NARROWED)
        if self.inflater is None:
            if narrowed is not None and self.raw > narrowed:
                return await self.refuse(_too_large(narrowed))
            return message
        limit = limits.decoded if narrowed is None else min(narrowed, limits.decoded)
        parts = []
        try:
            for step, part in enumerate(self.inflater.steps(body), 1):
                self.decoded += len(part)
                if self.decoded > limit:
                    return await self.refuse(_too_large(limit, "decoded request body"))
                parts.append(part)
                if step % YIELD_STEPS == 0:  # a chunk that inflates far: let others run
                    await asyncio.sleep(0)
            if not message.get("more_body", False):
                self.inflater.finish()
        except MalformedBody as exc:
            return await self.refuse(exc)
        return {"type": "http.request", "body": b"".join(parts),
                "more_body": message.get("more_body", False)}
