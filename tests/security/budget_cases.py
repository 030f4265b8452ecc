"""Hostile requests for every operation of a real server, generated from its declared
budgets (each operation's ``x-budget`` in /openapi.json): the machinery of
test_budget_harness.py, also runnable by hand to print the table:

    PYTHONPATH=$PWD .venv/bin/python -m tests.security.budget_cases

What the harness knows of an operation beyond its budget is one :class:`Route` in
:data:`ROUTES` (a valid body, whether it changes what it names, its largest shapes);
an operation of the document without one is reported by name, so a new route is a
failing test until someone says what a hostile request to it looks like.

Every request is sent by hand on its own connection (:func:`exchange`): a declared
``Content-Length`` need not be honest, a chunked body need not end, and the answer's
bytes are counted as they came off the wire.
"""

from __future__ import annotations

import gzip
import json
import os
import select
import socket
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import numpy as np
from sqlalchemy.orm import sessionmaker

from service.security import keys
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_ALIAS, METRICS_SCOPE
from tests.security import payloads as pl
from tests.security.memory import RssMonitor
from tests.service.helpers import logits_data, promote
from tests.service.servers import Server

MiB = 1 << 20
#: Classes of the served model: N != K, and top_k=K is a real amplification.
K = 10
NAMESPACE = "harness"
#: The model every read and every scores route names (class names at their maximum).
TARGET = "target"
#: The model the routes that change or delete things act on.
VICTIM = "victim"
#: A model of top-k log-probabilities (calibrators.topk): its vocabulary size V (its K)
#: and the width k of its rows, wider than a hosted API's 20, V small enough to fit fast.
TOPK = "topk"
TOPK_V, TOPK_K = 1000, 32
#: The server's limits: each reachable by a test, none toy-sized.
SETTINGS = {
    "max_body_bytes": 4 * MiB,
    "max_json_bytes": 2 * MiB,
    "max_metadata_bytes": 1 * MiB,
    "max_model_bytes": 2 * MiB,
    "max_fused_bytes": 4 * MiB,
    "max_predict_rows": 1000,
    "max_feedback_rows": 1000,
    "max_dataset_rows": 100_000,
    "quota_models": 100,
}
#: Characters of a path or query parameter: far longer than any name or number the API
#: takes, short enough for the whole URL to pass httptools' limit (65,535 bytes).
URL_STRING = 60_000
#: Bytes of a request line, and of one header value, sent before any route is known.
HTTP_LAYER_BYTES = 32 * MiB
#: How much a bomb inflates past its route's decoded limit.
BOMB_FACTOR = 8
NPY = "application/x-npy"
OCTET = "application/octet-stream"
JSON = "application/json"


# -- the wire -------------------------------------------------------------------


@dataclass
class Reply:
    """An answer as it came off the wire."""

    status: int  # 0: none came
    answer_bytes: int  # its body, chunked framing undone
    head: bytes  # the status line, the headers and the start of the body
    sent: int  # body bytes the client sent before the answer (or the end)


