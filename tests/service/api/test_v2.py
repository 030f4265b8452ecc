"""The Open Inference Protocol v2 (/v2): metadata, infer in JSON and binary, top_k, errors.

In process (both backends) for the routes, errors and auth; against a real
``welltempered serve`` with tritonclient.http for the wire format, including a
4,096 x 1,000 binary request. Every answer is compared with /v1 predict's.
"""

from __future__ import annotations

import doctest
import gzip
import io
import json
import time
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from service.api.app import create_app
from service.api.codecs import answers, oip
from service.api.routers import v2
from service.security import keys
from service.serving import inference
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_ALIAS
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    logits_data,
    make_settings,
    npy,
    npz,
    promote,
    upload,
)
from tests.service.servers import Server

HEADER = oip.HEADER_LENGTH
K = 4
NPY = "application/x-npy"


#: Names with spaces, accents, a CJK character and an emoji: UTF-8 of 1 to 4 bytes a glyph.
NAMES = ["tabby cat", "\u00e9l\u00e9phant", "\u72d7", "\U0001f426 bird"]


def serve_m(client: TestClient) -> TestClient:
    """Model ``m`` (K = 4) whose default alias points at version 1."""
    create_model(client, "m", K)
    z, y = logits_data(300, K)
    promote(client, "m", upload(client, "m", z, y)["id"])
    return client


@pytest.fixture(scope="module")
def served(module_client) -> TestClient:
    """One app of each backend for the module's inference tests, which only read it:
    model ``m`` (K = 4) and model ``n`` (K = 4, class_names :data:`NAMES`), each with
    its default alias at version 1."""
    serve_m(module_client)
    create_model(module_client, "n", K, class_names=NAMES)
    z, y = logits_data(300, K)
    promote(module_client, "n", upload(module_client, "n", z, y)["id"])
    return module_client


def rows(n: int = 5, k: int = K, seed: int = 7) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, k)) * 3).astype(np.float32)


def tensor(arr: np.ndarray, datatype: str = "FP32", **extra) -> dict:
    return {"name": "logits", "shape": list(arr.shape), "datatype": datatype, **extra}


def binary_request(
    arr: np.ndarray, datatype: str = "FP32", raw: bytes | None = None, **request
) -> tuple[bytes, dict]:
    """A body with the binary tensor data extension, and its header."""
    raw = arr.astype(oip.INPUT_DATATYPES[datatype]).tobytes() if raw is None else raw
    head = json.dumps(
        {"inputs": [tensor(arr, datatype, parameters={"binary_data_size": len(raw)})], **request}
    ).encode()
    return head + raw, {HEADER: str(len(head))}


