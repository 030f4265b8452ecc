"""POST /v1/models/{model}/predict: calibrated probabilities through ONNX Runtime.

The hot path touches no database when warm: the (model, alias | version) ->
ONNX session resolution is cached (:class:`service.serving.inference.ServingCache`).
The CPU work (parse, validate, run, serialise) is explicit about where it
runs: small bodies on the event loop, where the work costs less than a thread
hop (bench/README.md, "Predict path, in process"); bodies over
``inline_predict_bytes`` in the thread pool, so a 16 MB ``.npy`` never
stalls the loop.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.api.auth import authorize
from service.api.codecs import answers, json_body, npy, npz, rules
from service.api.deps import AppState, get_app_state
from service.api.openapi import BINARY, OCTET_STREAM, SCORE_PROPERTIES, schema_ref
from service.api.schemas import Kind, PredictOut, ScoreDtype
from service.api.uploads import NPZ_TYPES, media_type, read_body, read_npy
from service.errors import InvalidInput, UnsupportedMediaType
from service.observe.metrics import ServiceMetrics
from service.observe.served import ServedCounts
from service.server import budget
from service.server.budget import declare
from service.server.hotpath import add_hot_route
from service.serving import inference
from service.serving.inference import Served
from service.serving.predict import calibrate, calibrate_topk
from service.vocabulary import DEFAULT_ALIAS, MAX_ID

PATH = "/v1/models/{model}/predict"
#: The same calibration, answered as .npy whatever the Accept header says.
NPY_PATH = PATH + ".npy"

NPY = "application/x-npy"
VERSION_HEADER = "X-Welltempered-Version"


async def read_scores_body(
    request: Request, state: AppState, bounds: rules.Bounds
) -> tuple[str, Any]:
    """The body and its format: JSON bytes (at most what ``bounds`` can need), or a .npy
    decoded while it arrives (its header checked against ``bounds`` first); 415 for
    anything else. Either limit is the request's decoded limit (:func:`budget.narrow`),
    so a compressed body inflates no further than its rows and K can need."""
    kind = media_type(request)
    settings = state.settings
    if kind == "application/json" or kind.endswith("+json"):
        limit = json_body.json_body_limit(bounds, settings.max_json_bytes)
        budget.narrow(request, limit)
        return "json", await read_body(request, limit)
    if kind in (NPY, "application/octet-stream"):
        limit = npy.npy_body_limit(bounds, settings.max_body_bytes)
        budget.narrow(request, limit)
        return "npy", await read_npy(request, npy.npy_check(bounds), limit, bounds.dtype)
    raise UnsupportedMediaType(
        f"Send scores as application/json or as a .npy body ({NPY}). "
        f"Got {kind or 'no Content-Type'!r}."
    )


#: Bytes of a top-k .npz predict body beyond its arrays (zip headers, .npy headers).
TOPK_NPZ_CONSTANT = 64 * 1024


async def read_topk_body(
    request: Request, state: AppState, bounds: rules.Bounds, k: int
) -> tuple[str, Any]:
    """A top-k version's body, read whole within what ``max_rows`` rows of ``k`` ids and
    log-probabilities can need (narrowed before reading): JSON (arrays, or the
    chat-completions shape within :data:`~service.api.codecs.json_body.MAX_CHAT_JSON_BYTES`)
    or a .npz (``topk_ids``, ``topk_logprobs``)."""
    kind = media_type(request)
    settings = state.settings
    if kind == "application/json" or kind.endswith("+json"):
        limit = max(json_body.topk_json_limit(bounds, k, settings.max_json_bytes),
                    min(settings.max_json_bytes, json_body.MAX_CHAT_JSON_BYTES))
        fmt = "json"
    elif kind in (NPY, *NPZ_TYPES):
        limit = min(settings.max_body_bytes, TOPK_NPZ_CONSTANT + bounds.max_rows * k * 16)
        fmt = "npz"
    else:
        raise UnsupportedMediaType(
            "Send top-k rows as application/json or as a .npz body (topk_ids, "
            f"topk_logprobs). Got {kind or 'no Content-Type'!r}."
        )
    budget.narrow(request, limit)
    return fmt, await read_body(request, limit)


def respond_topk(
    served: Served, fmt: str, raw: Any, want_npy: bool, bounds: rules.Bounds,
    limits: answers.AnswerLimits, metrics: ServiceMetrics,
) -> Response:
    """A top-k version's answer: per row the ids as sent, their calibrated probabilities
    and the tail's mass (JSON; with ``want_npy`` an (n, k + 1) float32 .npy, the tail
    last); with the chat-completions shape, the token strings too."""
    what = f"Version {served.version} of {served.model!r}"
    if fmt == "json":
        if not json_body.is_topk(raw):
            raise rules.topk_needed(what)
        data = json_body.topk_from_json(raw, bounds, labelled=False)
    elif bytes(raw[:6]) == npy.NPY_MAGIC:
        raise rules.topk_needed(what)
    else:
        data = npz.topk_from_npz(raw, bounds)
    n, k = data.rows.logprobs.shape
    names = 0 if data.names is None else max(len(t.encode()) for t in data.names)
    fp32, int64 = answers.JSON_BYTES["FP32"], answers.JSON_BYTES["INT64"]
    if want_npy:
        size, as_json = n * (k + 1) * answers.BINARY_BYTES["FP32"], 0
    else:
        size = as_json = n * (k * (int64 + fp32 + answers.json_string_bytes(names)) + fp32)
    limits.check(size + answers.CONSTANT_BYTES, as_json, "Send fewer rows, or ask for a .npy.")
    out = calibrate_topk(served, data.rows, bounds.max_rows, metrics)
    headers = {VERSION_HEADER: str(served.version)}
    if want_npy:
        body = np.concatenate([out["probabilities"], out["tail"][:, None]], axis=1)
        return Response(npy.npy_view(body), media_type=NPY, headers=headers)
    payload = {"topk_ids": data.rows.ids, "probabilities": out["probabilities"],
               "tail": out["tail"], "model": served.model, "version": served.version}
    if data.names is not None:
        payload["tokens"] = np.asarray(data.names, dtype=object)[data.rows.ids].tolist()
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json", headers=headers)


class Target(BaseModel):
    """The query of /predict: which version serves the request, and what a .npy holds."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    alias: str | None = Field(
        None, min_length=1, description=f"Alias to serve (default {DEFAULT_ALIAS!r})."
    )
    version: int | None = Field(
        None, ge=1, le=MAX_ID, description="A version number instead of an alias."
    )
    kind: Kind | None = Field(
        None,
        description="What the scores are. A .npy body holds logits unless told; a JSON "
        "body's key names its kind, which this must match. Given explicitly, logits whose "
        "rows look like probabilities are accepted.",
    )
    dtype: ScoreDtype | None = Field(
        None,
        description="How a .npy body's scores are read when numpy has no dtype for them: "
        "bfloat16 sends their raw 16-bit patterns as a little-endian 2-byte array (<u2, "
        "<i2, or |V2 as np.save writes ml_dtypes.bfloat16); widened to float32 exactly. "
        "float16, float32 and float64 need no ?dtype. Not for JSON bodies.",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        le=MAX_ID,
        description="Answer only the k largest probabilities of each row and their class "
        "indices (at most the model's number of classes), not the whole row.",
    )


