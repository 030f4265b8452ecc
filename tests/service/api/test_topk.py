"""Issue 22 item 2 through the service: top-k log-probabilities of a real language model
(tests/data/lm/smollm2_top20.npz: SmolLM2-135M, 3,000 positions, top 20 of 49,152)
uploaded (.npz, JSON arrays, the chat-completions shape), fitted by temperature, served
through /v1 and /v2 (ONNX Runtime) and refused where they do not belong; on SQLite and
PostgreSQL."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import orjson
import pytest

from calibrators import topk
from calibrators.evaluation.holdout import split_indices
from service.api.codecs import json_body
from tests.oracles import wait_for_version
from tests.service.helpers import assert_problem, npy, npz

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "lm" / "smollm2_top20.npz"
DATA = dict(np.load(FIXTURE))
V = int(DATA["vocab_size"])
ROWS = topk.as_topk(DATA["topk_ids"], DATA["topk_logprobs"], V)


def _model(client, name: str = "lm", k: int = V) -> None:
    r = client.post("/v1/models", json={"name": name, "num_classes": k})
    assert r.status_code == 201, r.text


def _upload(client, body: bytes | dict, model: str = "lm"):
    if isinstance(body, dict):
        return client.post(f"/v1/models/{model}/datasets", json=body)
    return client.post(f"/v1/models/{model}/datasets", content=body,
                       headers={"content-type": "application/octet-stream"})


def _chat(rows: slice, names=None) -> dict:
    """The fixture's rows as a chat-completions answer, one choice per sequence, token
    strings the ids' decimal text."""
    ids, lp, y = DATA["topk_ids"][rows], DATA["topk_logprobs"][rows], DATA["labels"][rows]
    seq = DATA["sequence_ids"][rows]
    choices = []
    for s in dict.fromkeys(seq):
        at = np.flatnonzero(seq == s)
        content = [{"token": str(y[i]), "logprob": -1.0, "bytes": [1],
                    "top_logprobs": [{"token": str(t), "logprob": float(v)}
                                     for t, v in zip(ids[i], lp[i], strict=True)]}
                   for i in at]
        choices.append({"index": len(choices), "logprobs": {"content": content}})
    return {"choices": choices, "vocab_size": V}


def test_upload_npz_stores_top_k_rows_and_their_metrics(client):
    _model(client)
    r = _upload(client, FIXTURE.read_bytes())
    assert r.status_code == 201, r.text
    out = r.json()
    assert (out["format"], out["top_k"], out["k"], out["n"]) == ("topk", 20, V, 3000)
    assert out["n_sequences"] == len(np.unique(DATA["sequence_ids"]))
    expected = topk.report(ROWS, DATA["labels"], sequences=DATA["sequence_ids"])
    assert out["metrics"]["nll"] == pytest.approx(expected["nll"], rel=1e-12)
    assert out["metrics"]["nll"] == pytest.approx(
        topk.mean_nll(ROWS, DATA["labels"], 1.0), rel=1e-12)
    assert out["metrics"]["accuracy"] == expected["accuracy"]
    assert out["metrics"]["label_in_top_k"] == expected["label_in_top_k"]
    assert out["metrics"]["sequences"]["sequences"]["count"] == out["n_sequences"]
    again = _upload(client, FIXTURE.read_bytes())  # the same content: the same dataset
    assert again.status_code == 200 and again.json()["id"] == out["id"]


