"""POST /v1/models/{model}/calibrators/{version}/fuse: a classifier's ONNX in, the fused
model out (service.api.routers.calibrators), bounded like any body."""

from __future__ import annotations

import gzip

import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper

from service.api.app import create_app
from tests.service.helpers import (
    assert_problem,
    create_model,
    logits_data,
    make_settings,
    promote,
    upload,
)

K, FEATURES = 4, 3
OCTET = {"content-type": "application/octet-stream"}
URL = "/v1/models/m/calibrators/1/fuse"
#: The route's body limit in these tests (WELLTEMPERED_MAX_MODEL_BYTES).
MODEL_LIMIT = 64 * 1024


def classifier(outputs: tuple[str, ...] = ("scores",), padding: int = 0) -> bytes:
    """A linear classifier's ONNX: features (N, 3) -> each output (N, K); ``padding``
    bytes of an unused initializer make it as large as a test needs."""
    weight = np.arange(FEATURES * K, dtype=np.float32).reshape(FEATURES, K) / 7.0
    initializers = [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel())]
    if padding:
        initializers.append(helper.make_tensor("pad", TensorProto.UINT8, [padding],
                                               np.zeros(padding, np.uint8).tobytes(), raw=True))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], [name]) for name in outputs], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", K]) for name in outputs],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.fixture
def client(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, max_model_bytes=MODEL_LIMIT)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create_model(c, "m", K)
        z, y = logits_data(300, K)
        promote(c, "m", upload(c, "m", z, y)["id"])
        yield c


def test_fused_model_answers_what_predict_answers(client):
    r = client.post(URL, content=classifier(), headers=OCTET)
    assert r.status_code == 200, r.text
    assert r.headers["content-disposition"] == 'attachment; filename="m-v1-fused.onnx"'
    session = ort.InferenceSession(r.content, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).normal(size=(6, FEATURES)).astype(np.float32)
    probabilities, label = session.run(["probabilities", "label"], {"x": x})
    scores = x @ (np.arange(FEATURES * K, dtype=np.float32).reshape(FEATURES, K) / 7.0)
    served = client.post("/v1/models/m/predict", json={"logits": scores.tolist()}).json()
    np.testing.assert_allclose(probabilities, served["probabilities"], rtol=0, atol=1e-6)
    assert label.tolist() == served["labels"]
    # gzip'd, like any body of a route that takes Content-Encoding
    r = client.post(URL, content=gzip.compress(classifier()),
                    headers={**OCTET, "content-encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_a_model_it_cannot_fuse_is_a_422_that_says_why(client):
    two = classifier(("a", "b"))
    assert_problem(client.post(URL, content=two, headers=OCTET), 422, "'a'", "'b'", "output")
    r = client.post(URL + "?output=b", content=two, headers=OCTET)
    assert r.status_code == 200, r.text
    assert_problem(client.post(URL + "?output=c", content=two, headers=OCTET), 422, "'c'")
    assert_problem(client.post(URL, content=b"\x08\xff\xff not onnx", headers=OCTET), 422,
                   "ONNX")
    assert_problem(client.post(URL + "?kind=odds", content=two, headers=OCTET), 422)


def test_the_body_is_bounded_by_max_model_bytes(client):
    budget = client.get("/openapi.json").json()["paths"][
        "/v1/models/{model}/calibrators/{version}/fuse"]["post"]["x-budget"]
    assert budget["body_bytes"] == budget["decoded_bytes"] == MODEL_LIMIT
    small = classifier(padding=MODEL_LIMIT - len(classifier()) - 64)
    assert len(small) <= MODEL_LIMIT
    assert client.post(URL, content=small, headers=OCTET).status_code == 200
    big = classifier(padding=MODEL_LIMIT)
    assert_problem(client.post(URL, content=big, headers=OCTET), 413)
    # decoded size counts too: a small gzip of a model over the limit
    assert_problem(client.post(URL, content=gzip.compress(big),
                               headers={**OCTET, "content-encoding": "gzip"}), 413)
    assert_problem(client.post(URL, content=classifier(),
                               headers={"content-type": "application/json"}), 415)