def target(request: Request) -> Target:
    """The query, validated with FastAPI's own error format (a 422 problem).

    Done here rather than by FastAPI's parameter solving, which costs more than
    the whole calibration of a 1 x 1,000 request (bench/README.md); the OpenAPI
    document gets the same parameters from :data:`_PREDICT_DOC`.
    """
    if not request.scope.get("query_string"):
        return _DEFAULT_TARGET
    try:
        return Target.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None


_DEFAULT_TARGET = Target()


def _query_parameters() -> list[dict]:
    props = Target.model_json_schema()["properties"]
    return [
        {
            "name": name,
            "in": "query",
            "required": False,
            "description": prop.pop("description"),
            "schema": {k: v for k, v in prop.items() if k != "title"},
        }
        for name, prop in props.items()
    ]


_PREDICT_DOC = {
    "parameters": [
        {
            "name": "model",
            "in": "path",
            "required": True,
            "description": "The model's name.",
            "schema": {"type": "string"},
        },
        *_query_parameters(),
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": SCORE_PROPERTIES,
                }
            },
            # A .npy: application/x-npy is accepted too, and the same; the document
            # names the binary type every client generator knows.
            OCTET_STREAM: {**BINARY, "description": f"A .npy ({NPY} too)."},
        },
    },
}


def respond(
    served: Served,
    fmt: str,
    raw: Any,
    query: Target,
    want_npy: bool,
    bounds: rules.Bounds,
    metrics: ServiceMetrics,
    served_counts: ServedCounts,
    limits: answers.AnswerLimits,
) -> Response:
    """Parse, validate, bound the answer, run ONNX Runtime and serialise: CPU work."""
    if fmt == "json":
        try:
            scores, kind = json_body.scores_from_json(raw, bounds, query.kind)
        except InvalidInput:
            if json_body.is_topk(raw):  # said plainly, not as unknown fields
                raise rules.full_needed(
                    f"Version {served.version} of {served.model!r}") from None
            raise
    else:
        scores, kind = npy.scores_from_npy(raw, bounds, query.kind)
    n, k = scores.shape
    data = answers.predict_answer_bytes(n, k, query.top_k, want_npy, served.max_name_bytes)
    fix = answers.NPY_ANSWER_FIX if query.top_k is None else answers.TOP_K_ANSWER_FIX
    limits.check(data + answers.CONSTANT_BYTES, 0 if want_npy else data, fix)
    out = calibrate(served, scores, kind, bounds.max_rows, metrics, served_counts, query.top_k)
    headers = {VERSION_HEADER: str(served.version)}
    if want_npy:
        if query.top_k is None:
            body = out["probabilities"]
        else:
            body = answers.top_k_records(out, served.class_names)
        if body.nbytes > answers.STREAM_ANSWER_BYTES:  # no copy of a big answer: views of it
            size, chunks = npy.npy_chunks(body)
            headers["Content-Length"] = str(size)
            return StreamingResponse(chunks, media_type=NPY, headers=headers)
        return Response(npy.npy_view(body), media_type=NPY, headers=headers)
    if query.top_k is None:
        payload = {"probabilities": out["probabilities"]}
    else:
        payload = {name: out[name] for name in inference.TOP_K_OUTPUTS}
    payload |= {
        "labels": out["label"],
        "confidence": out["confidence"],
        "entropy": out["entropy"],
        "model": served.model,
        "version": served.version,
    }
    if served.class_names is not None:  # the model's names of the classes answered
        payload["label_names"] = served.class_names[out["label"]].tolist()
        if query.top_k is not None:
            payload["top_k_names"] = served.class_names[out["top_k_indices"]].tolist()
    return Response(
        orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        media_type="application/json",
        headers=headers,
    )


