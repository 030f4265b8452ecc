"""Every error the API returns, as RFC 9457 ``application/problem+json``.

The one module that maps exceptions to HTTP: the service's own
:class:`Problem` subclasses, ``calibrators.CalibrationInputError`` (bad numbers:
422), FastAPI's request validation (400 for malformed JSON, 422 otherwise) and
Starlette's HTTP errors (unknown route, wrong method). Handlers raise; they
never build error responses themselves.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from calibrators import CalibrationInputError

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("welltempered.service")


class Problem(Exception):
    """An error with an HTTP status; extra keyword arguments become extension members."""

    status = 400
    slug = "bad-request"
    title = "Bad request"
    headers: dict[str, str] | None = None

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None, **extensions: Any):
        super().__init__(detail)
        self.detail = detail
        self.extensions = extensions
        if headers is not None:
            self.headers = headers


class MalformedBody(Problem):
    status, slug, title = 400, "malformed-body", "Malformed request body"


class MalformedJSON(MalformedBody):
    slug, title = "malformed-json", "Malformed JSON"


class Unauthorized(Problem):
    """No key, an unknown, revoked or expired key (RFC 6750: WWW-Authenticate: Bearer)."""

    status, slug, title = 401, "unauthorized", "Unauthorized"
    headers = {"WWW-Authenticate": 'Bearer realm="welltempered"'}  # noqa: RUF012


class Forbidden(Problem):
    """A valid key whose scope does not allow the operation."""

    status, slug, title = 403, "forbidden", "Forbidden"


class TooManyRequests(Problem):
    status, slug, title = 429, "too-many-requests", "Too many requests"


class NotFound(Problem):
    status, slug, title = 404, "not-found", "Not found"


class Conflict(Problem):
    status, slug, title = 409, "conflict", "Conflict"


class ArgmaxChanged(Conflict):
    slug, title = "argmax-changed", "Calibration changed held-out predictions"


class NotReady(Conflict):
    slug, title = "not-ready", "Calibrator version is not usable"


class ContentTooLarge(Problem):
    status, slug, title = 413, "content-too-large", "Content too large"


class UnsupportedMediaType(Problem):
    status, slug, title = 415, "unsupported-media-type", "Unsupported media type"


class InvalidInput(Problem):
    status, slug, title = 422, "invalid-input", "Invalid input"


def problem_response(
    request: Request,
    status: int,
    slug: str,
    title: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> Response:
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


async def _problem(request: Request, exc: Problem) -> Response:
    return problem_response(
        request, exc.status, exc.slug, exc.title, exc.detail, headers=exc.headers, **exc.extensions
    )


async def _calibration_input(request: Request, exc: CalibrationInputError) -> Response:
    return problem_response(request, 422, InvalidInput.slug, InvalidInput.title, str(exc))


def _loc(loc) -> str:
    return ".".join(str(p) for p in loc)


async def _request_validation(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        e = errors[0]
        reason = (e.get("ctx") or {}).get("error", "invalid JSON")
        return problem_response(
            request,
            400,
            MalformedJSON.slug,
            MalformedJSON.title,
            f"The body is not valid JSON: {reason} (at {_loc(e.get('loc', ()))}).",
        )
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
    app.add_exception_handler(Problem, _problem)
    app.add_exception_handler(CalibrationInputError, _calibration_input)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
