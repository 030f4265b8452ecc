"""POST /v1/models/{model}/predict: calibrated probabilities through ONNX Runtime.

The hot path touches no database when warm: the (model, alias | version) ->
ONNX session resolution is cached (:class:`service.inference.ServingCache`).
The CPU work (parse, validate, run, serialise) is explicit about where it
runs: small bodies on the event loop, where it costs less than a thread hop
(a 1 x 1,000 JSON request is ~0.1 ms of work); bodies over
``inline_predict_bytes`` in the thread pool, so a 16 MB ``.npy`` never
stalls the loop.
"""

from __future__ import annotations

from typing import Annotated, Literal

import anyio.to_thread
import orjson
from fastapi import APIRouter, Path, Query, Request, Response

from service import inference, ingest, limits
from service import observability as obs
from service.auth import AUTH_OFF, Principal
from service.deps import AppState, get_app_state
from service.inference import Served
from service.openapi import SCORE_PROPERTIES
from service.problems import UnsupportedMediaType
from service.schemas import MAX_ID
from service.uploads import media_type, read_body

router = APIRouter(prefix="/v1/models/{model}", tags=["predict"])

NPY = "application/x-npy"
VERSION_HEADER = "X-Welltempered-Version"


def principal(request: Request) -> Principal:
    """The caller, as :func:`service.auth.authorize` left it (it stores it unless auth is off)."""
    return getattr(request.state, "principal", None) or AUTH_OFF


async def read_scores_body(request: Request, state: AppState) -> tuple[str, bytes]:
    """The body and its format; 415 for anything but JSON or .npy."""
    kind = media_type(request)
    if kind == "application/json" or kind.endswith("+json"):
        return "json", await read_body(request, state.settings.max_json_bytes)
    if kind in (NPY, "application/octet-stream"):
        return "npy", await read_body(request, state.settings.max_body_bytes)
    raise UnsupportedMediaType(
        f"Send scores as application/json or as a .npy body ({NPY}). "
        f"Got {kind or 'no Content-Type'!r}."
    )


_PREDICT_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": SCORE_PROPERTIES,
                }
            },
            NPY: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def respond(
    served: Served, fmt: str, raw: bytes, kind: str, want_npy: bool, max_rows: int
) -> Response:
    """Parse, validate, run ONNX Runtime and serialise: pure CPU work."""
    if fmt == "json":
        scores, kind = ingest.scores_from_json(raw, served.num_classes, served.model)
    else:
        scores = ingest.scores_from_npy(raw, kind, served.num_classes, served.model)
    limits.check_rows(scores.shape[0], max_rows, "predict")
    out = inference.run(served.session, inference.as_onnx_input(scores, kind))
    # Rows whose calibrated argmax is not the input's (the log of probabilities keeps it).
    flipped = int((scores.argmax(axis=1) != out["label"]).sum())
    obs.observe_predictions(
        served.model, served.version, out["entropy"], out["confidence"], flipped
    )
    headers = {VERSION_HEADER: str(served.version)}
    if want_npy:
        return Response(ingest.npy_view(out["probabilities"]), media_type=NPY, headers=headers)
    payload = {
        "probabilities": out["probabilities"],
        "labels": out["label"],
        "confidence": out["confidence"],
        "entropy": out["entropy"],
        "model": served.model,
        "version": served.version,
    }
    return Response(
        orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        media_type="application/json",
        headers=headers,
    )


@router.post(
    "/predict",
    response_class=Response,
    openapi_extra=_PREDICT_DOC,
    responses={
        200: {
            "description": "JSON {probabilities, labels, confidence, entropy, model, version}, "
            f"or with Accept: {NPY} the probabilities as .npy (version in {VERSION_HEADER}).",
            "content": {"application/json": {}, NPY: {}},
        }
    },
)
async def predict(
    request: Request,
    model: Annotated[str, Path(description="The model's name.")],
    alias: Annotated[
        str | None, Query(description="Alias to serve (default 'production').")
    ] = None,
    version: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="A version number instead of an alias.")
    ] = None,
    kind: Annotated[
        Literal["logits", "probabilities"], Query(description="What a .npy body holds.")
    ] = "logits",
) -> Response:
    # The hot path: the served version (404 unknown model/alias/version, 409 not
    # servable; cached) and the body are resolved here rather than by dependencies:
    # each dependency, even a cached one, costs FastAPI a parameter-solving pass
    # (measured in-process; see README "Speed"). The principal is the one that
    # ``authorize`` (a dependency of every route, run before this) stored.
    state = get_app_state(request)
    served = await state.serving.get(model, alias, version, principal(request).namespace)
    fmt, raw = await read_scores_body(request, state)
    want_npy = NPY in request.headers.get("accept", "")
    max_rows = state.settings.max_predict_rows
    if len(raw) <= state.settings.inline_predict_bytes:
        return respond(served, fmt, raw, kind, want_npy, max_rows)
    return await anyio.to_thread.run_sync(respond, served, fmt, raw, kind, want_npy, max_rows)