def test_upload_json_arrays_and_chat_shape(client):
    _model(client)
    rows = slice(0, 200)
    body = {"topk_ids": DATA["topk_ids"][rows].tolist(),
            "topk_logprobs": DATA["topk_logprobs"][rows].astype(float).tolist(),
            "vocab_size": V, "labels": DATA["labels"][rows].tolist()}
    r = _upload(client, body)
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "topk" and r.json()["n_sequences"] is None
    expected = topk.report(topk.as_topk(DATA["topk_ids"][rows], DATA["topk_logprobs"][rows], V),
                           DATA["labels"][rows])
    assert r.json()["metrics"]["nll"] == pytest.approx(expected["nll"], rel=1e-12)
    # the chat shape: tokens interned in order of first appearance, labels their own token
    chat = _chat(rows)
    r = _upload(client, chat)
    assert r.status_code == 201, r.text
    out = r.json()
    assert (out["format"], out["n"], out["top_k"]) == ("topk", 200, 20)
    assert out["n_sequences"] == len(chat["choices"])
    # the same rows whatever the ids' names: NLL, accuracy and tail share are equal
    for key in ("nll", "accuracy", "label_in_top_k"):
        assert out["metrics"][key] == pytest.approx(expected[key], rel=1e-12), key


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(vocab_size=np.int64(1000)), ("vocab_size", "49152", "1000")),
    (lambda d: d.update(topk_logprobs=d["topk_logprobs"] + 1.0), ("<= 0",)),
    (lambda d: d.update(topk_logprobs=np.where(np.arange(20) == 3, np.nan,
                                                d["topk_logprobs"])), ("finite",)),
    (lambda d: d.update(topk_ids=d["topk_ids"][:, :10]), ("topk_ids", "shape")),
    (lambda d: d.update(topk_ids=np.full_like(d["topk_ids"], 7)), ("distinct",)),
    (lambda d: d.update(topk_ids=d["topk_ids"].astype(np.float32)), ("integers",)),
    (lambda d: d.pop("labels"), ("labels",)),
    (lambda d: d.update(logits=np.zeros((3000, 4))), ("logits",)),
])
def test_bad_top_k_uploads_are_422(client, change, words):
    _model(client)
    data = dict(DATA)
    change(data)
    r = _upload(client, npz(**data))
    assert_problem(r, 422, *words)
    assert client.get("/v1/models/lm/datasets").json()["datasets"] == []


def test_v_must_be_the_models_k(client):
    _model(client, "small", k=1000)
    assert_problem(_upload(client, FIXTURE.read_bytes(), "small"), 422, "vocab_size", "1000")
    assert_problem(_upload(client, _chat(slice(0, 10)), "small"), 422, "vocab_size")


def _fit(client, dataset: int, model: str = "lm", **body):
    return client.post(f"/v1/models/{model}/calibrators",
                       json={"dataset_id": dataset, "method": "temperature", **body})


def _fitted(client, options: dict | None = None, **body) -> tuple[int, dict]:
    """The fixture uploaded and fitted: its dataset id and the finished version."""
    _model(client)
    dataset = _upload(client, FIXTURE.read_bytes()).json()["id"]
    r = _fit(client, dataset, options=options or {}, **body)
    assert r.status_code == 202, r.text
    return dataset, wait_for_version(client, "lm", r.json()["version"])


@pytest.mark.parametrize("tail", topk.TAILS)
def test_fit_matches_the_library_on_the_same_rows(client, tail):
    _, v = _fitted(client, {"tail": tail}, holdout=0.25, seed=3)
    assert v["status"] == "succeeded", v
    assert v["format"] == "topk" and v["params"]["format"] == topk.PARAMS_FORMAT
    fit_idx, hold_idx = split_indices(3000, 0.25, 3, groups=DATA["sequence_ids"])
    part = lambda idx: topk.as_topk(DATA["topk_ids"][idx], DATA["topk_logprobs"][idx], V)  # noqa: E731
    cal = topk.TopKTemperature(tail=tail).fit(part(fit_idx), DATA["labels"][fit_idx])
    assert v["params"]["beta"] == cal.beta_  # exactly: the same rows, the same solver
    assert v["params"]["tail"] == tail
    held = part(hold_idx)
    after = v["metrics"]["after"]
    assert after["nll"] == pytest.approx(
        topk.mean_nll(held, DATA["labels"][hold_idx], cal.beta_, tail), rel=1e-12)
    assert v["metrics"]["before"]["nll"] == pytest.approx(
        topk.mean_nll(held, DATA["labels"][hold_idx], 1.0, tail), rel=1e-12)
    assert after["nll"] < v["metrics"]["before"]["nll"]
    # by sequence: no text on both sides, and the report per sequence
    held_texts = np.unique(DATA["sequence_ids"][hold_idx])
    assert after["sequences"]["sequences"]["count"] == len(held_texts)
    assert v["argmax"]["changed"] == 0


def test_refit_serves_the_fit_on_every_row(client):
    _, v = _fitted(client, refit=True)
    assert v["status"] == "succeeded", v
    assert v["params"]["beta"] == topk.TopKTemperature().fit(ROWS, DATA["labels"]).beta_


