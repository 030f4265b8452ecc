"""The Open Inference Protocol v2 over REST (KServe v2, Triton's HTTP/REST API).

Routes (docs/api.md, "Open Inference Protocol v2"):

- ``GET /v2/health/live``, ``GET /v2/health/ready``: open, like /healthz and /readyz;
- ``GET /v2``: server metadata (extensions: ``binary_tensor_data``);
- ``GET /v2/models/{name}[/versions/{version}]``: model metadata, ``.../ready``;
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
:func:`service.api.routers.predict.calibrate`: the same cached ONNX session, the
same numbers, the same metrics. Errors are the service's domain errors, which
:mod:`service.server.problems` renders in the protocol's shape,
``{"error": "<detail>"}``, with the status of its table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import anyio.to_thread
import numpy as np
import orjson
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from service.api import answers
from service.api.auth import PrincipalDep, authorize
from service.api.codecs import json_body, npy, scores
from service.api.deps import StateDep, get_app_state
from service.api.routers import health
from service.api.routers.predict import (
    STREAM_ANSWER_BYTES,
    VERSION_HEADER,
    add_hot_route,
    calibrate,
)
from service.api.uploads import read_body
from service.errors import (
    Conflict,
    ContentTooLarge,
    InvalidInput,
    MalformedBody,
    NotFound,
)
from service.observe.metrics import ServiceMetrics
from service.server import budget
from service.server.budget import declare
from service.server.problems import OIP_PREFIX, problem_response
from service.serving.inference import OUTPUTS, TOP_K_OUTPUTS, Served, check_top_k
from service.storage import registry
from service.vocabulary import DEFAULT_ALIAS, KINDS, MAX_ID

HEADER_LENGTH = "Inference-Header-Content-Length"
SERVER_NAME = "welltempered"
EXTENSIONS = ("binary_tensor_data",)
PLATFORM = "onnxruntime_onnx"
OCTET_STREAM = "application/octet-stream"
INPUT = "logits"
#: Datatypes the input may have, and the little-endian numpy dtype of their bytes
#: (BF16: the top 16 bits of a float32, widened exactly).
INPUT_DATATYPES = {
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}
#: Every output, with its datatype: the graph's outputs, then the top-k ones.
OUTPUT_DATATYPES = {
    "probabilities": "FP32",
    "confidence": "FP32",
    "label": "INT64",
    "entropy": "FP32",
    "top_k_indices": "INT64",
    "top_k_probabilities": "FP32",
    "label_name": "BYTES",
    "top_k_names": "BYTES",
}
#: The outputs that name classes (when the model has class_names): the output they name.
NAME_OUTPUTS = {"label_name": "label", "top_k_names": "top_k_indices"}
#: The outputs that need the request parameter top_k.
TOP_K_ONLY = (*TOP_K_OUTPUTS, "top_k_names")
#: Outputs answered when a request names none: without and with ``top_k``.
DEFAULT_OUTPUTS = tuple(name for name in OUTPUT_DATATYPES if name in OUTPUTS)
TOP_K_DEFAULT_OUTPUTS = (*(n for n in DEFAULT_OUTPUTS if n != "probabilities"), *TOP_K_OUTPUTS)

#: Digits of the largest number a header or a path may give (a byte count, a version).
_MAX_DIGITS = len(str(2**63))
_REQUEST_FIELDS = {"id", "parameters", "inputs", "outputs"}
_INPUT_FIELDS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_FIELDS = {"name", "parameters"}


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class InferRequest:
    """A parsed and validated infer request: the scores and what to answer."""

    id: str | None
    scores: np.ndarray  # (n, K), validated by calibrators.validation
    kind: str
    top_k: int | None
    outputs: tuple[tuple[str, bool], ...]  # (name, as binary data)


def _object(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object. Got {type(value).__name__}.")
    return value


def _fields(obj: dict, allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise InvalidInput(
            f"Unknown field(s) {sorted(unknown)!r} in {where}; expected {sorted(allowed)!r}."
        )


def _integer(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{where} must be an integer >= {minimum}. Got {value!r}.")
    return value


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{where} must be true or false. Got {value!r}.")
    return value


def _no_shared_memory(params: dict, where: str) -> None:
    if any(str(key).startswith("shared_memory") for key in params):
        raise InvalidInput(
            f"{where}: the shared memory extensions are not supported; send the tensor in "
            "the body (JSON data or binary_data_size)."
        )


def header_length(request: Request) -> int | None:
    """The ``Inference-Header-Content-Length`` of a request (None without one)."""
    value = request.headers.get(HEADER_LENGTH)
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        raise MalformedBody(f"{HEADER_LENGTH} must be a number of bytes. Got {value!r}.")
    if len(value) > _MAX_DIGITS:  # int() refuses over 4,300 digits: never parse so many
        raise ContentTooLarge(f"{HEADER_LENGTH} is over any limit ({len(value)} digits).")
    return int(value)


def _input(
    tensor: Any,
    raw: bytes,
    head: int | None,
    kind: str,
    bounds: scores.Bounds,
) -> np.ndarray:
    """The scores of the ``logits`` input, validated like a /v1 body: its shape against
    the model's K and the row limit of ``bounds`` first."""
    where = f"input {INPUT!r}"
    num_classes, model, check_rows = bounds.num_classes, bounds.model, bounds.check_rows
    tensor = _object(tensor, "Each input")
    _fields(tensor, _INPUT_FIELDS, "an input")
    if tensor.get("name") != INPUT:
        raise InvalidInput(f"The model's one input is {INPUT!r}. Got {tensor.get('name')!r}.")
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2):
        raise InvalidInput(f"The shape of {where} must be [n, {num_classes}]. Got {shape!r}.")
    rows, cols = (_integer(n, f"The shape of {where}", 0) for n in shape)
    if cols != num_classes:  # before anything is sized by the shape ([2**62, 0] included)
        raise InvalidInput(
            f"The shape of {where} must be [n, {num_classes}]: {num_classes} columns, one "
            f"per class of model {model!r}. Got {shape!r}."
        )
    check_rows(rows)
    datatype = tensor.get("datatype")
    if datatype not in INPUT_DATATYPES:
        raise InvalidInput(
            f"The datatype of {where} must be one of {', '.join(INPUT_DATATYPES)}. "
            f"Got {datatype!r}."
        )
    params = _object(tensor.get("parameters"), f"The parameters of {where}")
    _no_shared_memory(params, where)
    binary = len(raw) - head if head is not None else 0
    if "binary_data_size" in params:
        size = _integer(params["binary_data_size"], f"binary_data_size of {where}", 0)
        if head is None:
            raise InvalidInput(f"binary_data_size needs the {HEADER_LENGTH} header.")
        if "data" in tensor:
            raise InvalidInput(f"{where} has both data and binary_data_size: send one.")
        dtype = INPUT_DATATYPES[datatype]
        if size != rows * cols * dtype.itemsize:
            raise InvalidInput(
                f"binary_data_size of {where} must be {rows * cols * dtype.itemsize} bytes "
                f"({rows} x {cols} {datatype}). Got {size}."
            )
        if size != binary:
            raise MalformedBody(
                f"The body holds {binary} bytes after its JSON header; binary_data_size "
                f"says {size}."
            )
        arr = np.frombuffer(raw, dtype, rows * cols, head)
        if datatype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
    else:
        if binary:
            raise MalformedBody(
                f"The body holds {binary} bytes after its JSON header, but no input has "
                "binary_data_size."
            )
        if "data" not in tensor:
            raise InvalidInput(f"{where} needs data, or binary_data_size with binary data.")
        try:
            arr = np.asarray(tensor["data"])
        except (ValueError, TypeError):  # ragged nested lists
            raise InvalidInput(f"The data of {where} must be a (nested) list of numbers.") from None
        if arr.size != rows * cols:
            raise InvalidInput(
                f"The data of {where} must hold {rows * cols} numbers (shape {shape}). "
                f"Got {arr.size}."
            )
    return scores.validated_scores(arr.reshape(rows, cols), kind, num_classes, model)


