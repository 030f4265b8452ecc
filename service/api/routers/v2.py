"""The Open Inference Protocol v2 over REST (KServe v2, Triton's HTTP/REST API).

Routes (docs/api.md, "Open Inference Protocol v2"):

- ``GET /v2/health/live``, ``GET /v2/health/ready``: open, like /healthz and /readyz;
- ``GET /v2``: server metadata (extensions: ``binary_tensor_data``);
- ``GET /v2/models/{name}[/versions/{version}]``: model metadata, ``.../ready``,
  ``.../config`` (the model configuration extension as Triton serves it: the JSON of
  the ``ModelConfig`` that :func:`calibrators.triton.model_config` gives the version);
- ``POST /v2/models/{name}[/versions/{version}]/infer``.

The model ``name`` is a model of the key's namespace, ``version`` a calibrator
version; without a version, the one :data:`service.vocabulary.DEFAULT_ALIAS`
points at. The model takes one input, ``logits`` (FP32, also FP64, FP16, BF16)
of shape ``[n, K]``, holding logits or, with the request parameter
``kind: "probabilities"``, probabilities; it answers ``probabilities``,
``confidence``, ``label`` and ``entropy``, and with the request parameter
``top_k`` the ``top_k_indices`` and ``top_k_probabilities`` of
:func:`service.serving.inference.top_k` (then, unless outputs are named, instead
of the whole ``probabilities`` row). When the model has ``class_names``, it also
answers ``label_name`` (BYTES, the UTF-8 name of each row's label) and, with
``top_k``, ``top_k_names`` (BYTES, the names of ``top_k_indices``); both are
listed in its metadata then, and answered by default.

A version fitted on top-k rows (``calibrators.topk``: a language model's top-k
log-probabilities) takes the inputs ``topk_ids`` (INT64) and ``topk_logprobs`` (FP32
or FP64), both ``[n, k]`` at the k it was fitted on, and answers ``probabilities``
(``[n, k]``, the calibrated top-k in the input's order), ``topk_ids`` (echoed) and
``tail`` (``[n]``, the mass of the rest of the vocabulary); its metadata and config
say so. Full scores sent to it, or top-k inputs sent to a full version, are a 422.

Tensors travel as JSON (``data``, row major) or with the binary tensor data
extension: the body is the JSON header, whose length the
``Inference-Header-Content-Length`` header gives, followed by the raw
little-endian bytes of each tensor whose ``parameters`` hold
``binary_data_size``; an output is sent that way when its ``binary_data``
parameter (default: the request's ``binary_data_output``) is true. A BYTES
tensor's binary form is the protocol's: per element, its length as a
little-endian uint32, then its bytes. Request
bodies may be gzip or deflate encoded (``Content-Encoding``), as tritonclient
can send them.

Infer is the /v1 predict path under another wire format: installed on the app
itself, authorised and parsed inline (no FastAPI parameter solving: see
:mod:`service.api.routers.predict`), and from validated scores on it is
:func:`service.serving.predict.calibrate`: the same cached ONNX session, the
same numbers, the same metrics. Errors are the service's domain errors, which
:mod:`service.server.problems` renders in the protocol's shape,
``{"error": "<detail>"}``, with the status of its table.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from calibrators import topk, triton
from service.api.auth import PrincipalDep, authorize
from service.api.codecs import answers, json_body, oip, rules
from service.api.deps import StateDep, get_app_state
from service.api.routers import health
from service.api.routers.predict import VERSION_HEADER
from service.api.uploads import read_body
from service.errors import (
    Conflict,
    ContentTooLarge,
    InvalidInput,
    NotFound,
)
from service.observe.metrics import ServiceMetrics
from service.observe.served import ServedCounts
from service.server import budget
from service.server.budget import declare
from service.server.hotpath import add_hot_route
from service.server.problems import OIP_PREFIX, problem_response
from service.serving.inference import TOP_K_OUTPUTS, Served, check_top_k
from service.serving.predict import calibrate, calibrate_topk
from service.storage import registry
from service.vocabulary import DEFAULT_ALIAS, KINDS, MAX_ID


def respond(
    served: Served,
    raw: bytes,
    head: int | None,
    bounds: rules.Bounds,
    metrics: ServiceMetrics,
    served_counts: ServedCounts,
    limits: answers.AnswerLimits,
) -> Response:
    """Parse, validate, bound the answer, run ONNX Runtime and serialise: CPU work."""
    top = served.topk_k is not None
    named = served.class_names is not None and not top
    what = f"Version {served.version} of {served.model!r}"
    request = oip.parse_request(raw, head, bounds, named, served.topk_k, what)
    total, as_json = oip.answer_bytes(request, served.max_name_bytes)
    limits.check(total, as_json, oip.TOPK_BINARY_FIX if top else oip.BINARY_ANSWER_FIX)
    if request.rows is not None:
        out = calibrate_topk(served, request.rows, bounds.max_rows, metrics)
        out[topk.IDS] = request.rows.ids
    else:
        out = calibrate(
            served, request.scores, request.kind, bounds.max_rows, metrics, served_counts,
            request.top_k,
        )
    encoded = oip.encode(served.model, served.version, served.class_names, request, out)
    headers = {VERSION_HEADER: str(served.version)}
    if not encoded.binary:
        return Response(encoded.head, media_type="application/json", headers=headers)
    headers[oip.HEADER_LENGTH] = str(len(encoded.head))
    if encoded.binary_bytes > answers.STREAM_ANSWER_BYTES:  # no copy: views of the arrays
        size, chunks = encoded.chunks()
        headers["Content-Length"] = str(size)
        return StreamingResponse(chunks, media_type=oip.OCTET_STREAM, headers=headers)
    return Response(encoded.body(), media_type=oip.OCTET_STREAM, headers=headers)


def version_number(text: str | None) -> int | None:
    """A path's version as a calibrator version number (404 for anything else)."""
    if text is None:
        return None
    if (text.isascii() and text.isdigit() and text[0] != "0" and len(text) <= oip.MAX_DIGITS
            and int(text) <= MAX_ID):
        return int(text)
    raise NotFound(f"No version {text!r}: versions are calibrator version numbers (1, 2, ...).")


