"""Label-free fits end to end (issue 22, item 3), through service.api: datasets of
scores without labels (JSON and .npz), fitted only by methods that need no labels (temperature with
``target_entropy``, ``row-entropy``), reported by entropies and ``KL(q || p)``, served
like any version; everything that needs labels answers a 422 naming why. On SQLite and
PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest

from calibrators.evaluation.holdout import split_indices
from service.vocabulary import DEFAULT_NAMESPACE
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    families,
    fit,
    logits_data,
    npz,
    upload,
)


def entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=1)


def upload_scores(client, model: str, logits) -> dict:
    r = client.post(f"/v1/models/{model}/datasets", json={"logits": np.asarray(logits).tolist()})
    assert r.status_code in (200, 201), r.text
    return r.json()


def start(client, dataset_id: int, method: str, **body):
    return client.post("/v1/models/m/calibrators",
                       json={"dataset_id": dataset_id, "method": method, **body})


def test_scores_without_labels_are_a_dataset_of_their_own(client):
    logits, labels = logits_data(200)
    create_model(client)
    unlabelled = upload_scores(client, "m", logits)
    assert unlabelled["labelled"] is False and unlabelled["n"] == 200
    h = entropy(softmax(logits))
    assert unlabelled["metrics"]["entropy"]["mean"] == pytest.approx(h.mean(), rel=1e-12)
    assert unlabelled["metrics"]["entropy"]["p95"] == pytest.approx(
        np.quantile(h, 0.95), rel=1e-12)
    again = client.post("/v1/models/m/datasets", content=npz(logits=logits),
                        headers={"Content-Type": "application/octet-stream"})
    assert again.status_code == 200 and again.json()["id"] == unlabelled["id"]
    labelled = upload(client, "m", logits, labels)
    assert labelled["labelled"] is True and labelled["id"] != unlabelled["id"]


@pytest.mark.parametrize("refit", [False, True])
def test_temperature_fits_a_target_entropy_without_labels_and_serves_it(client, refit):
    logits, _ = logits_data(400, seed=1)
    create_model(client)
    dataset = upload_scores(client, "m", logits)
    version = fit(client, "m", dataset["id"], options={"target_entropy": 0.8},
                  holdout=0.25, seed=2, refit=refit)
    assert version["status"] == "succeeded", version
    after, before = version["metrics"]["after"], version["metrics"]["before"]
    assert after["label_free"] is True and after["target_entropy"] == 0.8
    assert abs(after["entropy_reached"] - 0.8) <= 1e-9
    fit_idx, hold_idx = split_indices(400, 0.25, 2)
    fitted = logits if refit else logits[fit_idx]
    beta = 1.0 / version["params"]["fit_info"]["temperature"]
    q, p = softmax(beta * logits[hold_idx]), softmax(logits[hold_idx])
    kl = np.sum(q * (np.log(q) - np.log(p)), axis=1)
    assert after["n"] == before["n"] == hold_idx.size
    assert after["kl"]["median"] == pytest.approx(np.median(kl), rel=1e-9)
    assert after["kl"]["p95"] == pytest.approx(np.quantile(kl, 0.95), rel=1e-9)
    assert after["entropy_after"]["mean"] == pytest.approx(entropy(q).mean(), rel=1e-9)
    assert before["entropy"]["p5"] == pytest.approx(np.quantile(entropy(p), 0.05), rel=1e-9)
    assert after["fit"]["n"] == fitted.shape[0]
    assert version["argmax"]["changed"] == 0
    r = client.post(f"/v1/models/m/predict?version={version['version']}",
                    json={"logits": fitted.tolist()})
    assert r.status_code == 200, r.text
    served = np.asarray(r.json()["probabilities"])
    assert abs(entropy(served).mean() - 0.8) <= 1e-5  # float32 answers


def test_row_entropy_gives_every_served_row_the_target(client):
    logits, _ = logits_data(300, seed=3)
    create_model(client)
    dataset = upload_scores(client, "m", logits)
    version = fit(client, "m", dataset["id"], method="row-entropy",
                  options={"target_entropy": 0.5})
    assert version["status"] == "succeeded", version
    after = version["metrics"]["after"]
    assert after["fit"]["entropy_after"]["p5"] == pytest.approx(0.5, abs=1e-9)
    assert after["fit"]["entropy_after"]["p95"] == pytest.approx(0.5, abs=1e-9)
    assert after["entropy_after"]["p95"] - after["entropy_after"]["p5"] <= 1e-9
    assert after["entropy_before"]["p95"] - after["entropy_before"]["p5"] > 0.1
    new = np.random.default_rng(4).normal(size=(30, 4)) * 4
    r = client.post(f"/v1/models/m/predict?version={version['version']}",
                    json={"logits": new.tolist()})
    assert r.status_code == 200, r.text
    served = np.asarray(r.json()["probabilities"])
    assert np.abs(entropy(served) - 0.5).max() <= 1e-5
    np.testing.assert_array_equal(served.argmax(axis=1), new.argmax(axis=1))


@pytest.mark.parametrize(
    ("method", "options", "words"),
    [
        ("auto", {}, ("'auto'", "held-out NLL", "labels")),
        ("temperature", {}, ("temperature", "learns from labels", "target_entropy")),
        ("vector", {}, ("vector", "learns from labels")),
        ("prior-shift", {}, ("prior-shift", "labels")),
    ],
)
def test_fits_that_need_labels_are_refused_on_scores_alone(client, method, options, words):
    logits, _ = logits_data(100)
    create_model(client)
    dataset = upload_scores(client, "m", logits)
    assert_problem(start(client, dataset["id"], method, options=options), 422, *words)


def test_an_import_and_monitoring_need_labels(client):
    logits, labels = logits_data(200, seed=5)
    create_model(client)
    scores_only = upload_scores(client, "m", logits)
    labelled = upload(client, "m", logits, labels)
    params = fit(client, "m", labelled["id"])["params"]
    r = client.post("/v1/models/m/calibrators/import",
                    json={"dataset_id": scores_only["id"], "params": params})
    assert_problem(r, 422, "held-out NLL", "labels")
    version = fit(client, "m", scores_only["id"], options={"target_entropy": 1.0})
    r = client.get("/v1/models/m/monitoring", params={"version": version["version"]})
    assert_problem(r, 422, "without labels", "monitor")
    r = client.get(f"/v1/models/m/calibrators/{version['version']}/reliability.svg")
    assert_problem(r, 422, "without labels")


def test_a_npz_without_labels_may_not_hold_two_label_arrays(client):
    logits, labels = logits_data(20)
    create_model(client)
    r = client.post("/v1/models/m/datasets",
                    content=npz(logits=logits, labels=labels, ground_truth=labels),
                    headers={"Content-Type": "application/octet-stream"})
    assert_problem(r, 422, "at most one label array")


def test_an_aliased_label_free_version_with_feedback_leaves_the_metrics_whole(client):
    logits, labels = logits_data(200, seed=6)
    create_model(client)
    dataset = upload_scores(client, "m", logits)
    version = fit(client, "m", dataset["id"], method="row-entropy")
    r = client.put("/v1/models/m/aliases/production", json={"version": version["version"]})
    assert r.status_code == 200, r.text
    body = {"logits": logits[:50].tolist(), "labels": labels[:50].tolist()}
    assert client.post("/v1/models/m/feedback", json=body).status_code == 200
    gauges = families(client.get("/metrics").text)
    hold = tuple(sorted({"namespace": DEFAULT_NAMESPACE, "model": "m",
                         "version": str(version["version"]), "alias": "production"}.items()))
    assert gauges["welltempered_holdout_rows"][hold] == version["metrics"]["after"]["n"]
    assert hold not in gauges.get("welltempered_holdout_ece_ratio", {})