def _dechunk(data: bytes) -> int:
    """The length of a chunked body (as much of it as arrived)."""
    total, at = 0, 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return total
        size = int(data[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return total
        total += min(size, len(data) - end - 2)
        at = end + 2 + size + 2


def exchange(port: int, method: str, target: str, headers: dict[str, str],
             chunks: Iterable[bytes] = (), *, length: int | None = None,
             chunked: bool = False, wait_early: float = 0.0) -> Reply:
    """Send one request on its own connection and read its whole answer.

    ``length``: the ``Content-Length`` declared (whatever is sent); ``chunked``: the
    body in chunked framing, one chunk per item of ``chunks``. The client stops sending
    as soon as the server answers (``wait_early``: seconds it waits for an answer to the
    headers alone before sending any body)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
                 *(f"{k}: {v}" for k, v in headers.items())]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        elif length is not None:
            lines.append(f"Content-Length: {length}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        sent, answered = 0, False
        if wait_early:
            answered = bool(select.select([sock], [], [], wait_early)[0])
        for chunk in () if answered else chunks:
            if not chunk:
                continue
            view = memoryview(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            while view:
                readable, writable, _ = select.select([sock], [sock], [], 30)
                if readable:
                    answered = True
                    break
                if not writable:
                    break
                try:
                    n = sock.send(view)
                except OSError:
                    answered = True
                    break
                view, sent = view[n:], sent + n
            if answered:
                break
        if chunked and not answered:
            try:
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass
        received = bytearray()
        sock.settimeout(60)
        while True:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                break
            if not data:
                break
            received += data
    finally:
        sock.close()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/"):
        return Reply(0, 0, bytes(received[:300]), sent)
    status = int(head.split(b" ", 2)[1])
    is_chunked = b"transfer-encoding: chunked" in head.lower()
    size = _dechunk(body) if is_chunked else len(body)
    return Reply(status, size, bytes(received[: len(head) + 4 + 300]), sent)


# -- what the harness knows ----------------------------------------------------


@dataclass
class Ids:
    """What a request's path can name, and the keys to send it with."""

    model: str
    version: int
    dataset_id: int
    alias: str
    key_id: int
    port: int = 0
    keys: dict[str, str] = field(default_factory=dict)  # scope -> key
    params: dict = field(default_factory=dict)  # the version's stored parameters
    names: list[str] = field(default_factory=list)  # the model's class names

    def fill(self, path: str) -> str:
        return path.format(model=self.model, name=self.model, version=self.version,
                           dataset_id=self.dataset_id, alias=self.alias, key_id=self.key_id)


@dataclass
class Case:
    """One hostile request and what it may cost."""

    op: str  # "METHOD /path/{template}"
    name: str
    send: Callable[[], Reply]
    #: Bytes the request legitimately carries once decoded, capped by its route's limit:
    #: what its memory is compared with (test_budget_harness.CONSTANT besides).
    carried: int
    expect: frozenset[int] | None = None  # None: any answer below 500
    #: It sends a body, or an encoding, beyond what the route's budget allows.
    over_budget: bool = False


Body = tuple[str, bytes]  # content type, bytes


@dataclass(frozen=True)
class Route:
    """What the harness knows of one operation beyond its ``x-budget``."""

    #: A valid body (the long-string variants replace its strings), or None.
    valid: Callable[[Ids], Body] | None = None
    #: It changes or deletes what its path names: it acts on the victim model's objects.
    victim: bool = False
    #: Its own cases: the largest declared shapes of the scores routes, and what is
    #: tried once for the whole server.
    shapes: Callable[[Ids, dict, dict], list[Case]] | None = None
    #: It reads its body whatever the Content-Type says (the Open Inference Protocol
    #: tells JSON from binary by Inference-Header-Content-Length, as Triton does).
    any_content_type: bool = False


def _json(obj) -> Body:
    return JSON, json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _scores(rows: int, k: int = K, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, k)).astype(np.float32)


def _labelled_npz(rows: int) -> Body:
    z, y = logits_data(rows, K)
    return OCTET, pl.npz({"logits.npy": pl.array_npy(z.astype(np.float32)),
                          "labels.npy": pl.array_npy(y)})


def _v2_head(rows: int, k: int, parameters: dict, outputs: list[str], binary: bool,
             z: np.ndarray | None = None) -> dict:
    tensor = {"name": "logits", "shape": [rows, k], "datatype": "FP32"}
    if binary:
        tensor["parameters"] = {"binary_data_size": rows * k * 4}
    else:
        tensor["data"] = z.ravel().tolist()
    return {"inputs": [tensor], "outputs": [{"name": n} for n in outputs],
            "parameters": parameters}


def _send(ids: Ids, method: str, path: str, budget: dict, body: Body | None,
          headers: dict | None = None) -> Callable[[], Reply]:
    h = {**_auth(ids, budget), **(headers or {})}
    data = b""
    if body is not None:
        h.setdefault("Content-Type", body[0])
        data = body[1]
    return lambda: exchange(ids.port, method, path, h, [data], length=len(data))


def _auth(ids: Ids, budget: dict) -> dict[str, str]:
    scope = budget["scope"]
    if scope is None:
        return {}
    key = ids.keys[METRICS_SCOPE if scope == METRICS_SCOPE else "admin"]
    return {"Authorization": f"Bearer {key}"}


def _predict_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """Rows at the row limit, top_k at K, names, JSON and .npy, either answer."""
    budget, path = op["x-budget"], ids.fill(op["path"])
    rows = settings["max_predict_rows"]
    cases = []
    for n in (rows, 1):
        z = _scores(n)
        for fmt, body in (("npy", (NPY, pl.array_npy(z))),
                          ("json", _json({"logits": z.tolist()}))):
            for accept in (JSON, NPY):
                target = f"{path}?top_k={K}"
                cases.append(Case(
                    op["op"], f"{n} x {K} {fmt}, top_k={K}, names, accept {accept}",
                    _send(ids, "POST", target, budget, body, {"Accept": accept}),
                    len(body[1]), frozenset({200, 413, 422})))
    z = _scores(rows)
    body = (NPY, pl.array_npy(z))
    cases.append(Case(op["op"], f"{rows} x {K} npy, no top_k, accept npy",
                      _send(ids, "POST", path, budget, body, {"Accept": NPY}),
                      len(body[1]), frozenset({200})))
    packed = gzip.compress(body[1])
    cases.append(Case(op["op"], f"{rows} x {K} npy gzip'd, top_k={K}",
                      _send(ids, "POST", f"{path}?top_k={K}", budget, (NPY, packed),
                            {"Content-Encoding": "gzip"}),
                      len(body[1]), frozenset({200, 413, 422})))
    return cases


def _infer_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """Rows at the row limit, top_k at K, every output the model lists, names; JSON and
    binary tensors, in and out."""
    budget, path = op["x-budget"], ids.fill(op["path"])
    rows = settings["max_predict_rows"]
    outputs = ids.params["v2_outputs"]
    cases = []
    for n in (rows, 1):
        z = _scores(n)
        for binary in (False, True):
            head = _v2_head(n, K, {"top_k": K, "binary_data_output": binary}, outputs, binary,
                            z)
            head_bytes = json.dumps(head).encode()
            body = head_bytes + (z.tobytes() if binary else b"")
            headers = {"Inference-Header-Content-Length": str(len(head_bytes))}
            cases.append(Case(
                op["op"], f"{n} x {K} {'binary' if binary else 'JSON'}, top_k={K}, "
                f"all {len(outputs)} outputs",
                _send(ids, "POST", path, budget, (OCTET if binary else JSON, body),
                      headers if binary else None),
                len(body), frozenset({200, 413, 422})))
    return cases


def _feedback_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    budget, path = op["x-budget"], ids.fill(op["path"])
    rows = settings["max_feedback_rows"]
    cases = []
    for n in (rows, rows + 1):
        body = _labelled_npz(n)
        cases.append(Case(op["op"], f"{n} labelled rows .npz",
                          _send(ids, "POST", path, budget, body), len(body[1]),
                          frozenset({200} if n == rows else {413})))
    z, y = logits_data(rows, K)
    body = _json({"logits": z.tolist(), "labels": y.tolist()})
    cases.append(Case(op["op"], f"{rows} labelled rows JSON",
                      _send(ids, "POST", path, budget, body), len(body[1]),
                      frozenset({200, 413})))
    return cases


def _upload_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """The largest .npz the body limit allows: float32 scores, int64 labels, which count
    twice (as read and as their validated copy: service/api/codecs/npy.py)."""
    budget, path = op["x-budget"], ids.fill(op["path"])
    rows = (budget["body_bytes"] - 4096) // (K * 4 + 2 * 8)
    body = _labelled_npz(rows)
    return [Case(op["op"], f"{rows:,} labelled rows .npz ({len(body[1]) / MiB:.1f} MiB)",
                 _send(ids, "POST", path, budget, body), len(body[1]),
                 frozenset({200, 201}))]


def _dataset_json(ids: Ids) -> Body:
    z, y = logits_data(20, K)
    return _json({"logits": z.tolist(), "labels": y.tolist()})


def _classifier_onnx() -> bytes:
    """A linear classifier's ONNX: x (N, 3) -> scores (N, K)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["scores"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3, K], np.ones(3 * K))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _infer_json(ids: Ids) -> Body:
    return _json({"inputs": [{"name": "logits", "shape": [1, K], "datatype": "FP32",
                              "data": [0.0] * K}]})


# -- top-k rows (calibrators.topk) on the top-k model ----------------------------


def _topk_rows(rows: int) -> dict[str, np.ndarray]:
    """``rows`` top-k rows of the top-k model (400 distinct ones, repeated), with labels
    drawn from a flatter distribution than the rows say (an overconfident model: its fit
    is accepted), a few in the tail."""
    rng = np.random.default_rng(5)
    base = min(rows, 400)
    z = rng.normal(scale=3.0, size=(base, TOPK_V))
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    ids = np.argsort(-lp, axis=1)[:, :TOPK_K]
    flat = np.exp(0.6 * z)
    flat /= flat.sum(axis=1, keepdims=True)
    labels = (rng.random(base)[:, None] < np.cumsum(flat, axis=1)).argmax(axis=1)
    again = np.arange(rows) % base
    return {"topk_ids": ids[again].astype(np.int64),
            "topk_logprobs": np.take_along_axis(lp, ids, axis=1)[again].astype(np.float32),
            "labels": labels[again].astype(np.int64)}


def _topk_npz(rows: int, labelled: bool) -> Body:
    arrays = _topk_rows(rows)
    members = {f"{k}.npy": pl.array_npy(v) for k, v in arrays.items()
               if labelled or k != "labels"}
    members["vocab_size.npy"] = pl.array_npy(np.int64(TOPK_V))
    return OCTET, pl.npz(members)


def _topk_json(rows: int, labelled: bool) -> Body:
    arrays = _topk_rows(rows)
    obj = {"topk_ids": arrays["topk_ids"].tolist(),
           "topk_logprobs": arrays["topk_logprobs"].astype(float).tolist(),
           "vocab_size": TOPK_V}
    if labelled:
        obj["labels"] = arrays["labels"].tolist()
    return _json(obj)


def _topk_chat(rows: int | None, limit: int = 0) -> Body:
    """Top-k rows in the chat-completions shape (one choice, token strings of the
    longest ids), ``rows`` positions, or (``rows`` None) as many as fill ``limit`` bytes."""
    arrays = _topk_rows(400)

    def position(i: int) -> dict:
        i %= 400
        return {"token": f"tok{arrays['labels'][i]:06d}", "logprob": -1.0,
                "top_logprobs": [{"token": f"tok{t:06d}", "logprob": float(v)}
                                 for t, v in zip(arrays["topk_ids"][i],
                                                 arrays["topk_logprobs"][i], strict=True)]}

    if rows is None:
        each = len(_json(position(0))[1]) + 1
        rows = (limit - 1024) // each
    return _json({"logprobs": {"content": [position(i) for i in range(rows)]},
                  "vocab_size": TOPK_V})


def _topk_path(op: dict, ids: Ids) -> str:
    """The operation's path naming the top-k model (and its served version)."""
    return op["path"].format(model=TOPK, name=TOPK, version=ids.params["topk_version"],
                             dataset_id=ids.dataset_id)


def _topk_predict_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """A top-k version's predict: rows at the row limit as a .npz, JSON arrays and the
    chat-completions shape, either Accept (predict.npy answers a .npy whatever it
    says); a chat body filling the JSON limit (more rows than the limit: 413 once
    read); the .npz gzip'd."""
    budget, path = op["x-budget"], _topk_path(op, ids)
    rows = settings["max_predict_rows"]
    cases = []
    for fmt, body in (("npz", _topk_npz(rows, False)), ("JSON arrays", _topk_json(rows, False)),
                      ("chat JSON", _topk_chat(rows))):
        for accept in (JSON, NPY):  # a JSON answer may pass MAX_JSON_BYTES: 422 first
            cases.append(Case(op["op"], f"top-k: {rows} x {TOPK_K} {fmt}, accept {accept}",
                              _send(ids, "POST", path, budget, body, {"Accept": accept}),
                              len(body[1]), frozenset({200, 422} if accept == JSON else {200})))
    body = _topk_chat(None, settings["max_json_bytes"])
    cases.append(Case(op["op"], f"top-k: chat JSON filling MAX_JSON_BYTES "
                      f"({len(body[1]) / MiB:.1f} MiB)",
                      _send(ids, "POST", path, budget, body), len(body[1]),
                      frozenset({413})))
    body = _topk_npz(rows, False)
    cases.append(Case(op["op"], f"top-k: {rows} x {TOPK_K} npz gzip'd",
                      _send(ids, "POST", path, budget, (OCTET, gzip.compress(body[1])),
                            {"Content-Encoding": "gzip"}),
                      len(body[1]), frozenset({200})))
    return cases


def _predict_all_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    return _predict_shapes(ids, op, settings) + _topk_predict_shapes(ids, op, settings)


def _topk_infer_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """A top-k version's infer: rows at the row limit, JSON and binary tensors in and
    out, every output; the binary body gzip'd."""
    budget, path = op["x-budget"], _topk_path(op, ids)
    rows = settings["max_predict_rows"]
    arrays = _topk_rows(rows)
    cases = []
    for binary in (False, True):
        inputs, raw = [], b""
        for name, datatype in (("topk_ids", "INT64"), ("topk_logprobs", "FP32")):
            t = {"name": name, "shape": [rows, TOPK_K], "datatype": datatype}
            if binary:
                t["parameters"] = {"binary_data_size": arrays[name].nbytes}
                raw += arrays[name].tobytes()
            else:
                t["data"] = arrays[name].ravel().tolist()
            inputs.append(t)
        head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": binary},
                           "outputs": [{"name": n} for n in ("probabilities", "topk_ids",
                                                              "tail")]}).encode()
        headers = {"Inference-Header-Content-Length": str(len(head))} if binary else {}
        body = head + raw
        cases.append(Case(op["op"], f"top-k: {rows} x {TOPK_K} {'binary' if binary else 'JSON'}"
                          ", all 3 outputs",
                          _send(ids, "POST", path, budget, (OCTET if binary else JSON, body),
                                headers), len(body), frozenset({200})))
        if binary:
            cases.append(Case(op["op"], f"top-k: {rows} x {TOPK_K} binary gzip'd",
                              _send(ids, "POST", path, budget, (OCTET, gzip.compress(body)),
                                    {**headers, "Content-Encoding": "gzip"}),
                              len(body), frozenset({200})))
    return cases


