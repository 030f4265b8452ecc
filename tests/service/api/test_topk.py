"""Issue 22 item 2 through the service: top-k log-probabilities of a real language model
(tests/data/lm/smollm2_top20.npz: SmolLM2-135M, 3,000 positions, top 20 of 49,152)
uploaded (.npz, JSON arrays, the chat-completions shape), fitted by temperature, served
through /v1 and /v2 (ONNX Runtime) and refused where they do not belong; on SQLite and
PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrators import topk
from calibrators.evaluation.holdout import split_indices
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