@pytest.mark.parametrize("method, options, words", [
    ("vector", {}, ("top-k", "temperature", "vector")),
    ("auto", {}, ("top-k", "auto")),
    ("temperature", {"target_entropy": 1.0}, ("target_entropy",)),
    ("temperature", {"tail": "zipf"}, ("tail", "zipf")),
    ("temperature", {"tol": -1}, ("tol",)),
])
def test_other_methods_and_options_are_422(client, method, options, words):
    _model(client)
    dataset = _upload(client, FIXTURE.read_bytes()).json()["id"]
    assert_problem(_fit(client, dataset, method=method, options=options), 422, *words)
    assert client.get("/v1/models/lm/calibrators").json()["calibrators"] == []


def test_a_fit_worse_than_the_rows_as_given_is_rejected(client):
    """Fit rows labelled by their top-1 token (beta grows: the model looks underconfident),
    held-out rows by their least likely top-k token: the fitted temperature makes those
    rows' NLL far worse than the rows as given, and the version is refused."""
    _model(client)
    rows = np.arange(3000)
    best = DATA["topk_ids"][rows, DATA["topk_logprobs"].argmax(axis=1)]
    worst = DATA["topk_ids"][rows, DATA["topk_logprobs"].argmin(axis=1)]
    _, hold_idx = split_indices(3000, 0.5, 0, groups=DATA["sequence_ids"])
    labels = best.astype(np.int64)
    labels[hold_idx] = worst[hold_idx]
    dataset = _upload(client, npz(**{**DATA, "labels": labels})).json()["id"]
    r = _fit(client, dataset, holdout=0.5, seed=0)
    v = wait_for_version(client, "lm", r.json()["version"])
    assert v["status"] == "rejected", v
    assert v["rejected_for"] == ["nll-worse-than-uncalibrated"]


def test_posted_params_on_a_top_k_dataset_are_422(client):
    dataset, v = _fitted(client)
    r = client.post("/v1/models/lm/calibrators/import",
                    json={"dataset_id": dataset, "params": v["params"]})
    assert r.status_code == 422, r.text


@pytest.fixture
def served(client) -> topk.TopKTemperature:
    """The fixture fitted, its version aliased production; the library's calibrator of
    the version's params."""
    _, v = _fitted(client)
    assert v["status"] == "succeeded", v
    r = client.put("/v1/models/lm/aliases/production", json={"version": v["version"]})
    assert r.status_code == 200, r.text
    return topk.TopKTemperature.from_params(v["params"])


def _predict(client, body, *, accept: str | None = None, model: str = "lm", **params):
    headers = {} if accept is None else {"accept": accept}
    if isinstance(body, dict):
        return client.post(f"/v1/models/{model}/predict", json=body, params=params,
                           headers=headers)
    return client.post(f"/v1/models/{model}/predict", content=body, params=params,
                       headers={"content-type": "application/octet-stream", **headers})


def test_v1_serves_the_calibrated_top_k_and_tail(client, served):
    probs, tail = served.predict(ROWS)
    arrays = {"topk_ids": DATA["topk_ids"], "topk_logprobs": DATA["topk_logprobs"]}
    r = _predict(client, npz(**arrays))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["topk_ids"] == DATA["topk_ids"].tolist()
    np.testing.assert_allclose(out["probabilities"], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["tail"], tail, rtol=0, atol=1e-6)
    # JSON arrays, and the .npy answer: (n, k + 1), the tail last
    rows = slice(0, 300)
    r = _predict(client, {k: v[rows].tolist() for k, v in arrays.items()},
                 accept="application/x-npy")
    assert r.status_code == 200, r.text
    got = np.load(io.BytesIO(r.content))
    np.testing.assert_allclose(got[:, :20], probs[rows], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[:, 20], tail[rows], rtol=0, atol=1e-6)