def _infer_all_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    return _infer_shapes(ids, op, settings) + _topk_infer_shapes(ids, op, settings)


def _topk_upload_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """Top-k datasets: the largest .npz the body limit allows (int64 ids and labels
    count twice, as read and validated), JSON arrays and the chat-completions shape
    filling the JSON limit, and that chat body gzip'd."""
    budget, path = op["x-budget"], _topk_path(op, ids)
    per_row = TOPK_K * (2 * 8 + 4) + 2 * 8
    rows = (budget["body_bytes"] - 4096) // per_row
    cases = []
    npz_body = _topk_npz(rows, True)
    json_rows = (settings["max_json_bytes"] - 4096) // len(_topk_json(1, True)[1])
    chat = _topk_chat(None, settings["max_json_bytes"])
    for name, body in ((f"{rows:,} rows .npz", npz_body),
                       (f"{json_rows:,} rows JSON arrays", _topk_json(json_rows, True)),
                       ("chat JSON filling MAX_JSON_BYTES", chat)):
        cases.append(Case(op["op"], f"top-k: {name} ({len(body[1]) / MiB:.1f} MiB)",
                          _send(ids, "POST", path, budget, body), len(body[1]),
                          frozenset({200, 201})))
    cases.append(Case(op["op"], "top-k: that chat JSON gzip'd",
                      _send(ids, "POST", path, budget, (JSON, gzip.compress(chat[1])),
                            {"Content-Encoding": "gzip"}),
                      len(chat[1]), frozenset({200, 201})))
    return cases


def _topk_feedback_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    """Labelled top-k rows on the top-k version: at and over the row limit (.npz), JSON
    arrays at it, a chat body filling the JSON limit (over it: 413 once read)."""
    budget, path = op["x-budget"], _topk_path(op, ids)
    rows = settings["max_feedback_rows"]
    cases = []
    for n, body in ((rows, _topk_npz(rows, True)), (rows + 1, _topk_npz(rows + 1, True)),
                    (rows, _topk_json(rows, True)),
                    (None, _topk_chat(None, settings["max_json_bytes"]))):
        name = "chat JSON filling MAX_JSON_BYTES" if n is None else f"{n} labelled rows"
        fmt = "" if n is None else (" .npz" if body[0] == OCTET else " JSON arrays")
        cases.append(Case(op["op"], f"top-k: {name}{fmt}", _send(ids, "POST", path, budget, body),
                          len(body[1]), frozenset({200} if n == rows else {413})))
    return cases


def _feedback_all_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    return _feedback_shapes(ids, op, settings) + _topk_feedback_shapes(ids, op, settings)


def _upload_all_shapes(ids: Ids, op: dict, settings: dict) -> list[Case]:
    return _upload_shapes(ids, op, settings) + _topk_upload_shapes(ids, op, settings)


def _http_layer(ids: Ids, op: dict) -> list[Case]:
    """Before any route is known: a request line and a header value of
    :data:`HTTP_LAYER_BYTES` (no route's budget can apply yet; the HTTP layer's limits
    must)."""
    path, n = ids.fill(op["path"]), HTTP_LAYER_BYTES
    return [
        Case(op["op"], f"request line of {n / MiB:.0f} MiB (HTTP layer)",
             lambda: exchange(ids.port, "GET", f"{path}?x={'9' * n}", {}), 0,
             frozenset({400, 408, 414, 431})),
        Case(op["op"], f"header value of {n / MiB:.0f} MiB (HTTP layer)",
             lambda: exchange(ids.port, "GET", path, {"X-Long": "9" * n}), 0,
             frozenset({400, 408, 431})),
    ]


