"""The OpenAPI document says what the API really answers: problem+json errors, Bearer auth.

FastAPI documents each route's success and a 422 ``HTTPValidationError``; the
service answers every error as RFC 9457 ``application/problem+json``
(:mod:`service.server.problems`) and needs a key on every ``/v1`` route
(:mod:`service.security.auth`). :func:`install` post-processes the generated document
once: a ``Problem`` schema, the error statuses each operation can return, and
the ``bearer`` security scheme on every non-open operation. The fuzz test
(tests/service/api/test_fuzz.py) checks the responses against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from service.api import fit_options
from service.api.codecs.rules import MAX_SEQUENCE_ID_CHARS
from service.api.schemas import PredictOut
from service.server.budget import Budget, declare, flatten
from service.server.problems import OIP_PREFIX, PROBLEM_JSON
from service.vocabulary import KINDS

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details, plus extension members (errors, argmax, ...).",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
    "required": ["type", "title", "status", "detail", "instance"],
    "additionalProperties": True,
}

#: JSON schema of a score matrix (rows of numbers), shared by the request
#: bodies of datasets, predict and feedback.
SCORE_MATRIX: dict[str, Any] = {
    "type": "array",
    "items": {"type": "array", "items": {"type": "number"}},
}
#: ``{"logits" | "probabilities": [[...]]}`` properties of those bodies.
SCORE_PROPERTIES: dict[str, Any] = dict.fromkeys(KINDS, SCORE_MATRIX)
LABELS: dict[str, Any] = {"type": "array", "items": {"type": "integer"}}
#: A dataset's optional sequence id per row: all integers or all strings.
SEQUENCE_IDS: dict[str, Any] = {
    "oneOf": [
        {"type": "array", "items": {"type": "integer", "format": "int64"}},
        {"type": "array", "items": {"type": "string", "maxLength": MAX_SEQUENCE_ID_CHARS}},
    ],
    "description": "The sequence (text) of each row, when rows are tokens: every hold-out "
    "split is then by sequence.",
}
#: The media type of binary bodies and downloads that every client generator knows.
OCTET_STREAM = "application/octet-stream"
#: A binary body's media type object.
BINARY: dict[str, Any] = {"schema": {"type": "string", "format": "binary"}}


#: Answer models of routes FastAPI does not document from a response_model (the hot
#: routes): added to the document's schemas, so a client names them as we do.
DOCUMENTED_MODELS: tuple[type[BaseModel], ...] = (PredictOut,)


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to ``model``'s schema, one of :data:`DOCUMENTED_MODELS`."""
    if model not in DOCUMENTED_MODELS:
        raise ValueError(f"{model.__name__} is not among DOCUMENTED_MODELS. Got {model!r}.")
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def operation_id(route: APIRoute) -> str:
    """An operation's id: its function's name (``create_model``, ``predict``), short
    and stable, so generated clients read like the API (unique: a test checks)."""
    return route.name


#: Errors any /v1 operation may answer, and why.
ERRORS = {
    "400": "Malformed body (JSON, .npz, .npy, multipart).",
    "401": "Missing, unknown, revoked or expired API key.",
    "403": "The key's scope does not allow this operation.",
    "404": "Unknown model, dataset, version, alias or key (or another namespace's).",
    "409": "Conflict: duplicate name, version not fitted or rejected, still in use (a "
    "DELETE), namespace quota exceeded.",
    "413": "Body, rows per request or dataset rows over the limit, or larger than a quota.",
    "415": "Unsupported Content-Type.",
    "422": "Invalid input: schema, shapes, NaN/Inf, K, labels.",
    "429": "Too many fits queued, or the API key is over its rate limit (Retry-After).",
}
_OPEN_ERRORS = {"503": "Not ready: database unreachable or schema not at head."}


#: The Open Inference Protocol's error body (the routes under ``OIP_PREFIX``).
INFERENCE_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Open Inference Protocol error: what went wrong.",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}


def _problem(description: str, path: str = "") -> dict[str, Any]:
    if path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/"):
        ref = {"$ref": "#/components/schemas/InferenceError"}
        return {"description": description, "content": {"application/json": {"schema": ref}}}
    ref = {"$ref": "#/components/schemas/Problem"}
    return {"description": description, "content": {PROBLEM_JSON: {"schema": ref}}}


def document(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["Problem"] = PROBLEM_SCHEMA
    components["schemas"].update(fit_options.components())
    components["schemas"]["InferenceError"] = INFERENCE_ERROR_SCHEMA
    for model in DOCUMENTED_MODELS:
        components["schemas"][model.__name__] = model.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
    components.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key: `welltempered keys create` (scopes predict < write < admin).",
    }
    budgets = {
        (route.path, method.lower()): route.limits
        for route in flatten(app.routes)
        if isinstance(route, APIRoute) and hasattr(route, "limits")
        for method in route.methods
    }
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            limits = budgets[path, method]
            op["x-budget"] = limits.document()
            responses = op["responses"]
            errors = _OPEN_ERRORS if limits.scope is None else ERRORS
            for code, why in errors.items():
                if code in responses and code not in ("422", "503"):
                    responses[code].setdefault("content", _problem(why, path)["content"])
                else:
                    responses[code] = _problem(why, path)
            if limits.scope is not None:
                op["security"] = [{"bearer": []}]
                scope = limits.scope
                op["description"] = (op.get("description", "") + f"\n\nScope: `{scope}`.").strip()
    return schema


def install(app: FastAPI) -> None:
    """The document, built once on first use; FastAPI's route that serves it gets its
    budget here (open, its answer bounded like a large JSON read)."""
    for route in app.routes:
        if getattr(route, "path", None) == app.openapi_url:
            declare(Budget(scope=None, answer="max_json_bytes"))(route.endpoint)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi
