"""The Open Inference Protocol v2 over REST, as bytes: infer requests decoded and
validated, answers encoded (JSON, or JSON followed by binary tensor data), and the
most bytes an answer can take, known before it is computed. Pure: the routes are
:mod:`service.api.routers.v2`.

A version fitted on top-k rows (``calibrators.topk``) has its own tensors: the inputs
:data:`TOPK_INPUT_DATATYPES` (``topk_ids`` and ``topk_logprobs``, [n, k] each, binary
data in the order the inputs are listed) and the outputs :data:`TOPK_OUTPUT_DATATYPES`
(``probabilities`` [n, k], the calibrated top-k in the input's order; ``topk_ids``
[n, k], echoed; ``tail`` [n], the mass of the rest of the vocabulary)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from calibrators import topk
from service.api.codecs import answers, json_body, npy, rules
from service.errors import ContentTooLarge, InvalidInput, MalformedBody
from service.serving.inference import OUTPUTS, TOP_K_OUTPUTS, check_top_k
from service.vocabulary import KINDS

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
#: A top-k version's inputs, each with the datatypes it may have (little-endian numpy
#: dtypes of their bytes).
TOPK_INPUT_DATATYPES = {
    topk.IDS: {"INT64": np.dtype("<i8")},
    topk.LOGPROBS: {"FP32": np.dtype("<f4"), "FP64": np.dtype("<f8")},
}
#: A top-k version's outputs, with their datatypes: every one answered by default.
TOPK_OUTPUT_DATATYPES = {"probabilities": "FP32", topk.IDS: "INT64", "tail": "FP32"}
_DATATYPES = {**OUTPUT_DATATYPES, **TOPK_OUTPUT_DATATYPES}
#: The outputs that name classes (when the model has class_names): the output they name.
NAME_OUTPUTS = {"label_name": "label", "top_k_names": "top_k_indices"}
#: The outputs that need the request parameter top_k.
TOP_K_ONLY = (*TOP_K_OUTPUTS, "top_k_names")
#: Outputs answered when a request names none: without and with ``top_k``.
DEFAULT_OUTPUTS = tuple(name for name in OUTPUT_DATATYPES if name in OUTPUTS)
TOP_K_DEFAULT_OUTPUTS = (*(n for n in DEFAULT_OUTPUTS if n != "probabilities"), *TOP_K_OUTPUTS)

#: Digits of the largest number a header or a path may give (a byte count, a version):
#: int() refuses over 4,300, so never parse more.
MAX_DIGITS = len(str(2**63))
_REQUEST_FIELDS = {"id", "parameters", "inputs", "outputs"}
_INPUT_FIELDS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_FIELDS = {"name", "parameters"}


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class InferRequest:
    """A parsed and validated infer request: the scores and what to answer. For a top-k
    version, ``rows`` (``scores`` their log-probabilities, ``kind`` None)."""

    id: str | None
    scores: np.ndarray  # (n, K), validated by calibrators.validation
    kind: str | None
    top_k: int | None
    outputs: tuple[tuple[str, bool], ...]  # (name, as binary data)
    rows: topk.TopK | None = None


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


def header_length(value: str | None) -> int | None:
    """A request's ``Inference-Header-Content-Length`` header (None without one) as bytes."""
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        raise MalformedBody(f"{HEADER_LENGTH} must be a number of bytes. Got {value!r}.")
    if len(value) > MAX_DIGITS:
        raise ContentTooLarge(f"{HEADER_LENGTH} is over any limit ({len(value)} digits).")
    return int(value)


def _tensor(
    tensor: dict,
    datatypes: dict[str, np.dtype],
    cols: int,
    why: str,
    raw: bytes,
    head: int | None,
    offset: int,
    bounds: rules.Bounds,
) -> tuple[np.ndarray, str, int]:
    """The values of one input tensor, of shape [n, ``cols``] (``why``: what that
    number is) and one of ``datatypes``: its shape checked first (the columns, then the
    row limit of ``bounds``), then its JSON ``data`` or its ``binary_data_size`` bytes
    from ``offset`` of ``raw``. Returns them (unvalidated), the datatype and where the
    next input's binary data start."""
    name = tensor.get("name")
    where = f"input {name!r}"
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2):
        raise InvalidInput(f"The shape of {where} must be [n, {cols}]. Got {shape!r}.")
    rows, got = (_integer(n, f"The shape of {where}", 0) for n in shape)
    if got != cols:  # before anything is sized by the shape ([2**62, 0] included)
        raise InvalidInput(f"The shape of {where} must be [n, {cols}]: {why}. Got {shape!r}.")
    bounds.check_rows(rows)
    datatype = tensor.get("datatype")
    if datatype not in datatypes:
        raise InvalidInput(
            f"The datatype of {where} must be one of {', '.join(datatypes)}. Got {datatype!r}."
        )
    params = _object(tensor.get("parameters"), f"The parameters of {where}")
    _no_shared_memory(params, where)
    if "binary_data_size" in params:
        size = _integer(params["binary_data_size"], f"binary_data_size of {where}", 0)
        if head is None:
            raise InvalidInput(f"binary_data_size needs the {HEADER_LENGTH} header.")
        if "data" in tensor:
            raise InvalidInput(f"{where} has both data and binary_data_size: send one.")
        dtype = datatypes[datatype]
        if size != rows * cols * dtype.itemsize:
            raise InvalidInput(
                f"binary_data_size of {where} must be {rows * cols * dtype.itemsize} bytes "
                f"({rows} x {cols} {datatype}). Got {size}."
            )
        if offset + size > len(raw):
            raise MalformedBody(
                f"The body holds {len(raw) - offset} bytes after its JSON header and the "
                f"inputs before {where}; binary_data_size says {size}."
            )
        arr = np.frombuffer(raw, dtype, rows * cols, offset)
        return arr.reshape(rows, cols), datatype, offset + size
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
    return arr.reshape(rows, cols), datatype, offset


def _binary_read(raw: bytes, head: int | None, offset: int) -> None:
    """Every byte after the JSON header belongs to an input's binary data."""
    if head is None or offset == len(raw):
        return
    binary = len(raw) - head
    if offset == head:
        raise MalformedBody(
            f"The body holds {binary} bytes after its JSON header, but no input has "
            "binary_data_size."
        )
    raise MalformedBody(
        f"The body holds {binary} bytes after its JSON header; binary_data_size says "
        f"{offset - head}."
    )


def _input(
    tensor: Any,
    raw: bytes,
    head: int | None,
    kind: str,
    bounds: rules.Bounds,
) -> np.ndarray:
    """The scores of the ``logits`` input, validated like a /v1 body: its shape against
    the model's K and the row limit of ``bounds`` first."""
    num_classes, model = bounds.num_classes, bounds.model
    tensor = _object(tensor, "Each input")
    _fields(tensor, _INPUT_FIELDS, "an input")
    if tensor.get("name") != INPUT:
        raise InvalidInput(f"The model's one input is {INPUT!r}. Got {tensor.get('name')!r}.")
    why = f"{num_classes} columns, one per class of model {model!r}"
    start = 0 if head is None else head
    arr, datatype, end = _tensor(tensor, INPUT_DATATYPES, num_classes, why, raw, head, start,
                                 bounds)
    _binary_read(raw, head, end)
    if datatype == "BF16" and end > start:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return rules.validated_scores(arr, kind, num_classes, model)


def _topk_inputs(
    inputs: Any, raw: bytes, head: int | None, k: int, bounds: rules.Bounds, served: str
) -> topk.TopK:
    """The two inputs of a top-k version (:data:`TOPK_INPUT_DATATYPES`), in either order,
    validated as top-k rows of the model's vocabulary (``calibrators.topk.as_topk``)."""
    names = (
        [t.get("name") if isinstance(t, dict) else None for t in inputs]
        if isinstance(inputs, list) else None
    )
    if names is not None and INPUT in names:
        raise InvalidInput(
            f"{served} serves top-k rows, not full scores: send its inputs "
            f"{topk.IDS!r} and {topk.LOGPROBS!r} instead of {INPUT!r}."
        )
    if names is None or sorted(map(str, names)) != sorted(TOPK_INPUT_DATATYPES):
        raise InvalidInput(
            f"{served} takes two inputs, {topk.IDS!r} (INT64, [n, {k}]) and "
            f"{topk.LOGPROBS!r} (FP32 or FP64, [n, {k}]). Got {rules.shorten(names)}."
        )
    why = (f"{served} was fitted on top-{k} rows; its tail model depends on k, so it "
           f"serves rows of {k}")
    offset = 0 if head is None else head
    got = {}
    for tensor in inputs:
        _fields(tensor, _INPUT_FIELDS, "an input")
        name = tensor["name"]
        got[name], _, offset = _tensor(tensor, TOPK_INPUT_DATATYPES[name], k, why, raw, head,
                                       offset, bounds)
    _binary_read(raw, head, offset)
    ids, logprobs = got[topk.IDS], got[topk.LOGPROBS]
    if ids.shape != logprobs.shape:
        raise InvalidInput(
            f"The inputs {topk.IDS!r} and {topk.LOGPROBS!r} must have one shape. "
            f"Got {list(ids.shape)} and {list(logprobs.shape)}."
        )
    return rules.validated_topk(ids, logprobs, bounds.num_classes, bounds).rows


def default_outputs(top_k: int | None, named: bool) -> tuple[str, ...]:
    """The outputs answered when a request names none; ``named``: the model has
    class_names."""
    names = TOP_K_DEFAULT_OUTPUTS if top_k is not None else DEFAULT_OUTPUTS
    if named:
        names += tuple(n for n in NAME_OUTPUTS if top_k is not None or n not in TOP_K_ONLY)
    return names


def _outputs(
    spec: Any, top_k: int | None, binary: bool, named: bool, top: bool = False
) -> tuple[tuple[str, bool], ...]:
    """The outputs asked for, each with whether it goes as binary data; ``top``: those
    of a top-k version (:data:`TOPK_OUTPUT_DATATYPES`)."""
    known = TOPK_OUTPUT_DATATYPES if top else OUTPUT_DATATYPES
    if spec is None or spec == []:
        names = tuple(known) if top else default_outputs(top_k, named)
        return tuple((name, binary) for name in names)
    if not isinstance(spec, list):
        raise InvalidInput(f"outputs must be a list. Got {type(spec).__name__}.")
    out: dict[str, bool] = {}
    for tensor in spec:
        tensor = _object(tensor, "Each output")
        _fields(tensor, _OUTPUT_FIELDS, "an output")
        name = tensor.get("name")
        if name not in known:
            raise InvalidInput(
                f"Unknown output {name!r}; the outputs are {', '.join(known)}"
                + (" (a top-k version's)." if top else ".")
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
    raw: bytes,
    head: int | None,
    bounds: rules.Bounds,
    named: bool = False,
    topk_k: int | None = None,
    served: str = "This version",
) -> InferRequest:
    """An infer body: JSON, or (``head`` bytes of) JSON followed by binary tensor data,
    for a model of ``bounds.num_classes`` classes; ``named``: the model has class_names
    (so the name outputs exist). ``topk_k``: the version serves top-k rows of that
    width (its inputs and outputs are the top-k ones); ``served`` names the version in
    refusals."""
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
    inputs = obj.get("inputs")
    if topk_k is not None:
        for key in ("kind", "top_k"):
            if key in params:
                raise InvalidInput(
                    f"The parameter {key} is for full scores; {served} serves top-k rows "
                    "and answers their calibrated top-k and the tail's mass."
                )
        binary = _boolean(params.get("binary_data_output", False), "binary_data_output")
        outputs = _outputs(obj.get("outputs"), None, binary, False, top=True)
        rows = _topk_inputs(inputs, raw, head, topk_k, bounds, served)
        return InferRequest(request_id, rows.logprobs, None, None, outputs, rows)
    if isinstance(inputs, list) and any(
        isinstance(t, dict) and t.get("name") in TOPK_INPUT_DATATYPES for t in inputs
    ):
        raise rules.full_needed(served)
    kind = params.get("kind", KINDS[0])
    if kind not in KINDS:
        raise InvalidInput(f"The parameter kind must be one of {', '.join(KINDS)}. Got {kind!r}.")
    top_k = params.get("top_k")
    if top_k is not None:
        check_top_k(_integer(top_k, "The parameter top_k", 1), num_classes)
    binary = _boolean(params.get("binary_data_output", False), "binary_data_output")
    if not (isinstance(inputs, list) and len(inputs) == 1):
        raise InvalidInput(
            f"inputs must be a list of one tensor, {INPUT!r}. Got {type(inputs).__name__}"
            + (f" of {len(inputs)}." if isinstance(inputs, list) else ".")
        )
    outputs = _outputs(obj.get("outputs"), top_k, binary, named)
    scores = _input(inputs[0], raw, head, kind, bounds)
    return InferRequest(request_id, scores, kind, top_k, outputs)


# -- the response ---------------------------------------------------------------


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


@dataclass(frozen=True)
class Encoded:
    """An infer answer: its JSON (the whole answer, or the header of binary tensor data)
    and the arrays whose bytes follow it."""

    head: bytes
    binary: list[np.ndarray]

    @property
    def binary_bytes(self) -> int:
        return sum(a.nbytes for a in self.binary)

    def body(self) -> memoryview:
        """The JSON header and the arrays' little-endian bytes, in one buffer (one copy:
        for a small answer; a big one goes as :meth:`chunks`)."""
        out = bytearray(len(self.head) + self.binary_bytes)
        out[: len(self.head)] = self.head
        offset = len(self.head)
        for arr in self.binary:
            dest = np.frombuffer(out, arr.dtype.newbyteorder("<"), arr.size, offset)
            dest[...] = arr.ravel()
            offset += arr.nbytes
        return memoryview(out)

    def chunks(self) -> tuple[int, Iterator[bytes | memoryview]]:
        """The answer's size and its pieces, views of the arrays (no copy)."""
        return npy.byte_chunks(self.head, self.binary)


def encode(
    model: str,
    version: int,
    class_names: np.ndarray | None,
    request: InferRequest,
    out: dict[str, np.ndarray],
) -> Encoded:
    """The answer to ``request`` from the outputs ``out`` of ``model``'s ``version``."""
    tensors, binary = [], []
    for name, as_binary in request.outputs:
        if name in NAME_OUTPUTS:  # parse_request let it through: the model has names
            arr = class_names[out[NAME_OUTPUTS[name]]]
        else:
            arr = out[name]
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": _DATATYPES[name],
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
    body: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if request.id is not None:
        body["id"] = request.id
    body["outputs"] = tensors
    return Encoded(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), binary)


#: How to get whole rows without JSON, on /v2 infer.
BINARY_ANSWER_FIX = (
    "Ask for the parameter top_k (the outputs top_k_indices and top_k_probabilities), or "
    "for probabilities as binary tensor data: the parameter binary_data_output, or the "
    "output's binary_data, true."
)


#: How to get a top-k version's rows without JSON, on /v2 infer.
TOPK_BINARY_FIX = (
    "Send fewer rows, or ask for the outputs as binary tensor data: the parameter "
    "binary_data_output, or each output's binary_data, true."
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
        topk.IDS: k,
    }
    as_json = 0
    total = answers.CONSTANT_BYTES + answers.json_string_bytes(len((request.id or "").encode()))
    for name, binary in request.outputs:
        datatype = _DATATYPES[name]
        if datatype == "BYTES":  # per name: a uint32 length, or quoted and escaped JSON
            each = 4 + name_bytes if binary else answers.json_string_bytes(name_bytes)
        else:
            each = answers.BINARY_BYTES[datatype] if binary else answers.JSON_BYTES[datatype]
        size = n * per_row.get(name, 1) * each
        total += size
        if not binary:
            as_json += size
    return total, as_json