V1 = "/v1/models/{model}"
V2 = "/v2/models/{name}"
#: Every operation the harness knows, "METHOD path" as in /openapi.json.
ROUTES: dict[str, Route] = {
    "GET /healthz": Route(shapes=lambda ids, op, settings: _http_layer(ids, op)),
    "GET /readyz": Route(),
    "GET /metrics": Route(),
    "GET /v2": Route(),
    "GET /v2/health/live": Route(),
    "GET /v2/health/ready": Route(),
    f"GET {V2}": Route(),
    f"GET {V2}/ready": Route(),
    f"GET {V2}/versions/{{version}}": Route(),
    f"GET {V2}/versions/{{version}}/ready": Route(),
    f"GET {V2}/config": Route(),
    f"GET {V2}/versions/{{version}}/config": Route(),
    f"POST {V2}/infer": Route(_infer_json, shapes=_infer_all_shapes, any_content_type=True),
    f"POST {V2}/versions/{{version}}/infer": Route(_infer_json, shapes=_infer_all_shapes,
                                                   any_content_type=True),
    "GET /v1/models": Route(),
    "POST /v1/models": Route(lambda ids: _json({"name": "created", "num_classes": K,
                                                "description": "d", "class_names": None}),
                             victim=True),
    f"GET {V1}": Route(),
    f"PATCH {V1}": Route(lambda ids: _json({"description": "d"}), victim=True),
    f"DELETE {V1}": Route(victim=True),
    f"POST {V1}/predict": Route(lambda ids: _json({"logits": [[0.0] * K]}),
                                shapes=_predict_all_shapes),
    f"POST {V1}/predict.npy": Route(lambda ids: _json({"logits": [[0.0] * K]}),
                                    shapes=_predict_all_shapes),
    f"POST {V1}/feedback": Route(
        lambda ids: _json({"logits": [[0.0] * K], "labels": [0]}), shapes=_feedback_all_shapes),
    f"GET {V1}/monitoring": Route(),
    f"GET {V1}/monitoring/reliability.svg": Route(),
    # label shift (service/api/routers/label_shift.py)
    f"GET {V1}/label-shift": Route(),
    f"POST {V1}/label-shift": Route(victim=True),
    f"GET {V1}/datasets": Route(),
    f"POST {V1}/datasets": Route(_dataset_json, victim=True, shapes=_upload_all_shapes),
    f"GET {V1}/datasets/{{dataset_id}}": Route(),
    f"DELETE {V1}/datasets/{{dataset_id}}": Route(victim=True),
    f"POST {V1}/compare": Route(
        lambda ids: _json({"a": ids.dataset_id, "b": ids.dataset_id, "top_k": 3})),
    f"GET {V1}/calibrators": Route(),
    f"POST {V1}/calibrators": Route(
        lambda ids: _json({"dataset_id": ids.dataset_id, "method": "temperature"}),
        victim=True),
    f"POST {V1}/calibrators/import": Route(
        lambda ids: _json({"dataset_id": ids.dataset_id, "params": ids.params["params"]}),
        victim=True),
    f"GET {V1}/calibrators/{{version}}": Route(),
    f"DELETE {V1}/calibrators/{{version}}": Route(victim=True),
    f"POST {V1}/calibrators/{{version}}/cancel": Route(victim=True),
    f"GET {V1}/calibrators/{{version}}/onnx": Route(),
    f"POST {V1}/calibrators/{{version}}/fuse": Route(lambda ids: (OCTET, _classifier_onnx())),
    f"GET {V1}/calibrators/{{version}}/reliability.svg": Route(),
    f"GET {V1}/aliases": Route(),
    f"PUT {V1}/aliases/{{alias}}": Route(lambda ids: _json({"version": ids.version}),
                                         victim=True),
    f"GET {V1}/aliases/{{alias}}": Route(),
    f"DELETE {V1}/aliases/{{alias}}": Route(victim=True),
    # The recalibration loop: its settings, a run (409 or a queued fit), its lists.
    f"GET {V1}/loop": Route(),
    f"PUT {V1}/loop": Route(lambda ids: _json({"keep_feedback": True, "retention_rows": 1000}),
                            victim=True),
    f"POST {V1}/loop/runs": Route(victim=True),
    f"GET {V1}/loop/runs": Route(),
    f"GET {V1}/loop/events": Route(),
    "GET /v1/keys": Route(),
    "POST /v1/keys": Route(lambda ids: _json({"scope": "predict", "description": "d"}),
                           victim=True),
    "DELETE /v1/keys/{key_id}": Route(victim=True),
}