def default_outputs(top_k: int | None, named: bool) -> tuple[str, ...]:
    """The outputs answered when a request names none; ``named``: the model has
    class_names."""
    names = TOP_K_DEFAULT_OUTPUTS if top_k is not None else DEFAULT_OUTPUTS
    if named:
        names += tuple(n for n in NAME_OUTPUTS if top_k is not None or n not in TOP_K_ONLY)
    return names


def _outputs(
    spec: Any, top_k: int | None, binary: bool, named: bool
) -> tuple[tuple[str, bool], ...]:
    if spec is None or spec == []:
        return tuple((name, binary) for name in default_outputs(top_k, named))
    if not isinstance(spec, list):
        raise InvalidInput(f"outputs must be a list. Got {type(spec).__name__}.")
    out: dict[str, bool] = {}
    for tensor in spec:
        tensor = _object(tensor, "Each output")
        _fields(tensor, _OUTPUT_FIELDS, "an output")
        name = tensor.get("name")
        if name not in OUTPUT_DATATYPES:
            raise InvalidInput(
                f"Unknown output {name!r}; the outputs are {', '.join(OUTPUT_DATATYPES)}."
            )
        if name in TOP_K_ONLY and top_k is None:
            raise InvalidInput(f"The output {name!r} needs the request parameter top_k.")
        if name in NAME_OUTPUTS and not named:
            raise InvalidInput(
                f"The output {name!r} needs the model's class_names, and it has none "
                "(PATCH /v1/models/{model} sets them)."
            )
        if name in out:
            raise InvalidInput(f"The output {name!r} is asked for twice.")
        params = _object(tensor.get("parameters"), f"The parameters of output {name!r}")
        _no_shared_memory(params, f"output {name!r}")
        if "classification" in params:
            raise InvalidInput(
                "The classification extension is not supported: ask for the request "
                "parameter top_k and the outputs top_k_indices and top_k_probabilities."
            )
        flag = params.get("binary_data", binary)
        out[name] = _boolean(flag, f"binary_data of output {name!r}")
    return tuple(out.items())


def parse_request(
    raw: bytes, head: int | None, bounds: scores.Bounds, named: bool = False
) -> InferRequest:
    """An infer body: JSON, or (``head`` bytes of) JSON followed by binary tensor data,
    for a model of ``bounds.num_classes`` classes; ``named``: the model has class_names
    (so the name outputs exist)."""
    num_classes = bounds.num_classes
    if head is not None and head > len(raw):
        raise MalformedBody(f"{HEADER_LENGTH} is {head}, but the body holds {len(raw)} bytes.")
    header = raw if head is None else memoryview(raw)[:head]
    obj = _object(json_body.decode_json(header), "The JSON header")
    _fields(obj, _REQUEST_FIELDS, "the request")
    request_id = obj.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f"id must be a string. Got {request_id!r}.")
    params = _object(obj.get("parameters"), "parameters")
    kind = params.get("kind", KINDS[0])
    if kind not in KINDS:
        raise InvalidInput(f"The parameter kind must be one of {', '.join(KINDS)}. Got {kind!r}.")
    top_k = params.get("top_k")
    if top_k is not None:
        check_top_k(_integer(top_k, "The parameter top_k", 1), num_classes)
    binary = _boolean(params.get("binary_data_output", False), "binary_data_output")
    inputs = obj.get("inputs")
    if not (isinstance(inputs, list) and len(inputs) == 1):
        raise InvalidInput(
            f"inputs must be a list of one tensor, {INPUT!r}. Got {type(inputs).__name__}"
            + (f" of {len(inputs)}." if isinstance(inputs, list) else ".")
        )
    outputs = _outputs(obj.get("outputs"), top_k, binary, named)
    scores = _input(inputs[0], raw, head, kind, bounds)
    return InferRequest(request_id, scores, kind, top_k, outputs)


