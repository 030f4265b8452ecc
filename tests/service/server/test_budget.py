"""Every route's request budget (service.server.budget): declared, published, enforced.

In process: the declarations (every route, in /openapi.json, a route without one
refused when the app is built), the decoded limit of compressed bodies on every route
that takes them, the refusal of encodings elsewhere, and the answer bound of predict
and infer (names and top_k included) checked before the work. The same limits against
a real server process, with its memory measured, are tests/security/test_budget_harness.py.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib

import numpy as np
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.codecs import oip
from service.server import budget
from tests.oracles import traced_peak
from tests.service.helpers import (
    assert_problem,
    create_model,
    logits_data,
    make_settings,
    npy,
    npz,
    promote,
)

K = 4
NPY = "application/x-npy"


@pytest.fixture
def served(client) -> TestClient:
    create_model(client, "m", K)
    z, y = logits_data(200, K)
    r = client.post("/v1/models/m/datasets", content=npz(logits=z, labels=y),
                    headers={"content-type": "application/octet-stream"})
    promote(client, "m", r.json()["id"])
    return client


def test_every_route_declares_its_budget_and_publishes_it(client):
    doc = client.get("/openapi.json").json()
    operations = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(operations) >= 40
    for path, method, op in operations:
        declared = op["x-budget"]
        assert set(declared) == {"scope", "body_bytes", "decoded_bytes", "encodings",
                                 "answer_bytes"}, (method, path)
        assert declared["answer_bytes"] > 0
        if method == "get":
            assert declared["body_bytes"] == 0, path  # a read takes no body
    for route in budget.flatten(client.app.routes):
        assert isinstance(route.limits, budget.Limits), route


def test_a_route_without_a_budget_is_refused_when_the_app_is_built(tmp_path):
    app = FastAPI()
    router = APIRouter()

    @router.get("/declared")
    @budget.declare(budget.READ)
    def declared() -> dict:
        return {}

    @router.post("/forgotten")
    def forgotten() -> dict:
        return {}

    app.include_router(router)
    with pytest.raises(budget.MissingBudget, match="POST /forgotten"):
        budget.attach(app.routes, make_settings("sqlite://", tmp_path))


def test_a_budget_names_settings_and_scopes():
    with pytest.raises(ValueError, match="Settings fields"):
        budget.Budget("write", body="max_everything")
    with pytest.raises(ValueError, match="scope"):
        budget.Budget("root")
    with pytest.raises(ValueError, match="decodes none"):
        budget.Budget("write", decoded="max_json_bytes")


def test_compressed_bodies_are_decoded_on_every_route_that_takes_them(served):
    z = np.random.default_rng(1).normal(size=(6, K))
    plain = served.post("/v1/models/m/predict", json={"logits": z.tolist()})
    assert plain.status_code == 200, plain.text
    body = json.dumps({"logits": z.tolist()}).encode()
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        r = served.post("/v1/models/m/predict", content=packed,
                        headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == 200, r.text
        assert r.json()["probabilities"] == plain.json()["probabilities"]
    r = served.post("/v1/models/m/predict", content=gzip.compress(npy(z)),
                    headers={"content-type": NPY, "content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    y = np.arange(6) % K
    r = served.post("/v1/models/m/feedback", content=gzip.compress(npz(logits=z, labels=y)),
                    headers={"content-type": "application/octet-stream",
                             "content-encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_an_encoding_a_route_does_not_take_is_415(client):
    body = gzip.compress(json.dumps({"name": "m", "num_classes": 3}).encode())
    r = client.post("/v1/models", content=body,
                    headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_problem(r, 415, "Content-Encoding", "gzip")
    r = client.post("/v1/models", json={"name": "m", "num_classes": 3},
                    headers={"content-encoding": "br"})
    assert_problem(r, 415, "br")
    assert client.get("/v1/models/m").status_code == 404  # nothing was created


def test_corrupt_and_truncated_compressed_bodies_are_400(served):
    body = gzip.compress(json.dumps({"logits": [[0.0] * K]}).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    for bad, word in ((body[:-6], "truncated"), (b"\x1f\x8b" + b"\x00" * 30, "corrupt"),
                      (body + body, "after its end")):
        r = served.post("/v1/models/m/predict", content=bad, headers=headers)
        assert_problem(r, 400, word)


def _bomb(n_bytes: int) -> bytes:
    """``n_bytes`` of zeros, gzip'd (about a thousandth of their size)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"0" * (1 << 20)
    parts = [packer.compress(chunk) for _ in range(n_bytes >> 20)]
    return b"".join([*parts, packer.flush()])


