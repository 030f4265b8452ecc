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