# -- the response ---------------------------------------------------------------


def _binary_body(head: bytes, arrays: list[np.ndarray]) -> memoryview:
    """The JSON header and the arrays' little-endian bytes, in one buffer (one copy: the
    fast path of a small answer; a big one is streamed, :func:`encode_response`)."""
    out = bytearray(len(head) + sum(a.nbytes for a in arrays))
    out[: len(head)] = head
    offset = len(head)
    for arr in arrays:
        dest = np.frombuffer(out, arr.dtype.newbyteorder("<"), arr.size, offset)
        dest[...] = arr.ravel()
        offset += arr.nbytes
    return memoryview(out)


def bytes_tensor(strings: np.ndarray) -> np.ndarray:
    """The binary form of a BYTES tensor of ``strings`` (row major), as uint8: per
    element its UTF-8 length (little-endian uint32), then the UTF-8 bytes.

    >>> bytes_tensor(np.array(["a", "\N{GREEK SMALL LETTER BETA}"], object)).tobytes()
    b'\\x01\\x00\\x00\\x00a\\x02\\x00\\x00\\x00\\xce\\xb2'
    """
    parts = []
    for text in strings.ravel():
        encoded = text.encode()
        parts += (len(encoded).to_bytes(4, "little"), encoded)
    return np.frombuffer(b"".join(parts), np.uint8)


def encode_response(served: Served, request: InferRequest, out: dict[str, np.ndarray]) -> Response:
    tensors, binary = [], []
    for name, as_binary in request.outputs:
        if name in NAME_OUTPUTS:  # parse_request let it through: the model has names
            arr = served.class_names[out[NAME_OUTPUTS[name]]]
        else:
            arr = out[name]
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": OUTPUT_DATATYPES[name],
            "shape": list(arr.shape),
        }
        if as_binary:
            data = bytes_tensor(arr) if arr.dtype == object else arr
            tensor["parameters"] = {"binary_data_size": data.nbytes}
            binary.append(data)
        elif arr.dtype == object:
            tensor["data"] = arr.ravel().tolist()
        else:
            tensor["data"] = np.ascontiguousarray(arr).ravel()
        tensors.append(tensor)
    body: dict[str, Any] = {"model_name": served.model, "model_version": str(served.version)}
    if request.id is not None:
        body["id"] = request.id
    body["outputs"] = tensors
    head = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = {VERSION_HEADER: str(served.version)}
    if not binary:
        return Response(head, media_type="application/json", headers=headers)
    headers[HEADER_LENGTH] = str(len(head))
    if sum(a.nbytes for a in binary) > STREAM_ANSWER_BYTES:  # no copy: views of the arrays
        size, chunks = npy.byte_chunks(head, binary)
        headers["Content-Length"] = str(size)
        return StreamingResponse(chunks, media_type=OCTET_STREAM, headers=headers)
    return Response(_binary_body(head, binary), media_type=OCTET_STREAM, headers=headers)


#: How to get whole rows without JSON, on /v2 infer.
BINARY_ANSWER_FIX = (
    "Ask for the parameter top_k (the outputs top_k_indices and top_k_probabilities), or "
    "for probabilities as binary tensor data: the parameter binary_data_output, or the "
    "output's binary_data, true."
)