@pytest.mark.parametrize("route", ["v1-json", "v1-npy", "v2-json", "v2-binary"])
def test_a_compression_bomb_inflates_no_further_than_the_rows_can_need(served, route):
    """256 MiB of zeros in a 260 KB gzip body: refused once the decoded bytes pass what
    the model's K and the row limit can need, having inflated only that far (the
    tracemalloc peak of the whole request is far below the bomb)."""
    bomb = _bomb(256 << 20)
    assert len(bomb) < 300_000
    headers = {"content-encoding": "gzip"}
    if route == "v1-json":
        url, headers["content-type"] = "/v1/models/m/predict", "application/json"
    elif route == "v1-npy":
        url, headers["content-type"] = "/v1/models/m/predict", NPY
    elif route == "v2-json":
        url, headers["content-type"] = "/v2/models/m/infer", "application/json"
    else:
        url, headers["content-type"] = "/v2/models/m/infer", "application/octet-stream"
        headers[oip.HEADER_LENGTH] = "100"
    settings = served.app.state.welltempered.settings
    r, peak = traced_peak(served.post, url, content=bomb, headers=headers)
    assert r.status_code in (400, 413), r.text
    rows = settings.max_predict_rows
    # the largest body K = 4 and the row limit allow, as JSON (48 bytes a number, 64 a row)
    need = 64 * 1024 + rows * (K * 48 + 64)
    assert peak < 2 * need + (32 << 20), peak
    assert peak < (256 << 20) // 2


def test_v2_shape_of_2_62_rows_and_no_columns_is_a_422(served):
    head = json.dumps({"inputs": [{"name": "logits", "shape": [2**62, 0], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 0}}]}).encode()
    r = served.post("/v2/models/m/infer", content=head, headers={oip.HEADER_LENGTH: str(len(head))})
    assert r.status_code == 422, r.text
    assert f"{K} columns" in r.json()["error"]
    head = json.dumps({"inputs": [{"name": "logits", "shape": [2**62, K], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 0}}]}).encode()
    r = served.post("/v2/models/m/infer", content=head, headers={oip.HEADER_LENGTH: str(len(head))})
    assert r.status_code == 413 and "rows" in r.json()["error"], r.text


def test_answers_with_long_class_names_are_refused_before_the_work(tmp_path, database_url):
    """The names amplification: per row, top_k names of the longest name's size, counted
    before the calibration (names of 128 four-byte characters, the longest a name may
    be: the .npy answer would take 1,000 x 2 x 4 x 512 bytes)."""
    settings = make_settings(database_url, tmp_path, max_json_bytes=1 << 20)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        names = [f"{i}" + "\N{GRINNING FACE}" * 127 for i in range(K)]
        create_model(c, "m", K)
        assert c.patch("/v1/models/m", json={"class_names": names}).status_code == 200
        z, y = logits_data(200, K)
        r = c.post("/v1/models/m/datasets", content=npz(logits=z, labels=y),
                   headers={"content-type": "application/octet-stream"})
        promote(c, "m", r.json()["id"])
        z = np.zeros((1000, K), np.float16)  # an 8 KB body
        r = c.post("/v1/models/m/predict?top_k=2", content=npy(z),
                   headers={"content-type": NPY, "accept": NPY})
        problem = assert_problem(r, 413, "answer", "limit")
        assert problem["answer_bytes"] >= 1000 * 2 * 4 * 509
        r = c.post("/v1/models/m/predict?top_k=2", content=npy(z),
                   headers={"content-type": NPY})
        assert_problem(r, 422, "MAX_JSON_BYTES")  # the names as JSON: over 1 MiB
        head = json.dumps({
            "inputs": [{"name": "logits", "shape": [1000, K], "datatype": "FP16",
                        "parameters": {"binary_data_size": z.nbytes}}],
            "parameters": {"top_k": 2, "binary_data_output": True},
        }).encode()
        r = c.post("/v2/models/m/infer", content=head + z.tobytes(),
                   headers={oip.HEADER_LENGTH: str(len(head))})
        assert r.status_code == 413 and "answer" in r.json()["error"], r.text
        # a few rows of the same are answered, names and all
        r = c.post("/v1/models/m/predict?top_k=2", content=npy(z[:3]),
                   headers={"content-type": NPY, "accept": NPY})
        assert r.status_code == 200, r.text
        assert set(np.load(io.BytesIO(r.content))["name"].ravel()) <= set(names)


def test_a_route_without_a_body_refuses_one_before_its_handler_runs(served):
    """DELETE, GET and cancel declare no body: one sent to them (declared, chunked or
    encoded) is refused before the handler runs (the DELETE with a body used to delete)."""
    r = served.request("DELETE", "/v1/models/m", content=b"{}",
                       headers={"content-type": "application/json"})
    assert_problem(r, 413, "limit of 0 bytes")

    def chunks():
        yield b"{}"

    r = served.request("DELETE", "/v1/models/m", content=chunks())
    assert_problem(r, 413)
    r = served.request("DELETE", "/v1/models/m", content=gzip.compress(b"{}"),
                       headers={"content-encoding": "gzip"})
    assert r.status_code in (413, 415), r.text
    r = served.request("GET", "/v1/models/m", content=b"x" * 10)
    assert_problem(r, 413)
    assert served.get("/v1/models/m").status_code == 200  # still there
    r = served.request("DELETE", "/v1/models/m", headers={"content-length": "0"})
    assert r.status_code in (200, 409), r.text  # no body: the handler runs
