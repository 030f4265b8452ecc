"""Every error the API returns, as RFC 9457 ``application/problem+json``.

The one module that maps exceptions to HTTP: the service's domain errors
(:mod:`service.errors`) and ``calibrators.CalibrationInputError`` (bad numbers:
422) through one table, :data:`PROBLEM_TYPES`; FastAPI's request validation (400
for malformed JSON, 422 otherwise) and Starlette's HTTP errors (unknown route,
wrong method). Handlers and the layers below raise; they never build error
responses themselves. Under :data:`OIP_PREFIX` the same errors take the Open
Inference Protocol's shape, ``{"error": "<detail>"}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from calibrators import CalibrationInputError
from service.errors import (
    ArgmaxChanged,
    Conflict,
    ContentTooLarge,
    DatabaseUnavailable,
    FitTooLarge,
    Forbidden,
    IdempotencyKeyInFlight,
    IdempotencyKeyReused,
    InUse,
    InvalidInput,
    MalformedBody,
    MalformedJSON,
    NotFound,
    NotReady,
    QuotaExceeded,
    RequestOverQuota,
    RequestTimeout,
    ServiceError,
    TooManyRequests,
    Unauthorized,
    UnsupportedMediaType,
)

PROBLEM_JSON = "application/problem+json"
#: The Open Inference Protocol's routes (:mod:`service.api.routers.v2`) answer errors in
#: the protocol's shape, ``{"error": detail}`` (application/json), with the status and
#: headers of the same table.
OIP_PREFIX = "/v2"
log = logging.getLogger("welltempered.service")


@dataclass(frozen=True)
class ProblemType:
    """The HTTP face of an error class: status, ``/problems/<slug>`` type, title, and
    the headers an error of the class adds (RFC 6750's ``WWW-Authenticate`` on a 401,
    ``Retry-After`` on a 429)."""

    status: int
    slug: str
    title: str
    headers: Callable[[Any], dict[str, str]] | None = None


def _bearer_challenge(exc: Unauthorized) -> dict[str, str]:
    return {"WWW-Authenticate": 'Bearer realm="welltempered"'}


def _retry_after(exc: TooManyRequests) -> dict[str, str]:
    return {"Retry-After": str(exc.retry_after)}


INVALID_INPUT = ProblemType(422, "invalid-input", "Invalid input")

#: Error class -> problem. An error takes the entry of its nearest class in this
#: table (its own, else its bases' in method resolution order).
PROBLEM_TYPES: dict[type[Exception], ProblemType] = {
    ServiceError: ProblemType(400, "bad-request", "Bad request"),
    MalformedBody: ProblemType(400, "malformed-body", "Malformed request body"),
    MalformedJSON: ProblemType(400, "malformed-json", "Malformed JSON"),
    Unauthorized: ProblemType(401, "unauthorized", "Unauthorized", _bearer_challenge),
    Forbidden: ProblemType(403, "forbidden", "Forbidden"),
    NotFound: ProblemType(404, "not-found", "Not found"),
    Conflict: ProblemType(409, "conflict", "Conflict"),
    ArgmaxChanged: ProblemType(409, "argmax-changed", "Calibration changed held-out predictions"),
    NotReady: ProblemType(409, "not-ready", "Calibrator version is not usable"),
    ContentTooLarge: ProblemType(413, "content-too-large", "Content too large"),
    UnsupportedMediaType: ProblemType(415, "unsupported-media-type", "Unsupported media type"),
    InvalidInput: INVALID_INPUT,
    FitTooLarge: ProblemType(422, "fit-too-large", "Fit too large for a worker"),
    CalibrationInputError: INVALID_INPUT,
    TooManyRequests: ProblemType(429, "too-many-requests", "Too many requests", _retry_after),
    InUse: ProblemType(409, "in-use", "Still in use"),
    # draft-ietf-httpapi-idempotency-key-header, "Error Scenarios": 422 for a key reused
    # with another request, 409 while the first request with the key is being processed.
    IdempotencyKeyReused: ProblemType(
        422, "idempotency-key-reused", "Idempotency-Key is already used"
    ),
    IdempotencyKeyInFlight: ProblemType(
        409,
        "idempotency-key-in-flight",
        "A request is outstanding for this Idempotency-Key",
        _retry_after,
    ),
    QuotaExceeded: ProblemType(409, "quota-exceeded", "Namespace quota exceeded"),
    RequestOverQuota: ProblemType(413, "request-over-quota", "Request larger than a quota"),
    RequestTimeout: ProblemType(408, "request-timeout", "Request timeout"),
    DatabaseUnavailable: ProblemType(
        503, "database-unavailable", "Database unavailable", _retry_after
    ),
}


def problem_type(exc: ServiceError | CalibrationInputError) -> ProblemType:
    """The entry of :data:`PROBLEM_TYPES` for ``exc``."""
    for cls in type(exc).__mro__:
        if cls in PROBLEM_TYPES:
            return PROBLEM_TYPES[cls]
    raise LookupError(f"{type(exc).__name__} is not an error of the problem table.")


def problem_response(
    request: Request,
    status: int,
    slug: str,
    title: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> Response:
    path = request.url.path
    if path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/"):
        return Response(
            orjson.dumps({"error": detail}),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )
    body = {
        "type": f"/problems/{slug}",
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        **extensions,
    }
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def error_response(
    request: Request,
    exc: ServiceError | CalibrationInputError,
    headers: dict[str, str] | None = None,
) -> Response:
    """The problem of a domain error (``headers`` are added to the class's own)."""
    kind = problem_type(exc)
    all_headers = {**(kind.headers(exc) if kind.headers else {}), **(headers or {})}
    if isinstance(exc, ServiceError):
        detail, extra = exc.detail, exc.extra
    else:
        detail, extra = str(exc), {}
    return problem_response(
        request, kind.status, kind.slug, kind.title, detail, all_headers or None, **extra
    )


async def _domain_error(request: Request, exc: ServiceError | CalibrationInputError) -> Response:
    return error_response(request, exc)


def _loc(loc) -> str:
    return ".".join(str(p) for p in loc)


async def _request_validation(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        e = errors[0]
        reason = (e.get("ctx") or {}).get("error", "invalid JSON")
        detail = f"The body is not valid JSON: {reason} (at {_loc(e.get('loc', ()))})."
        return error_response(request, MalformedJSON(detail))
    simple = [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": e.get("type")}
        for e in errors
    ]
    detail = "; ".join(f"{_loc(e['loc'])}: {e['msg']}" for e in simple)
    return problem_response(
        request, 422, "validation-error", "Request validation failed", detail, errors=simple
    )


async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    slug = phrase.lower().replace(" ", "-")
    detail = exc.detail if isinstance(exc.detail, str) else phrase
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"No route matches {request.method} {request.url.path}."
    if exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}."
    return problem_response(
        request, exc.status_code, slug, phrase, detail, headers=getattr(exc, "headers", None)
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    # A bug, not an input problem: log it with the traceback, answer 500 as a problem.
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(
        request, 500, "internal-error", "Internal server error", "An unexpected error occurred."
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _domain_error)
    app.add_exception_handler(CalibrationInputError, _domain_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
