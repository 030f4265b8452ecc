"""A language-model vocabulary end to end at default settings (issue 13, "Language-model
scale"): K = 262,144 on a small N: upload, temperature fit, predict with top_k (only the
k asked come back), and a matrix fit refused at submission by the cost guard."""

from __future__ import annotations

import io

import numpy as np
import pytest

from service.settings import Settings
from tests.service.helpers import assert_problem, create_model, npy, npz, promote

K = Settings.model_fields["max_classes"].default
N = 64
NPY = "application/x-npy"


def vocabulary_logits(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Next-token-like float16 logits: a heavy tail, the label's logit raised."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    z = rng.standard_normal((n, k), dtype=np.float32) * 2
    z[np.arange(n), labels] += 12
    return z.astype(np.float16), labels


def test_the_default_k_holds_the_largest_vocabularies():
    assert K >= 262_144


@pytest.mark.slow
def test_a_262144_class_model_end_to_end(client):
    create_model(client, "lm", k=K, argmax_policy="off")
    z, y = vocabulary_logits(N, K)
    r = client.post(
        "/v1/models/lm/datasets",
        content=npz(logits=z, labels=y),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    dataset = r.json()
    assert (dataset["n"], dataset["k"], dataset["dtype"]) == (N, K, "float32")

    # matrix scaling needs K x K weights: refused before anything is queued
    r = client.post(
        "/v1/models/lm/calibrators", json={"dataset_id": dataset["id"], "method": "matrix"}
    )
    body = assert_problem(r, 422, "matrix")
    assert body["type"].endswith("/fit-too-large") and body["max_classes"] < K
    assert client.get("/v1/models/lm/calibrators").json()["calibrators"] == []

    version = promote(client, "lm", dataset["id"])
    assert version["status"] == "succeeded", version

    x = z[:4]
    for k in (1, 5):
        r = client.post(f"/v1/models/lm/predict?top_k={k}", content=npy(x),
                        headers={"content-type": NPY})
        assert r.status_code == 200, r.text
        out = r.json()
        assert "probabilities" not in out
        assert np.shape(out["top_k_indices"]) == np.shape(out["top_k_probabilities"]) == (4, k)
        assert len(r.content) < 4_000  # not 4 x 262,144 probabilities
        # temperature keeps the argmax: the first of the top k is the logits' argmax
        assert [row[0] for row in out["top_k_indices"]] == x.argmax(axis=1).tolist()
        assert np.all(np.diff(out["top_k_probabilities"], axis=1) <= 0)
    r = client.post("/v1/models/lm/predict?top_k=3", content=npy(x),
                    headers={"content-type": NPY, "accept": NPY})
    assert r.status_code == 200, r.text
    answer = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert answer.shape == (4, 3) and answer["index"][:, 0].tolist() == x.argmax(1).tolist()
    # whole rows as JSON are bounded like a JSON request (MAX_JSON_BYTES): 17 rows of
    # 262,144 could be 71 MB of JSON; top_k or a .npy answer say the same
    r = client.post("/v1/models/lm/predict", content=npy(z[:17]), headers={"content-type": NPY})
    body = assert_problem(r, 422, "top_k", "x-npy")
    assert body["fix"]
    # 17 rows (4.5 M scores, 17.8 MB): ONNX Runtime runs in row chunks, top_k too, and the
    # .npy answer is streamed from views of the array; all equal to smaller batches
    def whole_rows(x: np.ndarray) -> np.ndarray:
        r = client.post("/v1/models/lm/predict", content=npy(x),
                        headers={"content-type": NPY, "accept": NPY})
        assert r.status_code == 200, r.text
        assert int(r.headers["content-length"]) == len(r.content)
        return np.load(io.BytesIO(r.content), allow_pickle=False)

    x = z[:17]
    big = whole_rows(x)
    np.testing.assert_array_equal(big, np.concatenate([whole_rows(x[:8]), whole_rows(x[8:])]))
    r = client.post("/v1/models/lm/predict?top_k=3", content=npy(x),
                    headers={"content-type": NPY})
    assert r.status_code == 200, r.text
    assert r.json()["top_k_indices"] == np.argsort(-big, axis=1, kind="stable")[:, :3].tolist()
    # the whole row, when asked, sums to 1
    r = client.post("/v1/models/lm/predict", content=npy(x[:1]), headers={"content-type": NPY,
                                                                          "accept": NPY})
    assert r.status_code == 200, r.text
    probs = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert probs.shape == (1, K) and abs(float(probs.sum(dtype=np.float64)) - 1) < 1e-4