def test_v1_serves_a_top_k_npz_sent_without_a_length(client, served):
    """A body without Content-Length (chunked; what a gzip'd body becomes once inflated)
    is read into a memory map, not a bytearray: the .npz reader takes it too (a 500
    once, found by the budget harness)."""
    probs, tail = served.predict(ROWS)
    body = npz(topk_ids=DATA["topk_ids"], topk_logprobs=DATA["topk_logprobs"])
    r = _predict(client, iter([body[: len(body) // 2], body[len(body) // 2 :]]))
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["probabilities"], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(r.json()["tail"], tail, rtol=0, atol=1e-6)


def test_v1_serves_the_chat_completions_shape(client, served):
    rows = slice(100, 160)
    r = _predict(client, _chat(rows))
    assert r.status_code == 200, r.text
    out = r.json()
    probs, tail = served.predict(topk.as_topk(DATA["topk_ids"][rows],
                                              DATA["topk_logprobs"][rows], V))
    np.testing.assert_allclose(out["probabilities"], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["tail"], tail, rtol=0, atol=1e-6)
    assert out["tokens"] == DATA["topk_ids"][rows].astype(str).tolist()


def test_the_served_graph_matches_numpy_on_the_fixture(client, served):
    """ONNX parity at the service's session: the graph built from the stored params."""
    import onnxruntime as ort

    from service.serving.inference import onnx_bytes, run_topk

    session = ort.InferenceSession(onnx_bytes(served.to_params()),
                                   providers=["CPUExecutionProvider"])
    out = run_topk(session, ROWS.logprobs)
    probs, tail = served.predict(ROWS)
    np.testing.assert_allclose(out["probabilities"], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["tail"], tail, rtol=0, atol=1e-6)


@pytest.mark.parametrize("body, words", [
    ({"logits": [[0.0] * 4]}, ("top-k", "topk_ids")),
    (npy(np.zeros((2, 20), np.float32)), ("top-k", "topk_ids")),
    ({"topk_ids": [[1, 2]], "topk_logprobs": [[-1.0, -2.0]]}, ("top-20", "2")),
    ({"topk_ids": [list(range(20))], "topk_logprobs": [[0.5] * 20]}, ("<= 0",)),
    ({"topk_ids": [list(range(20))], "topk_logprobs": [[-0.01] * 20]}, ("sum to at most 1",)),
    ({"topk_ids": [[1] * 20], "topk_logprobs": [[-5.0] * 20]}, ("distinct",)),
    ({"topk_ids": [[1.5] * 20], "topk_logprobs": [[-5.0] * 20]}, ("integers",)),
    ({"topk_ids": [list(range(20))], "topk_logprobs": [[-5.0] * 20], "vocab_size": 7},
     ("vocab_size",)),
    ({"logprobs": {"content": [{"token": "a"}]}}, ("top_logprobs",)),
])
def test_a_top_k_version_refuses_what_is_not_its_rows(client, served, body, words):
    assert_problem(_predict(client, body), 422, *words)


def test_a_full_version_refuses_top_k_rows(client):
    r = client.post("/v1/models", json={"name": "full", "num_classes": 4})
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(200, 4)), rng.integers(0, 4, 200)
    r = client.post("/v1/models/full/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    v = wait_for_version(client, "full", _fit(client, r.json()["id"], "full").json()["version"])
    client.put("/v1/models/full/aliases/production", json={"version": v["version"]})
    body = {"topk_ids": [[0, 1]], "topk_logprobs": [[-1.0, -2.0]], "vocab_size": 4}
    assert_problem(_predict(client, body, model="full"), 422, "full (n, K) scores", "top-k")


def test_a_chat_body_past_its_limit_is_413_before_it_is_parsed(client, monkeypatch):
    """The chat shape is read as Python objects: its bytes are bounded first."""
    _model(client)
    body = _chat(slice(0, 50))
    size = len(orjson.dumps(body))
    monkeypatch.setattr(json_body, "MAX_CHAT_JSON_BYTES", size - 1)
    assert_problem(_upload(client, body), 413, "chat-completions", "topk_ids")
    monkeypatch.setattr(json_body, "MAX_CHAT_JSON_BYTES", size + 1)
    assert _upload(client, body).status_code == 201


# -- /v2 (the Open Inference Protocol) ------------------------------------------------

HEADER = "Inference-Header-Content-Length"


def _v2_tensors(rows, lp_type: str = "FP64", binary: bool = False, reverse: bool = False):
    """The fixture's ``rows`` as the two inputs of a top-k version (logprobs first with
    ``reverse``): JSON data, or binary data in the inputs' order. Returns the inputs and
    the binary bytes (b"" for JSON)."""
    ids, lp = DATA["topk_ids"][rows], DATA["topk_logprobs"][rows]
    arrays = [("topk_ids", "INT64", ids.astype("<i8")),
              ("topk_logprobs", lp_type, lp.astype("<f4" if lp_type == "FP32" else "<f8"))]
    if reverse:
        arrays.reverse()
    inputs, raw = [], b""
    for name, datatype, arr in arrays:
        t = {"name": name, "shape": list(arr.shape), "datatype": datatype}
        if binary:
            t["parameters"] = {"binary_data_size": arr.nbytes}
            raw += arr.tobytes()
        else:
            t["data"] = arr.tolist()
        inputs.append(t)
    return inputs, raw


def _infer(client, body: dict, raw: bytes = b"", model: str = "lm", path: str = ""):
    url = f"/v2/models/{model}{path}/infer"
    if not raw:
        return client.post(url, json=body)
    head = orjson.dumps(body)
    return client.post(url, content=head + raw, headers={HEADER: str(len(head))})


def _outputs(r) -> dict[str, np.ndarray]:
    """An infer answer's outputs, JSON or binary, as arrays of their shapes."""
    assert r.status_code == 200, r.text
    head = int(r.headers.get(HEADER, len(r.content)))
    offset, out = head, {}
    for t in orjson.loads(r.content[:head])["outputs"]:
        dtype = np.dtype("<i8" if t["datatype"] == "INT64" else "<f4")
        if "data" in t:
            arr = np.asarray(t["data"], dtype)
        else:
            size = t["parameters"]["binary_data_size"]
            arr = np.frombuffer(r.content, dtype, size // dtype.itemsize, offset)
            offset += size
        out[t["name"]] = arr.reshape(t["shape"])
    assert offset == len(r.content)
    return out


def _v2_error(r, status: int, *words: str) -> None:
    """The protocol's error shape: {"error": message}, never a 500."""
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"], r.text
    for word in words:
        assert word.lower() in r.json()["error"].lower(), r.json()["error"]


def test_v2_serves_the_calibrated_top_k_and_tail(client, served):
    probs, tail = served.predict(ROWS)
    inputs, _ = _v2_tensors(slice(None))
    r = _infer(client, {"id": "t-1", "inputs": inputs})
    head = r.json()
    assert (head["model_name"], head["model_version"], head["id"]) == ("lm", "1", "t-1")
    assert [t["name"] for t in head["outputs"]] == ["probabilities", "topk_ids", "tail"]
    out = _outputs(r)
    assert out["probabilities"].shape == (3000, 20) and out["tail"].shape == (3000,)
    np.testing.assert_allclose(out["probabilities"], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["tail"], tail, rtol=0, atol=1e-6)
    assert (out["topk_ids"] == DATA["topk_ids"]).all()
    # binary in (FP32 and FP64, either order of the inputs) and out, the versioned path
    rows = slice(500, 1700)
    want = served.predict(topk.as_topk(DATA["topk_ids"][rows], DATA["topk_logprobs"][rows], V))
    for lp_type, reverse in (("FP32", False), ("FP64", True)):
        inputs, raw = _v2_tensors(rows, lp_type, binary=True, reverse=reverse)
        body = {"inputs": inputs, "parameters": {"binary_data_output": True},
                "outputs": [{"name": "tail"}, {"name": "probabilities"}]}
        r = _infer(client, body, raw, path="/versions/1")
        assert r.headers["content-type"] == "application/octet-stream"
        out = _outputs(r)
        assert list(out) == ["tail", "probabilities"]
        np.testing.assert_allclose(out["probabilities"], want[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(out["tail"], want[1], rtol=0, atol=1e-6)
    # /v1 and /v2 agree to the bit: one graph, one session
    v1 = _predict(client, {k: DATA[k][rows].tolist() for k in ("topk_ids", "topk_logprobs")})
    assert (np.asarray(v1.json()["probabilities"], np.float32) == out["probabilities"]).all()


def test_v2_metadata_and_config_describe_the_top_k_tensors(client, served):
    meta = client.get("/v2/models/lm").json()
    assert meta["inputs"] == [
        {"name": "topk_ids", "datatype": "INT64", "shape": [-1, 20]},
        {"name": "topk_logprobs", "datatype": "FP32", "shape": [-1, 20]},
    ]
    assert meta["outputs"] == [
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 20]},
        {"name": "topk_ids", "datatype": "INT64", "shape": [-1, 20]},
        {"name": "tail", "datatype": "FP32", "shape": [-1]},
    ]
    assert client.get("/v2/models/lm/versions/1").json() == meta
    assert client.get("/v2/models/lm/ready").json() == {"name": "lm", "ready": True}
    _v2_error(client.get("/v2/models/lm?top_k=3"), 422, "top_k", "top-k rows")
    config = client.get("/v2/models/lm/config").json()
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        (t["name"], f"TYPE_{t['datatype']}", t["shape"]) for t in meta["inputs"]]
    assert [t["name"] for t in config["output"]] == [t["name"] for t in meta["outputs"]]
    assert client.get("/v2/models/lm/versions/1/config").json() == config


def _v2_body(**change) -> dict:
    inputs, _ = _v2_tensors(slice(0, 3))
    ids, lp = inputs
    for key, value in change.items():
        name, field = key.split("__")
        (ids if name == "ids" else lp)[field] = value
    return {"inputs": [ids, lp]}


@pytest.mark.parametrize("body, words", [
    ({"inputs": [{"name": "logits", "shape": [1, V], "datatype": "FP32",
                  "data": [0.0] * V}]}, ("top-k rows", "topk_ids", "logits")),
    ({"inputs": _v2_body()["inputs"][:1]}, ("two inputs", "topk_logprobs")),
    ({"inputs": [_v2_body()["inputs"][0]] * 2}, ("two inputs",)),
    (_v2_body(ids__shape=[3, 10], lp__shape=[3, 10]), ("top-20", "[n, 20]")),
    (_v2_body(ids__datatype="FP32"), ("datatype", "INT64")),
    (_v2_body(lp__datatype="BF16"), ("datatype", "FP32")),
    (_v2_body(ids__data=[[1] * 20] * 3), ("distinct",)),
    (_v2_body(ids__data=[[V, *range(19)]] * 3), ("[0, 49152)",)),
    (_v2_body(ids__data=[[0.5] * 20] * 3), ("integers",)),
    (_v2_body(lp__data=[[0.5] * 20] * 3), ("<= 0",)),
    (_v2_body(lp__data=[[-0.01] * 20] * 3), ("sum to at most 1",)),
    (_v2_body(ids__shape=[2, 20], ids__data=[[0] * 20] * 2), ("one shape",)),
    (_v2_body(lp__data=[[-1.0] * 20] * 2), ("60 numbers",)),
    ({**_v2_body(), "parameters": {"top_k": 2}}, ("top_k", "top-k rows")),
    ({**_v2_body(), "parameters": {"kind": "probabilities"}}, ("kind",)),
    ({**_v2_body(), "outputs": [{"name": "label"}]}, ("unknown output", "tail")),
])
def test_v2_a_top_k_version_refuses_what_is_not_its_rows(client, served, body, words):
    _v2_error(_infer(client, body), 422, *words)


def test_v2_binary_data_of_two_inputs_is_checked_whole(client, served):
    inputs, raw = _v2_tensors(slice(0, 4), "FP32", binary=True)
    body = {"inputs": inputs}
    assert _infer(client, body, raw).status_code == 200
    _v2_error(_infer(client, body, raw + b"\0" * 8), 400, "body holds")
    _v2_error(_infer(client, body, raw[:-8]), 400, "body holds", "topk_logprobs")
    inputs[1]["parameters"]["binary_data_size"] -= 4
    _v2_error(_infer(client, body, raw[:-4]), 422, "binary_data_size", "320")


def test_v2_a_full_version_refuses_top_k_inputs(client):
    r = client.post("/v1/models", json={"name": "full", "num_classes": 4})
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(200, 4)), rng.integers(0, 4, 200)
    r = client.post("/v1/models/full/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    v = wait_for_version(client, "full", _fit(client, r.json()["id"], "full").json()["version"])
    client.put("/v1/models/full/aliases/production", json={"version": v["version"]})
    body = {"inputs": [{"name": "topk_ids", "shape": [1, 2], "datatype": "INT64",
                        "data": [0, 1]},
                       {"name": "topk_logprobs", "shape": [1, 2], "datatype": "FP32",
                        "data": [-1.0, -2.0]}]}
    _v2_error(_infer(client, body, model="full"), 422, "full (n, K) scores", "top-k")
    _v2_error(_infer(client, {"inputs": body["inputs"][1:]}, model="full"), 422, "top-k")
    body = {"inputs": [{"name": "logits", "shape": [1, 4], "datatype": "FP32",
                        "data": [0.0] * 4}], "outputs": [{"name": "tail"}]}
    _v2_error(_infer(client, body, model="full"), 422, "unknown output")


def test_top_k_predicts_count_rows_confidence_and_entropy(client, served):
    """/v1 and /v2 add their rows to the prediction metrics: the top-1's calibrated
    probability as the confidence, the entropy of the k tokens and the tail."""
    from prometheus_client.parser import text_string_to_metric_families

    from service.serving.predict import topk_entropy

    def samples() -> dict:
        body, _ = client.app.state.welltempered.metrics.render()
        return {(s.name, s.labels.get("le")): s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
                if s.labels.get("model") == "lm"}

    rows = slice(0, 250)
    assert _predict(client, {k: DATA[k][rows].tolist()
                             for k in ("topk_ids", "topk_logprobs")}).status_code == 200
    inputs, raw = _v2_tensors(slice(250, 400), binary=True)
    assert _infer(client, {"inputs": inputs}, raw).status_code == 200
    got = samples()
    probs, tail = served.predict(topk.as_topk(DATA["topk_ids"][:400],
                                              DATA["topk_logprobs"][:400], V))
    entropy = topk_entropy(probs, tail)
    assert got[("welltempered_predictions_total", None)] == 400
    assert got[("welltempered_prediction_argmax_flips_total", None)] == 0
    assert got[("welltempered_prediction_confidence_total", None)] == pytest.approx(
        probs.max(axis=1).sum(), rel=1e-5)
    assert got[("welltempered_prediction_entropy_nats_sum", None)] == pytest.approx(
        entropy.sum(), rel=1e-5)
    # the entropy over k + 1 outcomes: the tail as one bucket
    assert entropy[0] == pytest.approx(
        -(probs[0] * np.log(probs[0])).sum() - tail[0] * np.log(tail[0]), rel=1e-12)


def test_the_routes_of_full_scores_answer_a_top_k_version_clearly(client, served):
    """Monitoring and the reliability diagrams work from the top-k hold-out report; label
    shift and fusing with a classifier are clear 422s (docs/api.md); the loop keeps no
    top-k feedback, so it has nothing to run on (409). Never a 500."""
    from tests.security.budget_cases import _classifier_onnx

    live = client.get("/v1/models/lm/monitoring")
    assert live.status_code == 200, live.text
    assert live.json()["live"]["n"] == 0 and live.json()["holdout"]["bins"]["count"]
    for path in ("/v1/models/lm/monitoring/reliability.svg",
                 "/v1/models/lm/calibrators/1/reliability.svg"):
        r = client.get(path)
        assert r.status_code == 200 and r.text.startswith("<svg"), r.text
    for method in ("get", "post"):
        assert_problem(getattr(client, method)("/v1/models/lm/label-shift"), 422,
                       "top-k", "label shift")
    r = client.post("/v1/models/lm/calibrators/1/fuse", content=_classifier_onnx(),
                    headers={"content-type": "application/octet-stream"})
    assert_problem(r, 422, "top-k version cannot be fused")
    r = client.put("/v1/models/lm/loop", json={"keep_feedback": True})
    assert r.status_code == 200, r.text
    arrays = {k: DATA[k][:200] for k in ("topk_ids", "topk_logprobs", "labels")}
    r = client.post("/v1/models/lm/feedback", content=npz(vocab_size=V, **arrays),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["kept"] == 0, r.text
    assert_problem(client.post("/v1/models/lm/loop/runs"), 409, "0 feedback rows")


def test_feedback_on_a_top_k_version_is_its_live_calibration(client, served):
    """Labelled top-k rows posted as feedback (.npz, JSON arrays, the chat shape): the
    live figures of the window equal calibrators.topk.report of the same rows at the
    version's beta under its tail (NLL, accuracy, ECE), the entropy that of the k tokens
    and the tail."""
    from service.serving.predict import topk_entropy

    parts = [slice(0, 1000), slice(1000, 2000), slice(2000, 2400)]
    keys = ("topk_ids", "topk_logprobs", "labels")
    r = client.post("/v1/models/lm/feedback",
                    content=npz(vocab_size=V, **{k: DATA[k][parts[0]] for k in keys}),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    top1 = DATA["topk_ids"][np.arange(3000), DATA["topk_logprobs"].argmax(axis=1)]
    assert r.json()["rows"] == 1000
    assert r.json()["correct"] == int((top1 == DATA["labels"])[parts[0]].sum())
    body = {k: DATA[k][parts[1]].tolist() for k in keys} | {"vocab_size": V}
    assert client.post("/v1/models/lm/feedback", json=body).status_code == 200
    chat = _chat(parts[2])  # interned ids: the same rows under other names
    r = client.post("/v1/models/lm/feedback?version=1", json=chat)
    assert r.status_code == 200, r.text
    live = client.get("/v1/models/lm/monitoring").json()["live"]
    rows = slice(0, 2400)
    t = topk.as_topk(DATA["topk_ids"][rows], DATA["topk_logprobs"][rows], V)
    want = topk.report(t, DATA["labels"][rows], beta=served.beta_, tail=served.tail)
    assert live["n"] == 2400
    assert live["nll"] == pytest.approx(want["nll"], rel=1e-9)
    assert live["accuracy"] == want["accuracy"]
    assert live["ece"] == pytest.approx(want["ece"], abs=1e-5)
    assert live["entropy"] == pytest.approx(topk_entropy(*served.predict(t)).mean(), rel=1e-5)


@pytest.mark.parametrize("body, words", [
    (npz(logits=np.zeros((2, V), np.float32), labels=np.zeros(2, int)),
     ("Version 1 of 'lm' serves top-k rows", "topk_ids")),
    (npz(topk_ids=DATA["topk_ids"][:5, :10], topk_logprobs=DATA["topk_logprobs"][:5, :10],
         vocab_size=V, labels=DATA["labels"][:5]), ("top-20", "rows of 10")),
    (npz(topk_ids=DATA["topk_ids"][:5], topk_logprobs=DATA["topk_logprobs"][:5],
         vocab_size=V), ("labels",)),
])
def test_feedback_a_top_k_version_refuses(client, served, body, words):
    r = client.post("/v1/models/lm/feedback", content=body,
                    headers={"content-type": "application/octet-stream"})
    assert_problem(r, 422, *words)
    assert client.get("/v1/models/lm/monitoring").json()["live"]["n"] == 0


def test_a_full_version_refuses_top_k_feedback(client):
    client.post("/v1/models", json={"name": "full", "num_classes": 30})
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(200, 30)), rng.integers(0, 30, 200)
    r = client.post("/v1/models/full/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    v = wait_for_version(client, "full", _fit(client, r.json()["id"], "full").json()["version"])
    client.put("/v1/models/full/aliases/production", json={"version": v["version"]})
    body = {"topk_ids": [list(range(20))], "topk_logprobs": [[-5.0] * 20],
            "vocab_size": 30, "labels": [3]}
    assert_problem(client.post("/v1/models/full/feedback", json=body), 422,
                   "full (n, K) scores", "top-k")


@pytest.mark.process
def test_tritonclient_infers_a_top_k_version(tmp_path):
    """A real ``welltempered serve`` and tritonclient.http: the two inputs as binary and
    as JSON tensors, the answers equal TopKTemperature.predict to 1e-6, the metadata
    tritonclient reads, a refusal as the client's exception."""
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    from tests.service.servers import Server

    url = f"sqlite:///{tmp_path / 'registry.sqlite3'}"
    with Server(url, tmp_path / "data") as server:
        with server.client() as c:
            _, v = _fitted(c)
            assert v["status"] == "succeeded", v
            r = c.put("/v1/models/lm/aliases/production", json={"version": v["version"]})
            assert r.status_code == 200, r.text
        cal = topk.TopKTemperature.from_params(v["params"])
        client = httpclient.InferenceServerClient(server.base.removeprefix("http://"),
                                                  network_timeout=120.0)
        try:
            meta = client.get_model_metadata("lm")
            assert [t["name"] for t in meta["inputs"]] == ["topk_ids", "topk_logprobs"]
            probs, tail = cal.predict(ROWS)
            for binary in (True, False):
                ids = httpclient.InferInput("topk_ids", [3000, 20], "INT64")
                ids.set_data_from_numpy(DATA["topk_ids"].astype(np.int64), binary_data=binary)
                lp = httpclient.InferInput("topk_logprobs", [3000, 20], "FP32")
                lp.set_data_from_numpy(DATA["topk_logprobs"].astype(np.float32),
                                       binary_data=binary)
                wanted = [httpclient.InferRequestedOutput(n, binary_data=binary)
                          for n in ("probabilities", "tail", "topk_ids")]
                result = client.infer("lm", [ids, lp], outputs=wanted)
                np.testing.assert_allclose(result.as_numpy("probabilities"), probs,
                                           rtol=0, atol=1e-6)
                np.testing.assert_allclose(result.as_numpy("tail"), tail, rtol=0, atol=1e-6)
                assert (result.as_numpy("topk_ids") == DATA["topk_ids"]).all()
            x = httpclient.InferInput("logits", [1, V], "FP32")
            x.set_data_from_numpy(np.zeros((1, V), np.float32))
            with pytest.raises(InferenceServerException) as err:
                client.infer("lm", [x])
            assert "top-k rows" in str(err.value)
        finally:
            client.close()