@declare(budget.SCORES)
async def infer(request: Request) -> Response:
    # The hot path, resolved by plain calls like /v1 predict's: the caller, the served
    # version (cached), the body, whose decoded size is bounded by the model's K and the
    # row limit before it is read (service.server.budget); small bodies on the event loop,
    # larger ones in the thread pool.
    caller = await authorize(request)
    state = get_app_state(request)
    params = request.path_params
    version = version_number(params.get("version"))
    served = await state.serving.get(params["name"], None, version, caller.namespace)
    head = oip.header_length(request.headers.get(oip.HEADER_LENGTH))
    settings = state.settings
    bounds = rules.bounds(settings, "predict", served.num_classes, served.model)
    if served.topk_k is None:
        limit = json_body.json_body_limit(bounds, settings.max_json_bytes)
        per_row = bounds.num_classes * 8  # float64s
    else:  # k ids and k log-probabilities a row
        limit = json_body.topk_json_limit(bounds, served.topk_k, settings.max_json_bytes)
        per_row = served.topk_k * 16
    if head is not None:  # a JSON header, then at most max_rows rows of binary data
        if head > limit:
            raise ContentTooLarge(f"{oip.HEADER_LENGTH} is over the limit of {limit} bytes.")
        limit = min(settings.max_body_bytes, head + bounds.max_rows * per_row)
    budget.narrow(request, limit)
    raw = await read_body(request, limit)
    declared = budget.limits_of(request.scope).answer
    answer = answers.AnswerLimits.of(declared, settings.max_json_bytes, len(raw))
    args = (served, raw, head, bounds, state.metrics, state.served_counts, answer)
    if len(raw) <= settings.inline_predict_bytes:
        return respond(*args)
    return await anyio.to_thread.run_sync(respond, *args, limiter=state.predict_limiter)


# -- health and metadata ----------------------------------------------------------


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelReady(BaseModel):
    name: str
    ready: bool


TopKQuery = Annotated[
    int | None,
    Query(ge=1, le=MAX_ID, description="List the top-k outputs, shaped [-1, top_k]."),
]


@declare(budget.OPEN)
async def live() -> Live:
    """The process answers."""
    return Live(live=True)


@declare(budget.OPEN)
def ready(request: Request, state: StateDep) -> Ready | Response:
    """The database is reachable and at the latest revision (as /readyz), else 503."""
    ok, detail = health.readiness(state)
    if not ok:
        return problem_response(request, 503, health.UNAVAILABLE, "Service unavailable", detail)
    return Ready(ready=True)


@declare(budget.READ)
async def server_metadata(request: Request, caller: PrincipalDep) -> ServerMetadata:
    return ServerMetadata(
        name=oip.SERVER_NAME, version=request.app.version, extensions=list(oip.EXTENSIONS)
    )


def _servable(row, model) -> bool:
    try:
        registry.check_servable(row, model)
    except Conflict:
        return False
    return True