def operations(doc: dict) -> list[dict]:
    """Every operation of an OpenAPI document: ``op`` ("METHOD path"), ``method``,
    ``path``, ``x-budget`` (None when missing), its parameters and request body."""
    ops = []
    for path, item in doc["paths"].items():
        for method, spec in item.items():
            if method not in ("get", "put", "post", "delete", "patch", "head", "options"):
                continue
            ops.append({"op": f"{method.upper()} {path}", "method": method.upper(),
                        "path": path, "x-budget": spec.get("x-budget"),
                        "parameters": spec.get("parameters", []),
                        "body": spec.get("requestBody")})
    return ops


# -- the cases -------------------------------------------------------------------


def _filler(content_type: str, n: int) -> Iterator[bytes]:
    """``n`` bytes of a body its parser reads on through: a JSON object opened and then
    whitespace, or zeros; in 64 KiB chunks."""
    first = b"{" if content_type == JSON else b"\0"
    yield first
    left, block = n - 1, (b" " if content_type == JSON else b"\0") * (1 << 16)
    while left > 0:
        yield block[: min(left, len(block))]
        left -= len(block)


def _bomb(content_type: str, n: int) -> bytes:
    """``n`` bytes of :func:`_filler`, gzip'd (about a thousandth of their size)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join([*(packer.compress(c) for c in _filler(content_type, n)), packer.flush()])


def _body_type(op: dict) -> str:
    content = (op["body"] or {}).get("content", {})
    return JSON if JSON in content or not content else next(iter(content))


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        at = doc
        for part in schema["$ref"].lstrip("#/").split("/"):
            at = at[part]
        schema = at
    return schema


def _takes_string(doc: dict, schema: dict) -> bool:
    schema = _resolve(doc, schema)
    if schema.get("type") == "string" or any(isinstance(v, str) for v in schema.get("enum", ())):
        return True
    return any(_takes_string(doc, s) for s in [*schema.get("anyOf", ()), *schema.get("oneOf", ())])


def _string_fields(doc: dict, op: dict) -> dict[str, bool]:
    """The JSON body's properties that take strings: name -> is a list of strings."""
    schema = (op["body"] or {}).get("content", {}).get(JSON, {}).get("schema")
    if schema is None:
        return {}
    fields = {}
    for name, prop in _resolve(doc, schema).get("properties", {}).items():
        options = [_resolve(doc, s) for s in (prop.get("anyOf") or [prop])]
        if any(o.get("type") == "array" and _takes_string(doc, o.get("items", {}))
               for o in options):
            fields[name] = True
        elif _takes_string(doc, prop):
            fields[name] = False
    return fields


def cases_for(doc: dict, op: dict, route: Route, ids: Ids, settings: dict) -> list[Case]:
    """Every hostile request for ``op``, from its x-budget and ``route``."""
    budget = op["x-budget"]
    method, path = op["method"], ids.fill(op["path"])
    auth = _auth(ids, budget)
    body_limit, decoded = budget["body_bytes"], budget["decoded_bytes"]
    ctype = _body_type(op)
    port = ids.port
    cases = []

    def add(name, send, carried, expect=None, over_budget=False):
        cases.append(Case(op["op"], name, send, carried,
                          None if expect is None else frozenset(expect), over_budget))

    over = body_limit + 1
    add(f"Content-Length {over:,} (limit + 1), sent",
        lambda: exchange(port, method, path, {**auth, "Content-Type": ctype},
                         _filler(ctype, over), length=over, wait_early=2.0),
        body_limit, {413}, True)
    add("Content-Length 1 GiB, 1 MiB sent",
        lambda: exchange(port, method, path, {**auth, "Content-Type": ctype},
                         _filler(ctype, MiB), length=1 << 30, wait_early=2.0),
        body_limit, {413}, True)
    add(f"chunked {over:,} bytes (limit + 1)",
        lambda: exchange(port, method, path, {**auth, "Content-Type": ctype},
                         _filler(ctype, over), chunked=True),
        body_limit, {413}, True)
    if decoded is not None:
        inflated = BOMB_FACTOR * decoded
        bomb = _bomb(ctype, inflated)
        add(f"gzip bomb {len(bomb) / 1024:.0f} KiB -> {inflated / MiB:.0f} MiB",
            lambda: exchange(port, method, path, {**auth, "Content-Type": ctype,
                                                  "Content-Encoding": "gzip"},
                             [bomb], length=len(bomb)),
            decoded, {400, 413}, True)
        add("deflate bomb, chunked",
            lambda: exchange(port, method, path, {**auth, "Content-Type": ctype,
                                                  "Content-Encoding": "deflate"},
                             [zlib.compress(b"{" + b" " * (inflated - 1), 9)], chunked=True),
            decoded, {400, 413}, True)
    else:
        small = gzip.compress(b"{}")
        fits = len(small) <= body_limit
        add("gzip body" if fits else "Content-Encoding gzip, no body",
            lambda: exchange(port, method, path, {**auth, "Content-Type": ctype,
                                                  "Content-Encoding": "gzip"},
                             [small] if fits else [], length=len(small) if fits else 0),
            min(len(small), body_limit), {415}, True)
    add("Content-Encoding br",
        lambda: exchange(port, method, path, {**auth, "Content-Type": ctype,
                                              "Content-Encoding": "br"}, [b"{}"], length=2),
        min(2, body_limit), {415} if body_limit else {413, 415}, True)
    valid = route.valid(ids) if route.valid is not None else None
    if body_limit and valid is not None:
        for wrong in ("text/plain", NPY if valid[0] == JSON else JSON,
                      "multipart/form-data; boundary=x"):
            add(f"valid body as {wrong}", _send(ids, method, path, budget, (wrong, valid[1])),
                len(valid[1]), None if route.any_content_type else {400, 415, 422})
        if valid[0] == JSON:
            base = json.loads(valid[1])
            room = body_limit - len(valid[1]) - 1024
            for name, is_list in _string_fields(doc, op).items():
                if is_list:
                    value = [f"{i}" + "x" * (room // K - 16) for i in range(K)]
                else:
                    value = "x" * room
                body = _json({**base, name: value})
                add(f"{name}: {'K strings' if is_list else 'a string'} filling the body",
                    _send(ids, method, path, budget, body), len(body[1]))
    for param in op["parameters"]:
        where = param["in"]
        long = "9" * (settings["max_metadata_bytes"] if where == "header" else URL_STRING)
        if where == "path":
            add(f"path {param['name']} of {len(long):,} characters",
                _send(ids, method, _fill_except(ids, op["path"], param["name"], long),
                      budget, valid), len(valid[1]) if valid else 0)
        elif where == "query":
            sep = "&" if "?" in path else "?"
            add(f"?{param['name']}= of {len(long):,} characters",
                _send(ids, method, f"{path}{sep}{param['name']}={long}", budget, valid),
                len(valid[1]) if valid else 0)
        elif where == "header":
            add(f"header {param['name']} of {len(long):,} characters",
                _send(ids, method, path, budget, valid, {param["name"]: long}),
                len(valid[1]) if valid else 0)
    if route.shapes is not None:
        cases += route.shapes(ids, op, settings)
    return cases


def _fill_except(ids: Ids, template: str, name: str, value: str) -> str:
    """``template`` filled from ``ids``, with ``value`` (quoted) for the parameter ``name``."""
    marker = "\x00"
    filled = ids.fill(template.replace("{" + name + "}", marker))
    return filled.replace(marker, quote(value, safe=""))


# -- the server ------------------------------------------------------------------


def _keys(database_url: str) -> dict[str, str]:
    engine = make_engine(database_url)
    try:
        with sessionmaker(engine, expire_on_commit=False)() as s:
            made = {"admin": keys.create_key(s, NAMESPACE, "admin")[1],
                    METRICS_SCOPE: keys.create_key(s, None, METRICS_SCOPE)[1]}
            victim, _ = keys.create_key(s, NAMESPACE, "predict", description="victim")
            made["victim"] = str(victim.id)
    finally:
        engine.dispose()
    return made


def longest_names(c, model: str, body_limit: int) -> list[str]:
    """The longest class names the API accepts for ``model`` (K of them), found by
    asking it: PATCH names of one character repeated, distinct by a prefix, as long as
    they are accepted (the per-name and total bounds, whatever they are, and the body
    limit). The character is the costliest in an answer the API takes: a control
    character (6 bytes in JSON) if accepted, else one of 4 UTF-8 bytes."""
    def names(char: str, n: int) -> list[str]:
        return [f"{i:02d}" + char * n for i in range(K)]

    def takes(char: str, n: int) -> bool:
        r = c.patch(f"/v1/models/{model}", json={"class_names": names(char, n)})
        assert r.status_code < 500, r.text
        return r.status_code == 200

    for char in ("\x01", "\U0001f600", "n"):
        if takes(char, 1):
            break
    lo, hi = 1, body_limit // K
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if takes(char, mid):
            lo = mid
        else:
            hi = mid - 1
    best = names(char, lo)
    r = c.patch(f"/v1/models/{model}", json={"class_names": best})
    assert r.status_code == 200, r.text
    return best


def _model(c, name: str) -> tuple[int, int, dict]:
    """A model of K classes with a fitted, aliased version: its dataset, version, params."""
    r = c.post("/v1/models", json={"name": name, "num_classes": K, "argmax_policy": "off"})
    assert r.status_code == 201, r.text
    z, y = logits_data(300, K)
    r = c.post(f"/v1/models/{name}/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    assert r.status_code == 201, r.text
    dataset = r.json()["id"]
    version = promote(c, name, dataset)
    return dataset, version["version"], version["params"]


def prepare(server: Server) -> tuple[Ids, Ids]:
    """The namespace's keys, the target model (class names at their maximum) and the
    victim model; each with a dataset, a fitted version and the default alias. The
    first requests of each scores route's formats are made here (the first ONNX Runtime
    session, the first parse of each format: costs of serving, not of any body)."""
    made = _keys(server.database_url)
    auth = {"Authorization": f"Bearer {made['admin']}"}
    with server.client(headers=auth) as c:
        target = _model(c, TARGET)
        victim = _model(c, VICTIM)
        topk_version = _topk_model(c)
        names = longest_names(c, TARGET, SETTINGS["max_metadata_bytes"])
        # Enough models with those names that their names alone pass the largest answer
        # bound of a list of models (max_json_bytes), within the namespace's model quota.
        each = len(_json(names)[1])
        for i in range(min(SETTINGS["quota_models"] - 4, SETTINGS["max_json_bytes"] // each)):
            r = c.post("/v1/models", json={"name": f"named-{i}", "num_classes": K})
            assert r.status_code == 201, r.text
            r = c.patch(f"/v1/models/named-{i}", json={"class_names": names})
            assert r.status_code == 200, r.text
        meta = c.get(f"/v2/models/{TARGET}", params={"top_k": K}).json()
        outputs = [o["name"] for o in meta["outputs"]]
        z = _scores(4)
        for accept in (JSON, NPY):
            r = c.post(f"/v1/models/{TARGET}/predict?top_k=2", content=pl.array_npy(z),
                       headers={"content-type": NPY, "accept": accept})
            assert r.status_code == 200, r.text
        r = c.post(f"/v1/models/{TARGET}/predict", json={"logits": z.tolist()})
        assert r.status_code == 200, r.text
        r = c.post(f"/v2/models/{TARGET}/infer",
                   json=_v2_head(4, K, {"top_k": 2}, outputs, False, z))
        assert r.status_code == 200, r.text
        r = c.post(f"/v1/models/{TARGET}/feedback", content=_labelled_npz(8)[1],
                   headers={"content-type": OCTET})
        assert r.status_code == 200, r.text
    keys_ = {"admin": made["admin"], METRICS_SCOPE: made[METRICS_SCOPE]}
    common = {"alias": DEFAULT_ALIAS, "port": server.port, "keys": keys_}
    served = {"v2_outputs": outputs, "topk_version": topk_version}
    return (
        Ids(TARGET, target[1], target[0], key_id=int(made["victim"]) + 10_000,
            names=names, params={"params": target[2], **served}, **common),
        Ids(VICTIM, victim[1], victim[0], key_id=int(made["victim"]), names=names,
            params={"params": victim[2], **served}, **common),
    )


def _topk_model(c) -> int:
    """The top-k model (V = :data:`TOPK_V`), a top-k temperature fitted on 400 rows of
    width :data:`TOPK_K` behind its default alias, and its first predicts of each format
    (the first session and parse, as for the target). Returns the version."""
    r = c.post("/v1/models", json={"name": TOPK, "num_classes": TOPK_V})
    assert r.status_code == 201, r.text
    r = c.post(f"/v1/models/{TOPK}/datasets", content=_topk_npz(400, True)[1],
               headers={"content-type": OCTET})
    assert r.status_code == 201, r.text
    version = promote(c, TOPK, r.json()["id"])["version"]
    for body in (_topk_npz(4, False), _topk_json(4, False), _topk_chat(4)):
        for accept in (JSON, NPY):
            r = c.post(f"/v1/models/{TOPK}/predict", content=body[1],
                       headers={"content-type": body[0], "accept": accept})
            assert r.status_code == 200, r.text
    return version


def all_cases(doc: dict, target: Ids, victim: Ids, settings: dict) -> list[Case]:
    """The cases of every operation the harness knows; the deletes last, deepest path
    first (so each deletes something that still exists)."""
    ops = [op for op in operations(doc) if op["op"] in ROUTES]
    ops.sort(key=lambda op: (op["method"] == "DELETE", -op["path"].count("/")))
    cases = []
    for op in ops:
        route = ROUTES[op["op"]]
        cases += cases_for(doc, op, route, victim if route.victim else target, settings)
    return cases


@dataclass
class Row:
    case: Case
    reply: Reply
    before: int  # RSS before, bytes
    growth: int  # peak anonymous RSS growth, bytes
    seconds: float


def run(server: Server, case: Case) -> Row:
    monitor = RssMonitor(server.proc.pid)
    start = time.monotonic()
    reply, before, _ = monitor.measure(case.send)
    return Row(case, reply, before, monitor.anon_growth, time.monotonic() - start)


def table(rows: list[Row], bound: Callable[[Case], int]) -> str:
    lines = ["| operation | request | status | answer | carried | RSS growth | bound |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r.case.op} | {r.case.name} | {r.reply.status} | {r.reply.answer_bytes:,} | "
            f"{r.case.carried / MiB:.1f} MiB | {r.growth / MiB:.1f} MiB | "
            f"{bound(r.case) / MiB:.0f} MiB |")
    return "\n".join(lines)


def serve(tmp: Path) -> Server:
    return Server(f"sqlite:///{tmp / 'r.sqlite3'}", tmp / "data", fit_executor="thread",
                  auth="on", **SETTINGS)


def main() -> None:
    from tests.security.test_budget_harness import bound

    with tempfile.TemporaryDirectory() as tmp, serve(Path(tmp)) as server:
        target, victim = prepare(server)
        with server.client() as c:
            doc = c.get("/openapi.json").json()
        print(f"server pid {server.proc.pid}, PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
        rows = [run(server, case) for case in all_cases(doc, target, victim, SETTINGS)]
        print(table(rows, bound))


if __name__ == "__main__":
    main()