def answer_bytes(request: InferRequest, name_bytes: int) -> tuple[int, int]:
    """The most bytes the answer to ``request`` can take, before it is computed: in all,
    and as JSON ``data`` (whose limit is MAX_JSON_BYTES); ``name_bytes``: the model's
    longest class name in UTF-8."""
    n, k = request.scores.shape
    per_row = {
        "probabilities": k,
        "top_k_indices": min(request.top_k or 0, k),
        "top_k_probabilities": min(request.top_k or 0, k),
        "top_k_names": min(request.top_k or 0, k),
    }
    as_json = 0
    total = answers.CONSTANT_BYTES + answers.json_string_bytes(len((request.id or "").encode()))
    for name, binary in request.outputs:
        datatype = OUTPUT_DATATYPES[name]
        if datatype == "BYTES":  # per name: a uint32 length, or quoted and escaped JSON
            each = 4 + name_bytes if binary else answers.json_string_bytes(name_bytes)
        else:
            each = answers.BINARY_BYTES[datatype] if binary else answers.JSON_BYTES[datatype]
        size = n * per_row.get(name, 1) * each
        total += size
        if not binary:
            as_json += size
    return total, as_json


def respond(
    served: Served,
    raw: bytes,
    head: int | None,
    bounds: scores.Bounds,
    metrics: ServiceMetrics,
    limits: answers.AnswerLimits,
) -> Response:
    """Parse, validate, bound the answer, run ONNX Runtime and serialise: CPU work."""
    named = served.class_names is not None
    request = parse_request(raw, head, bounds, named)
    total, as_json = answer_bytes(request, served.max_name_bytes)
    limits.check(total, as_json, BINARY_ANSWER_FIX)
    out = calibrate(served, request.scores, request.kind, bounds.max_rows, metrics, request.top_k)
    return encode_response(served, request, out)


def version_number(text: str | None) -> int | None:
    """A path's version as a calibrator version number (404 for anything else)."""
    if text is None:
        return None
    if (text.isascii() and text.isdigit() and text[0] != "0" and len(text) <= _MAX_DIGITS
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
    head = header_length(request)
    settings = state.settings
    bounds = scores.bounds(settings, "predict", served.num_classes, served.model)
    limit = json_body.json_body_limit(bounds, settings.max_json_bytes)
    if head is not None:  # a JSON header, then at most max_rows x K float64s
        if head > limit:
            raise ContentTooLarge(f"{HEADER_LENGTH} is over the limit of {limit} bytes.")
        data = bounds.max_rows * bounds.num_classes * 8
        limit = min(settings.max_body_bytes, head + data)
    budget.narrow(request, limit)
    raw = await read_body(request, limit)
    answer = answers.AnswerLimits.of(request, settings.max_json_bytes, len(raw))
    args = (served, raw, head, bounds, state.metrics, answer)
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
        name=SERVER_NAME, version=request.app.version, extensions=list(EXTENSIONS)
    )


def _servable(row, model) -> bool:
    try:
        registry.check_servable(row, model)
    except Conflict:
        return False
    return True


def _model_metadata(
    state, caller, name: str, version: str | None, top_k: int | None
) -> ModelMetadata:
    with state.sessions() as session:
        model, _ = registry.resolve_served(
            session, name, None, version_number(version), caller.namespace
        )
        rows = registry.list_versions(session, model)
        versions = [str(row.version) for row in rows if _servable(row, model)]
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
        platform=PLATFORM,
        inputs=[TensorMetadata(name=INPUT, datatype="FP32", shape=[-1, k])],
        outputs=[
            TensorMetadata(name=n, datatype=OUTPUT_DATATYPES[n], shape=shape)
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
    "name": HEADER_LENGTH,
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
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "enum": [INPUT]},
                    "shape": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "datatype": {"type": "string", "enum": list(INPUT_DATATYPES)},
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
                    "name": {"type": "string", "enum": list(OUTPUT_DATATYPES)},
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
                OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
            },
        },
    }


_INFER_200 = {
    200: {
        "description": "The outputs: JSON, or with binary outputs the JSON header "
        f"({HEADER_LENGTH} bytes) followed by their little-endian bytes.",
        "content": {"application/json": {"schema": _INFER_RESPONSE}, OCTET_STREAM: {}},
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