def outputs(r) -> dict[str, np.ndarray]:
    """The outputs of an infer response, JSON or binary, as arrays of their shapes."""
    assert r.status_code == 200, r.text
    head = int(r.headers.get(HEADER, len(r.content)))
    body = json.loads(r.content[:head])
    out, offset = {}, head
    for t in body["outputs"]:
        if t["datatype"] == "BYTES":  # JSON strings, or per element uint32 length + UTF-8
            if "data" in t:
                arr = np.array(t["data"], object)
            else:
                end, arr = offset + t["parameters"]["binary_data_size"], []
                while offset < end:
                    size = int.from_bytes(r.content[offset : offset + 4], "little")
                    arr.append(r.content[offset + 4 : offset + 4 + size].decode())
                    offset += 4 + size
                assert offset == end
                arr = np.array(arr, object)
            out[t["name"]] = arr.reshape(t["shape"])
            continue
        dtype = np.dtype("<i8") if t["datatype"] == "INT64" else np.dtype("<f4")
        if "data" in t:
            arr = np.asarray(t["data"], dtype=dtype)
        else:
            size = t["parameters"]["binary_data_size"]
            arr = np.frombuffer(r.content, dtype, size // dtype.itemsize, offset)
            offset += size
        out[t["name"]] = arr.reshape(t["shape"])
    assert offset == len(r.content)
    return out


def v1(client, scores: np.ndarray, query: str = "", model: str = "m") -> dict[str, np.ndarray]:
    r = client.post(
        f"/v1/models/{model}/predict{query}",
        content=npy(scores),
        headers={"content-type": "application/x-npy"},
    )
    assert r.status_code == 200, r.text
    got = r.json()
    return {
        "probabilities": np.asarray(got["probabilities"], np.float32),
        "label": np.asarray(got["labels"]),
        "confidence": np.asarray(got["confidence"], np.float32),
        "entropy": np.asarray(got["entropy"], np.float32),
    }


def assert_same(got: dict, want: dict, tol: float = 1e-6) -> None:
    for name, arr in want.items():
        assert got[name].shape == arr.shape, name
        if name == "label":
            assert (got[name] == arr).all()
        else:
            np.testing.assert_allclose(got[name], arr, rtol=0, atol=tol, err_msg=name)


def assert_error(r, status: int, *words: str) -> str:
    """The protocol's error shape: {"error": message}, application/json."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    for word in words:
        assert word.lower() in body["error"].lower(), body["error"]
    return body["error"]


# -- health and metadata --------------------------------------------------------


def test_health_and_server_metadata(client):
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    meta = client.get("/v2").json()
    assert meta == {
        "name": "welltempered",
        "version": client.app.version,
        "extensions": ["binary_tensor_data"],
    }


def test_server_not_ready_is_a_503_error(client, monkeypatch):
    from sqlalchemy.exc import OperationalError

    from service.storage import migrate

    def unreachable(engine):
        raise OperationalError("SELECT version_num FROM alembic_version", {}, "host db.internal")

    monkeypatch.setattr(migrate, "current_revision", unreachable)
    message = assert_error(client.get("/v2/health/ready"), 503, "unreachable")
    assert "db.internal" not in message


def test_model_metadata_lists_servable_versions(client, settings):
    served = serve_m(client)  # its own: the test fails version 2
    meta = served.get("/v2/models/m").json()
    assert meta == {
        "name": "m",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, K]}],
        "outputs": [
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, K]},
            {"name": "confidence", "datatype": "FP32", "shape": [-1]},
            {"name": "label", "datatype": "INT64", "shape": [-1]},
            {"name": "entropy", "datatype": "FP32", "shape": [-1]},
        ],
    }
    assert served.get("/v2/models/m/versions/1").json() == meta
    with_top_k = served.get("/v2/models/m?top_k=2").json()["outputs"]
    assert with_top_k[4:] == [
        {"name": "top_k_indices", "datatype": "INT64", "shape": [-1, 2]},
        {"name": "top_k_probabilities", "datatype": "FP32", "shape": [-1, 2]},
    ]
    assert_error(served.get(f"/v2/models/m?top_k={K + 1}"), 422, "top_k")
    assert served.get("/v2/models/m/ready").json() == {"name": "m", "ready": True}
    assert served.get("/v2/models/m/versions/1/ready").json() == {"name": "m", "ready": True}
    # A failed version: not listed, not ready (409), not served
    for path in (settings.data_dir / "arrays").rglob("*.npy"):
        path.unlink()
    failed = fit(served, "m", 1)
    assert failed["status"] == "failed" and failed["version"] == 2
    assert served.get("/v2/models/m").json()["versions"] == ["1"]
    assert_error(served.get("/v2/models/m/versions/2"), 409, "failed")
    assert_error(served.get("/v2/models/m/versions/2/ready"), 409, "failed")
    body = {"inputs": [tensor(rows(1), data=rows(1).ravel().tolist())]}
    assert_error(served.post("/v2/models/m/versions/2/infer", json=body), 409, "failed")
    for path in (
        "/v2/models/nope",
        "/v2/models/nope/ready",
        "/v2/models/m/versions/3",
        "/v2/models/m/versions/abc/ready",
        "/v2/models/m/versions/01",
    ):
        assert_error(served.get(path), 404)


def test_a_model_without_the_default_alias_is_not_ready(client):
    create_model(client, "m", K)
    message = assert_error(client.get("/v2/models/m/ready"), 404, DEFAULT_ALIAS)
    assert "PUT" in message


# -- infer ------------------------------------------------------------------------


def test_model_config_is_a_triton_model_config(served):
    """/v2/models/{m}/config: Triton's model configuration extension, the JSON of a
    ModelConfig (parsed by Triton's own protobuf), describing what infer takes and gives."""
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import json_format

    for path in ("/v2/models/m/config", "/v2/models/m/versions/1/config"):
        r = served.get(path)
        assert r.status_code == 200, r.text
        config = json_format.ParseDict(r.json(), model_config_pb2.ModelConfig())
        assert (config.name, config.max_batch_size) == ("m", 0)
        assert [(t.name, list(t.dims)) for t in config.input] == [(oip.INPUT, [-1, K])]
        outputs = {t.name: model_config_pb2.DataType.Name(t.data_type) for t in config.output}
        metadata = {t["name"]: t["datatype"] for t in served.get("/v2/models/m").json()["outputs"]}
        assert outputs == {name: f"TYPE_{datatype}" for name, datatype in metadata.items()}
    named = served.get("/v2/models/n/config").json()
    assert named["output"][-1] == {"name": "label_name", "data_type": "TYPE_STRING",
                                   "dims": [-1]}
    assert_error(served.get("/v2/models/nope/config"), 404, "nope")
    assert_error(served.get("/v2/models/m/versions/9/config"), 404)


@pytest.mark.parametrize("kind", ["logits", "probabilities"])
def test_infer_json_equals_v1(served, kind):
    z = rows(6)
    scores = softmax(z.astype(np.float64)) if kind == "probabilities" else z
    body = {
        "id": "r-1",
        "parameters": {"kind": kind},
        "inputs": [tensor(scores, "FP64", data=scores.ravel().tolist())],
    }
    r = served.post("/v2/models/m/infer", json=body)
    head = r.json()
    assert head["model_name"] == "m" and head["model_version"] == "1" and head["id"] == "r-1"
    assert [t["name"] for t in head["outputs"]] == list(oip.DEFAULT_OUTPUTS)
    assert r.headers["x-welltempered-version"] == "1" and HEADER not in r.headers
    assert_same(outputs(r), v1(served, scores, f"?kind={kind}"))
    # nested data, the versioned path and named outputs
    body = {
        "inputs": [tensor(z, data=z.tolist())],
        "outputs": [{"name": "label"}, {"name": "probabilities"}],
    }
    got = outputs(served.post("/v2/models/m/versions/1/infer", json=body))
    assert list(got) == ["label", "probabilities"]
    assert_same(got, {k: v for k, v in v1(served, z).items() if k in got})


@pytest.mark.parametrize("datatype", list(oip.INPUT_DATATYPES))
def test_infer_binary_inputs_and_outputs(served, datatype):
    z = rows(9)
    if datatype == "BF16":  # the top half of each float32: what the server widens back
        raw = (z.view(np.uint32) >> 16).astype("<u2").tobytes()
        same = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        same = same.reshape(z.shape)
    else:
        raw = None
        same = z.astype(oip.INPUT_DATATYPES[datatype])
    body, headers = binary_request(z, datatype, raw, parameters={"binary_data_output": True})
    r = served.post("/v2/models/m/infer", content=body, headers=headers)
    assert r.headers["content-type"] == "application/octet-stream"
    head = json.loads(r.content[: int(r.headers[HEADER])])
    assert all("data" not in t for t in head["outputs"])
    assert_same(outputs(r), v1(served, same))
    # binary in, JSON and binary out (the output's own binary_data wins)
    body, headers = binary_request(
        z,
        datatype,
        raw,
        parameters={"binary_data_output": True},
        outputs=[
            {"name": "probabilities", "parameters": {"binary_data": False}},
            {"name": "entropy"},
        ],
    )
    r = served.post("/v2/models/m/infer", content=body, headers=headers)
    kinds = {
        t["name"]: "data" in t for t in json.loads(r.content[: int(r.headers[HEADER])])["outputs"]
    }
    assert kinds == {"probabilities": True, "entropy": False}
    want = v1(served, same)
    assert_same(outputs(r), {k: want[k] for k in kinds})


def test_infer_accepts_compressed_bodies(served):
    z = rows(3)
    body, headers = binary_request(z)
    want = v1(served, z)
    for encoding, pack in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        r = served.post(
            "/v2/models/m/infer",
            content=pack(body),
            headers={**headers, "content-encoding": encoding},
        )
        assert_same(outputs(r), want)
    bad = {**headers, "content-encoding": "gzip"}
    assert_error(served.post("/v2/models/m/infer", content=body, headers=bad), 400, "gzip")
    truncated = gzip.compress(body)[:-12]
    assert_error(served.post("/v2/models/m/infer", content=truncated, headers=bad), 400)
    br = {**headers, "content-encoding": "br"}
    assert_error(served.post("/v2/models/m/infer", content=body, headers=br), 415, "br")


def test_infer_metrics_count_the_rows(served):
    before = served.get("/metrics").text
    body, headers = binary_request(rows(7))
    assert served.post("/v2/models/m/infer", content=body, headers=headers).status_code == 200
    after = served.get("/metrics").text
    assert 'route="/v2/models/{name}/infer"' in after
    assert after != before


# -- top_k ------------------------------------------------------------------------


def oracle_top_k(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    index = np.argsort(-p, axis=1, kind="stable")[:, :k]
    return index, np.take_along_axis(p, index, axis=1)


def test_top_k_on_v1_json_and_npy(served):
    z = rows(8)
    full = v1(served, z)
    index, value = oracle_top_k(full["probabilities"], 3)
    r = served.post("/v1/models/m/predict?top_k=3", json={"logits": z.tolist()})
    got = r.json()
    assert list(got) == [
        "top_k_indices",
        "top_k_probabilities",
        "labels",
        "confidence",
        "entropy",
        "model",
        "version",
    ]
    assert (np.asarray(got["top_k_indices"]) == index).all()
    np.testing.assert_array_equal(np.asarray(got["top_k_probabilities"], np.float32), value)
    assert (np.asarray(got["top_k_indices"])[:, 0] == full["label"]).all()
    r = served.post(
        "/v1/models/m/predict?top_k=3",
        content=npy(z),
        headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
    )
    rec = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert rec.shape == (8, 3) and rec.dtype.names == ("index", "probability")
    assert (rec["index"] == index).all() and (rec["probability"] == value).all()
    assert_problem(
        served.post(f"/v1/models/m/predict?top_k={K + 1}", json={"logits": z.tolist()}),
        422,
        "top_k",
    )
    r = served.post("/v1/models/m/predict?top_k=0", json={"logits": z.tolist()})
    assert_problem(r, 422)


def test_top_k_on_v2(served):
    z = rows(8)
    index, value = oracle_top_k(v1(served, z)["probabilities"], 2)
    body, headers = binary_request(z, parameters={"top_k": 2})
    got = outputs(served.post("/v2/models/m/infer", content=body, headers=headers))
    assert list(got) == list(oip.TOP_K_DEFAULT_OUTPUTS)  # not the whole row
    assert (got["top_k_indices"] == index).all()
    assert (got["top_k_probabilities"] == value).all()
    body, headers = binary_request(z, parameters={"top_k": K + 1})
    assert_error(served.post("/v2/models/m/infer", content=body, headers=headers), 422, "top_k")


# -- class names -------------------------------------------------------------------

@pytest.fixture
def named(served) -> TestClient:
    """``served``, which has model ``n`` (class_names :data:`NAMES`) beside ``m``."""
    return served


def test_class_names_in_v2_metadata(named):
    """label_name (and with top_k, top_k_names) are listed as BYTES outputs of a model
    with class_names only."""
    outputs_of = {m: [t["name"] for t in named.get(f"/v2/models/{m}").json()["outputs"]]
                  for m in ("m", "n")}  # fmt: skip
    assert outputs_of["m"] == list(oip.DEFAULT_OUTPUTS)
    assert outputs_of["n"] == [*oip.DEFAULT_OUTPUTS, "label_name"]
    meta = named.get("/v2/models/n/versions/1?top_k=2").json()["outputs"]
    assert {"name": "label_name", "datatype": "BYTES", "shape": [-1]} in meta
    assert meta[-1] == {"name": "top_k_names", "datatype": "BYTES", "shape": [-1, 2]}
    assert "top_k_names" not in str(named.get("/v2/models/m?top_k=2").json())


@pytest.mark.parametrize("binary", [False, True])
def test_class_names_in_v2_infer(named, binary):
    """label_name is answered by default, as JSON strings or the protocol's binary BYTES,
    and equals /v1's label_names; top_k_names are the names of top_k_indices."""
    names = np.array(NAMES, object)
    z = rows(7)
    want = named.post("/v1/models/n/predict", json={"logits": z.tolist()}).json()
    if binary:
        body, headers = binary_request(z, parameters={"binary_data_output": True})
        r = named.post("/v2/models/n/infer", content=body, headers=headers)
        assert r.headers["content-type"] == "application/octet-stream"
    else:
        r = named.post("/v2/models/n/infer", json={"inputs": [tensor(z, data=z.tolist())]})
        assert r.headers["content-type"] == "application/json"
    got = outputs(r)
    assert list(got) == [*oip.DEFAULT_OUTPUTS, "label_name"]
    assert got["label_name"].tolist() == want["label_names"] == names[got["label"]].tolist()
    body, headers = binary_request(z, parameters={"top_k": 3, "binary_data_output": binary})
    got = outputs(named.post("/v2/models/n/infer", content=body, headers=headers))
    assert list(got) == [*oip.TOP_K_DEFAULT_OUTPUTS, "label_name", "top_k_names"]
    assert got["top_k_names"].shape == (7, 3)
    assert (got["top_k_names"] == names[got["top_k_indices"]]).all()
    # asked by name, alone, and mixed: binary for one output only
    wanted = [{"name": "label_name", "parameters": {"binary_data": True}}, {"name": "label"}]
    body, headers = binary_request(z, outputs=wanted)
    r = named.post("/v2/models/n/infer", content=body, headers=headers)
    got = outputs(r)
    assert list(got) == ["label_name", "label"] and (got["label_name"] == names[got["label"]]).all()


def test_class_name_outputs_are_refused_without_names_or_top_k(named):
    z = rows(2)
    for model, output, params, words in (
        ("m", "label_name", {}, ("label_name", "class_names")),
        ("m", "top_k_names", {"top_k": 2}, ("top_k_names", "class_names")),
        ("n", "top_k_names", {}, ("top_k_names", "top_k")),
    ):
        body = {"parameters": params, "inputs": [tensor(z, data=z.tolist())],
                "outputs": [{"name": output}]}  # fmt: skip
        assert_error(named.post(f"/v2/models/{model}/infer", json=body), 422, *words)
    # the model without names answers exactly what it did before
    got = outputs(named.post("/v2/models/m/infer", json={"inputs": [tensor(z, data=z.tolist())]}))
    assert list(got) == list(oip.DEFAULT_OUTPUTS)


def test_class_names_in_the_top_k_npy(named):
    """A top_k .npy of a model with class_names has a third field, name (fixed-width
    unicode, loadable without pickle); the whole-row .npy stays the probabilities."""
    z = rows(5)
    npy_headers = {"content-type": "application/x-npy", "accept": "application/x-npy"}
    r = named.post("/v1/models/n/predict?top_k=2", content=npy(z), headers=npy_headers)
    rec = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert rec.dtype.names == ("index", "probability", "name") and rec.shape == (5, 2)
    assert rec.dtype["name"].kind == "U"
    assert rec["name"].tolist() == np.array(NAMES, object)[rec["index"]].tolist()
    want = named.post("/v1/models/n/predict?top_k=2", json={"logits": z.tolist()}).json()
    assert rec["name"].tolist() == want["top_k_names"]
    assert (rec["index"] == np.asarray(want["top_k_indices"])).all()
    r = named.post("/v1/models/m/predict?top_k=2", content=npy(z), headers=npy_headers)
    assert np.load(io.BytesIO(r.content)).dtype.names == ("index", "probability")
    r = named.post("/v1/models/n/predict", content=npy(z), headers=npy_headers)
    whole = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert whole.dtype == np.float32 and whole.shape == (5, K)


def test_top_k_of_a_wide_vocabulary_breaks_ties_in_class_order():
    p = np.full((3, 262_144), 1e-7, np.float32)
    p[0, [5, 70_000, 200_000]] = [0.2, 0.3, 0.2]
    p[1, 9] = 0.5
    p[2, :] = 0.0
    out = inference.top_k(p, 4)
    assert out["top_k_indices"].tolist() == [[70_000, 5, 200_000, 0], [9, 0, 1, 2], [0, 1, 2, 3]]
    assert out["top_k_indices"].dtype == np.int64
    assert out["top_k_probabilities"].dtype == np.float32
    rng = np.random.default_rng(0)
    for _ in range(50):  # many ties, against a stable sort
        q = rng.integers(0, 4, size=(4, 9)).astype(np.float32)
        k = int(rng.integers(1, 10))
        index, value = oracle_top_k(q, k)
        got = inference.top_k(q, k)
        assert (got["top_k_indices"] == index).all() and (got["top_k_probabilities"] == value).all()


def test_inference_docstrings():
    assert doctest.testmod(inference).failed == 0
    result = doctest.testmod(oip)  # bytes_tensor: the protocol's binary BYTES
    assert result.attempted > 0 and result.failed == 0


# -- errors -------------------------------------------------------------------------


def _json(**tensor_fields) -> dict:
    z = rows(2)
    return {"inputs": [{**tensor(z, data=z.ravel().tolist()), **tensor_fields}]}


ERRORS = [
    # (body or (bytes, headers), status, words in the message)
    ({"inputs": []}, 422, "one tensor"),
    ({"inputs": [{}, {}]}, 422, "one tensor"),
    ({"input": []}, 422, "unknown field"),
    ({"inputs": [3]}, 422, "object"),
    (_json(name="probabilities"), 422, "logits"),
    (_json(shape=[8]), 422, "shape"),
    (_json(shape=[2, -4]), 422, "shape"),
    (_json(shape=[1, 8]), 422, f"{K} columns"),
    (_json(datatype="INT32"), 422, "FP32"),
    (_json(data=[1, 2, 3]), 422, "8 numbers"),
    (_json(data=[[1, 2], [3]]), 422, "list of numbers"),
    (_json(data=["a"] * 8), 422, "numeric"),
    (_json(parameters={"shared_memory_region": "x"}), 422, "shared memory"),
    (_json(parameters={"binary_data_size": 32}), 422, HEADER),
    ({**_json(), "parameters": {"kind": "odds"}}, 422, "kind"),
    ({**_json(), "parameters": {"top_k": "3"}}, 422, "top_k"),
    ({**_json(), "parameters": {"top_k": True}}, 422, "top_k"),
    ({**_json(), "parameters": {"binary_data_output": 1}}, 422, "binary_data_output"),
    ({**_json(), "parameters": []}, 422, "object"),
    ({**_json(), "id": 3}, 422, "id"),
    ({**_json(), "outputs": [{"name": "logits"}]}, 422, "unknown output"),
    ({**_json(), "outputs": [{"name": "top_k_indices"}]}, 422, "top_k"),
    ({**_json(), "outputs": [{"name": "label"}, {"name": "label"}]}, 422, "twice"),
    (
        {**_json(), "outputs": [{"name": "label", "parameters": {"classification": 2}}]},
        422,
        "classification",
    ),
    ({**_json(), "outputs": "label"}, 422, "list"),
    ({**_json(), "parameters": {"kind": "probabilities"}}, 422, "probabilities"),
    ((b"{", {}), 400, "json"),
    ((b"[1]", {}), 422, "object"),
    ((b'{"inputs": []}', {HEADER: "99"}), 400, HEADER),
    ((b'{"inputs": []}', {HEADER: "x"}), 400, HEADER),
    (binary_request(rows(2), raw=rows(2).tobytes()[:-4]), 422, "binary_data_size"),
    ((binary_request(rows(2))[0] + b"\0\0\0\0", binary_request(rows(2))[1]), 400, "body holds"),
    (binary_request(rows(2), raw=np.full(8, np.nan, "<f4").tobytes()), 422, "finite"),
    (
        (json.dumps(_json()).encode() + b"\0" * 4, {HEADER: str(len(json.dumps(_json())))}),
        400,
        "no input",
    ),
]


@pytest.mark.parametrize("body,status,words", ERRORS)
def test_infer_errors_have_the_protocol_shape(served, body, status, words):
    if isinstance(body, tuple):
        r = served.post("/v2/models/m/infer", content=body[0], headers=body[1])
    else:
        r = served.post("/v2/models/m/infer", json=body)
    assert_error(r, status, words)


def test_infer_limits(served):
    many = rows(served.app.state.welltempered.settings.max_predict_rows + 1)
    body, headers = binary_request(many)
    assert_error(served.post("/v2/models/m/infer", content=body, headers=headers), 413, "rows")
    assert_error(served.post("/v2/models/nope/infer", json=_json()), 404, "nope")
    assert_error(served.post("/v2/models/m/versions/7/infer", json=_json()), 404, "7")
    assert_error(served.get("/v2/models/m/infer"), 405)
    assert_error(served.get("/v2/nothing"), 404)


def test_infer_body_limits(tmp_path, database_url):
    settings = make_settings(database_url, tmp_path, max_json_bytes=2000, max_body_bytes=5000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create_model(c, "m", K)
        z, y = logits_data(60, K)
        r = c.post(
            "/v1/models/m/datasets",
            content=npz(logits=z.astype(np.float32), labels=y),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        promote(c, "m", r.json()["id"])
        small = rows(30)  # 480 bytes in binary, about 2,500 as JSON
        body, headers = binary_request(small, parameters={"binary_data_output": True})
        assert c.post("/v2/models/m/infer", content=body, headers=headers).status_code == 200
        r = c.post("/v2/models/m/infer", json=_json(data=small.ravel().tolist(), shape=[30, K]))
        assert_error(r, 413, "2000 bytes")
        body, headers = binary_request(rows(400))  # 6,400 bytes
        assert_error(c.post("/v2/models/m/infer", content=body, headers=headers), 413, "5000")
        body, headers = binary_request(np.zeros((1000, K), np.float32))
        r = c.post(
            "/v2/models/m/infer",
            content=gzip.compress(body),
            headers={**headers, "content-encoding": "gzip"},
        )
        assert_error(r, 413, "decoded")


def test_a_json_answer_of_whole_rows_is_bounded_like_v1(tmp_path, database_url, monkeypatch):
    """/v1's rule (service.api.answers: every value of the answer's JSON data counted, 16
    bytes a float32, 21 an int64, at most MAX_JSON_BYTES), checked before the
    calibration; the fix names top_k and the binary tensor data extension."""
    settings = make_settings(database_url, tmp_path, max_json_bytes=2000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create_model(c, "m", K)
        z, y = logits_data(60, K)
        r = c.post("/v1/models/m/datasets", content=npz(logits=z, labels=y),
                   headers={"content-type": "application/octet-stream"})
        promote(c, "m", r.json()["id"])
        calibrated = []
        real = v2.calibrate
        monkeypatch.setattr(
            v2, "calibrate", lambda *a, **kw: calibrated.append(1) or real(*a, **kw)
        )
        # a row: 4 probabilities, a confidence and an entropy (16 bytes each), a label (21)
        z = rows(18)  # 18 x 117 = 2,106 bytes of JSON: over 2,000
        body, headers = binary_request(z)
        error = assert_error(c.post("/v2/models/m/infer", content=body, headers=headers), 422,
                             "MAX_JSON_BYTES", "top_k", "binary_data_output")
        assert "2,106 bytes" in error and "x-npy" not in error
        r = c.post("/v1/models/m/predict", content=npy(z), headers={"content-type": NPY})
        assert_problem(r, 422, "MAX_JSON_BYTES", "2,106 bytes", "x-npy")  # the same rule on /v1
        assert not calibrated  # refused before the work
        want = v1(c, z[:17])  # 17 rows (1,989 bytes) are answered as JSON
        body, headers = binary_request(z[:17])
        assert_same(outputs(c.post("/v2/models/m/infer", content=body, headers=headers)), want)
        # the same 18 rows: binary probabilities, top_k, or outputs without whole rows
        for request in (
            {"parameters": {"binary_data_output": True}},
            {"outputs": [{"name": "probabilities", "parameters": {"binary_data": True}},
                         {"name": "label"}]},
            {"parameters": {"top_k": 1}},  # 18 x (53 + 1 index + 1 probability): 1,620 bytes
            {"outputs": [{"name": "label"}, {"name": "confidence"}, {"name": "entropy"}]},
        ):
            body, headers = binary_request(z, **request)
            r = c.post("/v2/models/m/infer", content=body, headers=headers)
            assert r.status_code == 200, (request, r.text)
        got = outputs(r)
        # top_k = K is whole rows again, as indices and probabilities: no way around it
        body, headers = binary_request(z, parameters={"top_k": K})
        assert_error(c.post("/v2/models/m/infer", content=body, headers=headers), 422,
                     "MAX_JSON_BYTES", "3,618 bytes")
        r = c.post(f"/v1/models/m/predict?top_k={K}", content=npy(z),
                   headers={"content-type": NPY})
        assert_problem(r, 422, "MAX_JSON_BYTES", "smaller ?top_k")
        r = c.post(f"/v1/models/m/predict?top_k={K}", content=npy(z),
                   headers={"content-type": NPY, "accept": NPY})  # as .npy: answered
        assert r.status_code == 200, r.text
        assert (got["label"] == np.load(io.BytesIO(c.post(
            "/v1/models/m/predict", content=npy(z),
            headers={"content-type": NPY, "accept": NPY}).content)).argmax(axis=1)).all()


@pytest.mark.parametrize("names", [False, True])
def test_a_large_binary_answer_is_streamed_from_views_of_the_outputs(named, monkeypatch, names):
    """Over answers.STREAM_ANSWER_BYTES the binary answer is the JSON header, then views of
    each output's bytes (no copy of them in one buffer): the same bytes as the one-buffer
    answer of a small one, with its Content-Length."""
    model = "n" if names else "m"
    z = rows(300)
    body, headers = binary_request(z, parameters={"binary_data_output": True, "top_k": 3},
                                   outputs=[{"name": n} for n in (
                                       "probabilities", "label", "top_k_indices",
                                       *(("label_name", "top_k_names") if names else ()))])
    whole = named.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert whole.status_code == 200, whole.text
    monkeypatch.setattr(answers, "STREAM_ANSWER_BYTES", 1000)
    chunks = []
    real = oip.npy.byte_chunks

    def spy(head, arrays):
        size, parts = real(head, arrays)
        chunks.append([a.nbytes for a in arrays])
        return size, parts

    monkeypatch.setattr(oip.npy, "byte_chunks", spy)
    streamed = named.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert streamed.status_code == 200, streamed.text
    assert chunks, "the answer was not streamed"
    assert streamed.content == whole.content
    assert int(streamed.headers["content-length"]) == len(streamed.content)
    assert streamed.headers[HEADER] == whole.headers[HEADER]
    assert streamed.headers["content-type"] == "application/octet-stream"
    got = outputs(streamed)
    assert_same({k: got[k] for k in ("probabilities", "label")},
                {k: v for k, v in v1(named, z, model=model).items()
                 if k in ("probabilities", "label")})


# -- auth -------------------------------------------------------------------------------


def test_auth_as_on_v1(database_url, tmp_path):
    engine = make_engine(database_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    settings = make_settings(database_url, tmp_path, auth="on", key_cache_seconds=0.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        with sessions() as s:
            write = keys.create_key(s, "team-a", "write")[1]
            predict = keys.create_key(s, "team-a", "predict")[1]
            other = keys.create_key(s, "team-b", "predict")[1]
        engine.dispose()
        c.headers["Authorization"] = f"Bearer {write}"
        create_model(c, "m", K)
        z, y = logits_data(300, K)
        v = fit(c, "m", upload(c, "m", z, y)["id"])
        c.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
        del c.headers["Authorization"]
        assert c.get("/v2/health/live").status_code == 200  # open, like /healthz
        assert c.get("/v2/health/ready").status_code == 200
        body, headers = binary_request(rows(2))
        for method, path in (
            ("GET", "/v2"),
            ("GET", "/v2/models/m"),
            ("GET", "/v2/models/m/ready"),
            ("POST", "/v2/models/m/infer"),
        ):
            sent = body if method == "POST" else None  # a GET takes no body (a 413)
            r = c.request(method, path, content=sent, headers=headers)
            assert_error(r, 401, "API key")
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = c.request(
                method, path, content=sent, headers={**headers, "Authorization": "Bearer wt_nope"}
            )
            assert_error(r, 401, "unknown")
            ok = c.request(
                method,
                path,
                content=sent,
                headers={**headers, "Authorization": f"Bearer {predict}"},
            )
            assert ok.status_code == 200, ok.text
            r = c.request(
                method, path, content=sent, headers={**headers, "Authorization": f"Bearer {other}"}
            )
            if path == "/v2":
                assert r.status_code == 200
            else:  # another namespace's model is missing
                assert_error(r, 404, "no model")


def test_openapi_documents_the_protocol(client):
    doc = client.get("/openapi.json").json()
    infer = doc["paths"]["/v2/models/{name}/versions/{version}/infer"]["post"]
    assert infer["security"] == [{"bearer": []}] and "`predict`" in infer["description"]
    assert {p["name"] for p in infer["parameters"]} == {"name", "version", HEADER}
    error = infer["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/InferenceError"}
    assert "security" not in doc["paths"]["/v2/health/live"]["get"]
    assert doc["paths"]["/v2/models/{name}"]["get"]["security"] == [{"bearer": []}]


# -- a real server and tritonclient ---------------------------------------------------------


BIG_NAMES = [f"class {i:03d}" if i % 7 else f"cat\u00e9gorie {i} \u72d7" for i in range(1000)]


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory):
    """``welltempered serve`` (SQLite, auth on) with model ``big`` (K = 1,000, class names
    :data:`BIG_NAMES`) served."""
    tmp = tmp_path_factory.mktemp("v2-server")
    url = f"sqlite:///{tmp / 'registry.sqlite3'}"
    with Server(url, tmp / "data", AUTH="on") as server:
        engine = make_engine(url)
        with sessionmaker(engine)() as s:
            write = keys.create_key(s, "ns", "write")[1]
            server.key = keys.create_key(s, "ns", "predict")[1]
        engine.dispose()
        with server.client(headers={"Authorization": f"Bearer {write}"}) as c:
            model = {"name": "big", "num_classes": 1000, "class_names": BIG_NAMES}
            assert c.post("/v1/models", json=model).is_success
            z, y = logits_data(2000, 1000, seed=3)
            r = c.post(
                "/v1/models/big/datasets",
                content=npz(logits=z.astype(np.float32), labels=y),
                headers={"content-type": "application/octet-stream"},
            )
            assert r.status_code == 201, r.text
            r = c.post("/v1/models/big/calibrators", json={"dataset_id": r.json()["id"]})
            version = r.json()["version"]
            for _ in range(1200):
                status = c.get(f"/v1/models/big/calibrators/{version}").json()["status"]
                if status not in ("queued", "running"):
                    break
                time.sleep(0.1)
            assert status == "succeeded", status
            r = c.put(f"/v1/models/big/aliases/{DEFAULT_ALIAS}", json={"version": version})
            assert r.status_code == 200, r.text
        yield server


@pytest.mark.process
def test_tritonclient_json_and_binary_4096_x_1000(triton_server):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def auth() -> dict[str, str]:  # a new dict per call: tritonclient adds its headers to it
        return {"Authorization": f"Bearer {triton_server.key}"}

    client = httpclient.InferenceServerClient(
        triton_server.base.removeprefix("http://"),
        network_timeout=120.0,
        connection_timeout=60.0,
    )
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata(headers=auth())["extensions"] == ["binary_tensor_data"]
        assert client.is_model_ready("big", headers=auth())
        meta = client.get_model_metadata("big", headers=auth())
        assert meta["inputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}]
        config = client.get_model_config("big", headers=auth())
        assert config["input"] == [{"name": "logits", "data_type": "TYPE_FP32",
                                    "dims": [-1, 1000]}]
        assert client.get_model_config("big", "1", headers=auth()) == config

        z = (np.random.default_rng(11).normal(size=(4096, 1000)) * 4).astype(np.float32)
        with triton_server.client(headers=auth()) as c:
            r = c.post(
                "/v1/models/big/predict",
                content=npy(z),
                headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
            )
            assert r.status_code == 200, r.text
            want_p = np.load(io.BytesIO(r.content))
            r = c.post("/v1/models/big/predict", json={"logits": z[:16].tolist()})
            small = r.json()

        # binary in and out, every output
        x = httpclient.InferInput("logits", list(z.shape), "FP32")
        x.set_data_from_numpy(z, binary_data=True)
        result = client.infer("big", [x], headers=auth())
        probabilities = result.as_numpy("probabilities")
        assert probabilities.shape == (4096, 1000) and probabilities.dtype == np.float32
        assert np.abs(probabilities - want_p).max() <= 1e-6
        assert (result.as_numpy("label") == want_p.argmax(axis=1)).all()
        assert result.get_response()["model_version"] == "1"
        names = np.array(BIG_NAMES, object)
        label_name = result.as_numpy("label_name")  # BYTES: tritonclient answers bytes
        assert label_name.shape == (4096,)
        assert [b.decode() for b in label_name] == names[want_p.argmax(axis=1)].tolist()
        # over answers.STREAM_ANSWER_BYTES (16 MiB), streamed from views of the outputs
        more = np.concatenate([z, z[:1000]])  # 5,096 x 1,000: 20 MB of probabilities
        x = httpclient.InferInput("logits", list(more.shape), "FP32")
        x.set_data_from_numpy(more, binary_data=True)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=True)
                  for n in ("probabilities", "label")]
        result = client.infer("big", [x], outputs=wanted, headers=auth())
        streamed = result.as_numpy("probabilities")
        assert streamed.nbytes > answers.STREAM_ANSWER_BYTES
        assert (streamed[:4096] == probabilities).all()
        assert (streamed[4096:] == probabilities[:1000]).all()
        assert (result.as_numpy("label")[4096:] == want_p[:1000].argmax(axis=1)).all()

        # JSON in and out, the versioned path
        x = httpclient.InferInput("logits", [16, 1000], "FP32")
        x.set_data_from_numpy(z[:16], binary_data=False)
        wanted = [
            httpclient.InferRequestedOutput(n, binary_data=False)
            for n in ("probabilities", "label", "confidence", "entropy", "label_name")
        ]
        result = client.infer("big", [x], model_version="1", outputs=wanted, headers=auth())
        assert (
            np.abs(result.as_numpy("probabilities") - np.asarray(small["probabilities"])).max()
            <= 1e-6
        )
        assert (result.as_numpy("label") == np.asarray(small["labels"])).all()
        for name in ("confidence", "entropy"):
            assert np.abs(result.as_numpy(name) - np.asarray(small[name])).max() <= 1e-6
        assert result.as_numpy("label_name").tolist() == small["label_names"]

        # top_k: only the k largest come back
        x = httpclient.InferInput("logits", list(z.shape), "FP32")
        x.set_data_from_numpy(z, binary_data=True)
        wanted = [
            httpclient.InferRequestedOutput(n, binary_data=True)
            for n in (*inference.TOP_K_OUTPUTS, "top_k_names")
        ]
        result = client.infer("big", [x], outputs=wanted, parameters={"top_k": 5}, headers=auth())
        index, value = oracle_top_k(want_p, 5)
        assert (result.as_numpy("top_k_indices") == index).all()
        assert np.abs(result.as_numpy("top_k_probabilities") - value).max() <= 1e-6
        top_names = result.as_numpy("top_k_names")
        assert top_names.shape == (4096, 5)
        assert (np.vectorize(bytes.decode, otypes=[object])(top_names) == names[index]).all()
        meta = client.get_model_metadata("big", headers=auth())
        assert {"name": "label_name", "datatype": "BYTES", "shape": [-1]} in meta["outputs"]

        # errors reach tritonclient as the protocol's errors
        with pytest.raises(InferenceServerException) as err:
            client.infer("nope", [x], headers=auth())
        assert err.value.status() == "404" and "nope" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            client.infer("big", [x])
        assert err.value.status() == "401"
        bad = httpclient.InferInput("logits", [2, 999], "FP32")
        bad.set_data_from_numpy(z[:2, :999])
        with pytest.raises(InferenceServerException) as err:
            client.infer("big", [bad], headers=auth())
        assert err.value.status() == "422" and "1000 columns" in err.value.message()
    finally:
        client.close()