def _topk_tensors(k: int) -> tuple[dict, dict]:
    """The inputs and outputs of a top-k version of width ``k``: name -> (datatype, shape)."""
    inputs = {topk.IDS: ("INT64", [-1, k]), topk.LOGPROBS: ("FP32", [-1, k])}
    shapes = {"probabilities": [-1, k], topk.IDS: [-1, k], "tail": [-1]}
    return inputs, {n: (oip.TOPK_OUTPUT_DATATYPES[n], shape) for n, shape in shapes.items()}


def _model_metadata(
    state, caller, name: str, version: str | None, top_k: int | None
) -> ModelMetadata:
    with state.sessions() as session:
        model, row = registry.resolve_served(
            session, name, None, version_number(version), caller.namespace
        )
        listed = registry.list_versions(session, model)
        versions = [str(v.version) for v in listed if _servable(v, model)]
        width = registry.version_top_k(session, row)
    if width is not None:
        if top_k is not None:
            raise InvalidInput(
                f"top_k is for full scores; version {row.version} of {model.name!r} serves "
                f"top-k rows (k = {width}) and answers all of them."
            )
        inputs, top_outputs = _topk_tensors(width)
        return ModelMetadata(
            name=model.name, versions=versions, platform=oip.PLATFORM,
            inputs=[TensorMetadata(name=n, datatype=d, shape=s) for n, (d, s) in inputs.items()],
            outputs=[TensorMetadata(name=n, datatype=d, shape=s)
                     for n, (d, s) in top_outputs.items()],
        )
    k = model.num_classes
    outputs = {"probabilities": [-1, k], "confidence": [-1], "label": [-1], "entropy": [-1]}
    if model.class_names is not None:
        outputs["label_name"] = [-1]
    if top_k is not None:
        check_top_k(top_k, k)
        outputs |= {name: [-1, top_k] for name in TOP_K_OUTPUTS}
        if model.class_names is not None:
            outputs["top_k_names"] = [-1, top_k]
    return ModelMetadata(
        name=model.name,
        versions=versions,
        platform=oip.PLATFORM,
        inputs=[TensorMetadata(name=oip.INPUT, datatype="FP32", shape=[-1, k])],
        outputs=[
            TensorMetadata(name=n, datatype=oip.OUTPUT_DATATYPES[n], shape=shape)
            for n, shape in outputs.items()
        ],
    )


@declare(budget.READ)
def model_metadata(
    name: str, state: StateDep, caller: PrincipalDep, top_k: TopKQuery = None
) -> ModelMetadata:
    return _model_metadata(state, caller, name, None, top_k)


@declare(budget.READ)
def version_metadata(
    name: str, version: str, state: StateDep, caller: PrincipalDep, top_k: TopKQuery = None
) -> ModelMetadata:
    return _model_metadata(state, caller, name, version, top_k)


async def _model_ready(state, caller, name: str, version: str | None) -> ModelReady:
    served = await state.serving.get(name, None, version_number(version), caller.namespace)
    return ModelReady(name=served.model, ready=True)


@declare(budget.READ)
async def model_ready(name: str, state: StateDep, caller: PrincipalDep) -> ModelReady:
    return await _model_ready(state, caller, name, None)


@declare(budget.READ)
async def version_ready(
    name: str, version: str, state: StateDep, caller: PrincipalDep
) -> ModelReady:
    return await _model_ready(state, caller, name, version)


def _model_config(state, caller, name: str, version: str | None) -> dict:
    with state.sessions() as session:
        model, row = registry.resolve_served(
            session, name, None, version_number(version), caller.namespace
        )
        width = registry.version_top_k(session, row)
    config = triton.model_config(model.name, model.num_classes)
    if width is not None:  # what infer takes and answers (not the graph's one input)
        inputs, outputs = _topk_tensors(width)
        config["input"], config["output"] = (
            [{"name": n, "data_type": f"TYPE_{d}", "dims": s} for n, (d, s) in t.items()]
            for t in (inputs, outputs)
        )
        return config
    if model.class_names is not None:
        config["output"].append({"name": "label_name", "data_type": "TYPE_STRING",
                                 "dims": [-1]})
    return config


@declare(budget.READ)
def model_config(name: str, state: StateDep, caller: PrincipalDep) -> dict:
    return _model_config(state, caller, name, None)


@declare(budget.READ)
def version_config(name: str, version: str, state: StateDep, caller: PrincipalDep) -> dict:
    return _model_config(state, caller, name, version)


# -- OpenAPI ------------------------------------------------------------------------