@declare(budget.SCORES)
async def predict(request: Request) -> Response:
    return await _predict(request, want_npy=NPY in request.headers.get("accept", ""))


@declare(budget.SCORES)
async def predict_npy(request: Request) -> Response:
    # Its own operation: client generators type a status's answer by its first media type
    # (openapi-python-client decodes predict's 200 as JSON whatever the Accept header).
    return await _predict(request, want_npy=True)


async def _predict(request: Request, want_npy: bool) -> Response:
    # The hot path. Everything FastAPI would resolve through parameters and
    # dependencies is resolved here by plain calls: the caller (``authorize``, the
    # dependency every other route gets), the query (see :func:`target`), the
    # served version (404 unknown model/alias/version, 409 not servable; cached)
    # and the body. FastAPI's parameter solving costs more per request than
    # calibrating a 1 x 1,000 row (bench/README.md, "Predict path, in process").
    caller = await authorize(request)
    state = get_app_state(request)
    model = request.path_params["model"]
    query = target(request)
    served = await state.serving.get(model, query.alias, query.version, caller.namespace)
    bounds = rules.bounds(state.settings, "predict", served.num_classes, served.model, query.dtype)
    declared = budget.limits_of(request.scope).answer
    if served.topk_k is not None:
        if query.top_k is not None or query.kind is not None or query.dtype is not None:
            raise InvalidInput("?top_k, ?kind and ?dtype are for full scores; a top-k version "
                               "answers the top-k rows it is sent.")
        fmt, raw = await read_topk_body(request, state, bounds, served.topk_k)
        limits = answers.AnswerLimits.of(declared, state.settings.max_json_bytes, len(raw))
        args = (served, fmt, raw, want_npy, bounds, limits, state.metrics)
        return await anyio.to_thread.run_sync(respond_topk, *args,
                                              limiter=state.predict_limiter)
    fmt, raw = await read_scores_body(request, state, bounds)
    size = len(raw) if fmt == "json" else raw.nbytes
    limits = answers.AnswerLimits.of(declared, state.settings.max_json_bytes, size)
    args = (served, fmt, raw, query, want_npy, bounds, state.metrics, state.served_counts, limits)
    if size <= state.settings.inline_predict_bytes:
        return respond(*args)
    return await anyio.to_thread.run_sync(respond, *args, limiter=state.predict_limiter)


def install(app: FastAPI) -> None:
    """Add /predict to the app's own router, ahead of the others; call it before
    :func:`service.api.auth.install`, as predict calls ``authorize`` itself.

    Not through ``include_router``: FastAPI dispatches an included router's routes
    through a second matching pass, and a dependency costs a parameter-solving
    pass: both cost more than the calibration of a small request (bench/README.md,
    "Predict path, in process").
    """
    add_hot_route(
        app,
        PATH,
        predict,
        tags=["predict"],
        response_class=Response,
        openapi_extra=_PREDICT_DOC,
        responses={
            200: {
                "description": "JSON {probabilities, labels, confidence, entropy, model, "
                f"version}}, or with Accept: {NPY} the probabilities as .npy (version in "
                f"{VERSION_HEADER}). With ?top_k=k, top_k_indices and top_k_probabilities "
                "(n, k) replace probabilities; the .npy is then (n, k) records "
                "(index int64, probability float32, and name, a fixed-width unicode "
                "string, when the model has class_names). When the model has class_names, "
                "the JSON adds label_names (n) and, with top_k, top_k_names (n, k).",
                "content": {
                    "application/json": {"schema": schema_ref(PredictOut)},
                    NPY: BINARY,
                },
            }
        },
    )
    add_hot_route(
        app,
        NPY_PATH,
        predict_npy,
        tags=["predict"],
        response_class=Response,
        openapi_extra=_PREDICT_DOC,
        responses={
            200: {
                "description": f"The answer of {PATH} with Accept: {NPY}: the probabilities "
                f"(n, K) as a .npy, float32 (version in {VERSION_HEADER}); with ?top_k=k, "
                "(n, k) records as there. Served as " + NPY + ", documented as "
                f"{OCTET_STREAM} too, so that generated clients return the bytes.",
                "content": {NPY: BINARY, OCTET_STREAM: BINARY},
            }
        },
    )