_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "A model of the key's namespace.",
    "schema": {"type": "string"},
}
_VERSION = {
    "name": "version",
    "in": "path",
    "required": True,
    "description": f"A calibrator version number (without it: the {DEFAULT_ALIAS!r} alias).",
    "schema": {"type": "string"},
}
_HEADER = {
    "name": oip.HEADER_LENGTH,
    "in": "header",
    "required": False,
    "description": "Binary tensor data extension: the length of the JSON header, which "
    "the inputs' binary data follow.",
    "schema": {"type": "integer", "minimum": 0},
}
_PARAMETERS = {"type": "object", "additionalProperties": True}
_INFER_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string"},
        "parameters": {
            "type": "object",
            "additionalProperties": True,
            "properties": {
                "kind": {"type": "string", "enum": list(KINDS)},
                "top_k": {"type": "integer", "minimum": 1},
                "binary_data_output": {"type": "boolean"},
            },
        },
        "inputs": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "description": f"One tensor, {oip.INPUT!r}; for a version fitted on top-k rows, "
            f"two: {' and '.join(map(repr, oip.TOPK_INPUT_DATATYPES))}.",
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "enum": [oip.INPUT, *oip.TOPK_INPUT_DATATYPES]},
                    "shape": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "datatype": {"type": "string", "enum": list(dict.fromkeys(
                        [*oip.INPUT_DATATYPES,
                         *(d for t in oip.TOPK_INPUT_DATATYPES.values() for d in t)]))},
                    "parameters": {
                        "type": "object",
                        "additionalProperties": True,
                        "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
                    },
                    "data": {"type": "array", "items": {}},
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "enum": list(dict.fromkeys(
                        [*oip.OUTPUT_DATATYPES, *oip.TOPK_OUTPUT_DATATYPES]))},
                    "parameters": {
                        "type": "object",
                        "additionalProperties": True,
                        "properties": {"binary_data": {"type": "boolean"}},
                    },
                },
            },
        },
    },
}
_INFER_RESPONSE = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "datatype", "shape"],
                "properties": {
                    "name": {"type": "string"},
                    "datatype": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "parameters": _PARAMETERS,
                    "data": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                        "description": "Row major; strings for BYTES (class names).",
                    },
                },
            },
        },
    },
}


def _infer_doc(versioned: bool) -> dict:
    return {
        "parameters": [_NAME, *([_VERSION] if versioned else []), _HEADER],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _INFER_REQUEST},
                oip.OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
            },
        },
    }


_INFER_200 = {
    200: {
        "description": "The outputs: JSON, or with binary outputs the JSON header "
        f"({oip.HEADER_LENGTH} bytes) followed by their little-endian bytes.",
        "content": {"application/json": {"schema": _INFER_RESPONSE}, oip.OCTET_STREAM: {}},
    }
}


def install(app: FastAPI) -> None:
    """Add the /v2 routes to the app's own router; call it before
    :func:`service.api.auth.install`, like :func:`service.api.routers.predict.install`:
    infer authorises inline, the metadata routes through their own ``PrincipalDep``,
    and the two health routes are open (their budgets' scope is None)."""
    v2 = OIP_PREFIX
    routes = [
        (f"{v2}/health/live", live, "v2_live", {}),
        (f"{v2}/health/ready", ready, "v2_ready", {"response_model": Ready}),
        (v2, server_metadata, "v2_server_metadata", {}),
        (f"{v2}/models/{{name}}", model_metadata, "v2_model_metadata", {}),
        (f"{v2}/models/{{name}}/versions/{{version}}", version_metadata, "v2_version_metadata", {}),
        (f"{v2}/models/{{name}}/ready", model_ready, "v2_model_ready", {}),
        (f"{v2}/models/{{name}}/versions/{{version}}/ready", version_ready, "v2_version_ready", {}),
        (f"{v2}/models/{{name}}/config", model_config, "v2_model_config", {}),
        (f"{v2}/models/{{name}}/versions/{{version}}/config", version_config,
         "v2_version_config", {}),
    ]
    for path, endpoint, operation_id, extra in routes:
        app.add_api_route(
            path, endpoint, methods=["GET"], tags=["v2"], operation_id=operation_id, **extra
        )
    for versioned, path in (
        (False, f"{v2}/models/{{name}}/infer"),
        (True, f"{v2}/models/{{name}}/versions/{{version}}/infer"),
    ):
        add_hot_route(
            app,
            path,
            infer,
            tags=["v2"],
            operation_id="v2_version_infer" if versioned else "v2_model_infer",
            response_class=Response,
            openapi_extra=_infer_doc(versioned),
            responses=_INFER_200,
        )
