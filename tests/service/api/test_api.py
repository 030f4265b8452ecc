"""The API's happy paths (service/api/routers/), on SQLite and PostgreSQL (see conftest)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import calibrators
from calibrators.evaluation import metrics
from service.jobs.fitting import auto_candidates
from service.vocabulary import DEFAULT_ALIAS
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    logits_data,
    race_leader,
    upload,
)


def shuffled_labels(n=400, k=3, seed=1):
    """Labels that are the *next* class after the argmax: matrix scaling learns to
    permute the classes, i.e. changes held-out predictions."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    return logits, (logits.argmax(axis=1) + 1) % k


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_health_and_ready(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_readyz_problem_carries_no_driver_text(client, monkeypatch):
    from sqlalchemy.exc import OperationalError

    from service.storage import migrate

    def unreachable(engine):
        raise OperationalError("SELECT version_num FROM alembic_version", {}, "host db.internal")

    monkeypatch.setattr(migrate, "current_revision", unreachable)
    body = assert_problem(client.get("/readyz"), 503, "unreachable")
    assert body["type"].endswith("/service-unavailable")
    text = str(body)
    assert "SELECT" not in text and "db.internal" not in text


def test_models_create_list_get(client):
    body = create_model(client, "resnet", 3, class_names=["a", "b", "c"], argmax_policy="warn")
    assert body["name"] == "resnet" and body["num_classes"] == 3
    assert body["argmax_policy"] == "warn" and body["created_at"].endswith(("Z", "+00:00"))
    create_model(client, "alpha", 2)
    # oldest first (by id: the stable order of a paged list), not by name
    assert [m["name"] for m in client.get("/v1/models").json()["models"]] == ["resnet", "alpha"]
    got = client.get("/v1/models/resnet").json()
    assert got["class_names"] == ["a", "b", "c"]
    assert create_model(client, "x", 2)["argmax_policy"] == "require"  # the default


def test_dataset_json_upload_metrics_and_dedup(client):
    create_model(client, "m", 4)
    logits, labels = logits_data()
    r = client.post(
        "/v1/models/m/datasets", json={"logits": logits.tolist(), "labels": labels.tolist()}
    )
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["n"], ds["k"], ds["kind"], ds["dtype"]) == (300, 4, "logits", "float64")
    assert len(ds["sha256"]) == 64 and r.headers["location"].endswith(f"/datasets/{ds['id']}")
    again = client.post(
        "/v1/models/m/datasets", json={"logits": logits.tolist(), "labels": labels.tolist()}
    )
    assert again.status_code == 200 and again.json()["id"] == ds["id"]  # identical content
    got = client.get(f"/v1/models/m/datasets/{ds['id']}").json()
    m = got["metrics"]
    for key in ("accuracy", "nll", "nll_median", "nll_p95", "ece", "entropy", "brier"):
        assert key in m
    expected = metrics.report(
        softmax(logits),
        labels,
    )
    assert m["accuracy"] == pytest.approx(expected["accuracy"])
    assert m["nll"] == pytest.approx(expected["nll"], rel=1e-9)
    listed = client.get("/v1/models/m/datasets").json()["datasets"]
    assert [d["id"] for d in listed] == [ds["id"]] and listed[0]["metrics"] is None


@pytest.mark.parametrize(
    "score_key,label_key",
    [("probabilities", "labels"), ("predictions", "ground_truth"), ("logits", "labels")],
)
def test_dataset_npz_upload(client, score_key, label_key):
    create_model(client, "m", 4)
    logits, labels = logits_data(seed=3)
    scores = logits.astype(np.float32)
    if score_key != "logits":
        scores = softmax(logits).astype(np.float32)
    body = npz_bytes(**{score_key: scores, label_key: labels})
    r = client.post(
        "/v1/models/m/datasets", content=body, headers={"content-type": "application/octet-stream"}
    )
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["kind"] == ("logits" if score_key == "logits" else "probabilities")
    assert ds["dtype"] == "float32" and (ds["n"], ds["k"]) == (300, 4)
    # The same bytes as a multipart file: deduplicated.
    r2 = client.post(
        "/v1/models/m/datasets", files={"file": ("d.npz", body, "application/octet-stream")}
    )
    assert r2.status_code == 200, r2.text
    assert r2.json()["id"] == ds["id"]


@pytest.mark.parametrize("route", ["datasets", "feedback"])
def test_a_single_npy_is_told_what_a_labelled_body_is(client, route):
    # issue 24: a plain .npy of logits got "not a .npz (zip) archive", not what to send
    create_model(client, "m", 4)
    logits, _ = logits_data(seed=3)
    buf = io.BytesIO()
    np.save(buf, logits)
    r = client.post(
        f"/v1/models/m/{route}",
        content=buf.getvalue(),
        headers={"content-type": "application/octet-stream"},
    )
    detail = assert_problem(r, 422, "single .npy", ".npz", "logits", "labels")["detail"]
    assert "probabilities" in detail and "zip" not in detail


def test_fit_lifecycle_alias_predict(client):
    create_model(client, "m", 4)
    logits, labels = logits_data(n=400)
    ds = upload(client, "m", logits, labels)
    r = client.post(
        "/v1/models/m/calibrators", json={"dataset_id": ds["id"], "method": "temperature"}
    )
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["version"] == 1 and accepted["status"] == "queued"
    assert accepted["status_url"] == "/v1/models/m/calibrators/1" == r.headers["location"]
    v = fit(client, "m", ds["id"], "temperature", holdout=0.25, seed=7)  # version 2
    assert v["version"] == 2 and v["status"] == "succeeded" and v["progress"] == 1.0
    assert v["chosen_method"] == "temperature" and v["fit_seconds"] > 0
    assert v["metrics"]["after"]["nll"] < v["metrics"]["before"]["nll"]  # over-confident input
    assert v["metrics"]["before"]["n"] == 100 and v["argmax"]["changed"] == 0
    # params are exactly what from_params accepts, and the holdout split is the documented one
    cal = calibrators.from_params(v["params"])
    perm = np.random.default_rng(7).permutation(400)
    hold = perm[300:]
    after = metrics.report(cal.predict_proba(logits[hold]), labels[hold])
    assert after["nll"] == pytest.approx(v["metrics"]["after"]["nll"], rel=1e-9)
    refit = calibrators.create("temperature").fit(logits[perm[:300]], labels[perm[:300]])
    assert refit.to_params()["weight"] == pytest.approx(v["params"]["weight"], rel=1e-9)

    versions = client.get("/v1/models/m/calibrators").json()["calibrators"]
    assert [x["version"] for x in versions] == [1, 2]

    assert_problem(
        client.post("/v1/models/m/predict", json={"logits": logits[:2].tolist()}), 404, "alias"
    )
    r = client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": 2})
    assert r.status_code == 200 and r.json()["version"] == 2
    assert client.get("/v1/models/m/aliases").json()["aliases"][0]["alias"] == DEFAULT_ALIAS

    x = logits[:5]
    r = client.post("/v1/models/m/predict", json={"logits": x.tolist()})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "m" and out["version"] == 2
    expected = cal.predict_proba(x)
    np.testing.assert_allclose(out["probabilities"], expected, atol=1e-6)
    np.testing.assert_array_equal(out["labels"], expected.argmax(1))
    np.testing.assert_allclose(out["confidence"], expected.max(1), atol=1e-6)
    entropy = -(expected * np.log(expected)).sum(1)
    np.testing.assert_allclose(out["entropy"], entropy, atol=1e-5)

    # .npy in, .npy out; the version travels in a header
    buf = io.BytesIO()
    np.save(buf, x.astype(np.float32))
    r = client.post(
        "/v1/models/m/predict",
        content=buf.getvalue(),
        headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    assert r.headers["x-welltempered-version"] == "2"
    np.testing.assert_allclose(np.load(io.BytesIO(r.content)), expected, atol=1e-6)

    # probabilities in: the same calibrated output
    p = softmax(x)
    r = client.post("/v1/models/m/predict?version=1", json={"probabilities": p.tolist()})
    v1 = calibrators.from_params(client.get("/v1/models/m/calibrators/1").json()["params"])
    np.testing.assert_allclose(
        r.json()["probabilities"], v1.predict_proba(p, kind="probabilities"), atol=1e-6
    )
    assert r.json()["version"] == 1

    # moving the alias is seen by the next request
    client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": 1})
    assert client.post("/v1/models/m/predict", json={"logits": x.tolist()}).json()["version"] == 1
    r = client.post(f"/v1/models/m/predict?alias={DEFAULT_ALIAS}", json={"logits": x.tolist()})
    assert r.json()["version"] == 1

    onnx = client.get("/v1/models/m/calibrators/2/onnx")
    assert onnx.status_code == 200 and onnx.content == cal.to_onnx()


def test_require_policy_rejects_and_409(client):
    create_model(client, "strict", 3)  # argmax_policy "require"
    logits, labels = shuffled_labels()
    ds = upload(client, "strict", logits, labels)
    v = fit(client, "strict", ds["id"], "matrix")
    assert v["status"] == "rejected" and v["argmax"]["changed"] > 0 and v["params"] is not None
    r = client.put(f"/v1/models/strict/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    body = assert_problem(r, 409, "argmax")
    assert body["argmax"]["changed"] == v["argmax"]["changed"]
    assert_problem(
        client.post(
            f"/v1/models/strict/predict?version={v['version']}",
            json={"logits": logits[:1].tolist()},
        ),
        409,
    )
    # auto under "require" tries only the methods that keep every argmax by construction
    a = fit(client, "strict", ds["id"], "auto")
    assert a["status"] == "succeeded" and a["argmax"]["changed"] == 0
    preserving = {  # (row-entropy keeps the argmax but learns nothing from labels)
        m for m, c in calibrators.CALIBRATORS.items() if c.preserves_argmax and c.learns_from_labels
    }
    assert "temperature" in preserving and "matrix" not in preserving
    assert set(a["candidates"]) == preserving
    assert all(c["allowed"] and c["argmax"]["changed"] == 0 for c in a["candidates"].values())
    assert a["chosen_method"] == race_leader(a["candidates"])
    assert a["metrics"]["after"] == a["candidates"][a["chosen_method"]]["metrics"]


def test_warn_policy_allows_with_warning(client):
    create_model(client, "lenient", 3, argmax_policy="warn")
    logits, labels = shuffled_labels()
    ds = upload(client, "lenient", logits, labels)
    # auto under "warn" tries every method and keeps the candidates' figures
    a = fit(client, "lenient", ds["id"], "auto")
    assert set(a["candidates"]) == set(auto_candidates("warn"))
    assert a["chosen_method"] == race_leader(a["candidates"])
    v = fit(client, "lenient", ds["id"], "matrix")
    assert v["status"] == "succeeded" and v["argmax"]["changed"] > 0
    assert "changed the predicted class" in v["warning"]
    r = client.put(f"/v1/models/lenient/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert r.status_code == 200


def test_failed_fit_records_the_error(client, settings):
    create_model(client, "m", 4)
    logits, labels = logits_data()
    ds = upload(client, "m", logits, labels)
    # Remove the array behind the dataset: the job fails, with the reason.
    for path in (settings.data_dir / "arrays").rglob("*.npy"):
        path.unlink()
    v = fit(client, "m", ds["id"])
    assert v["status"] == "failed" and "missing" in v["error"] and v["params"] is None
    assert_problem(
        client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]}),
        409,
        "failed",
    )
    assert_problem(client.get(f"/v1/models/m/calibrators/{v['version']}/onnx"), 409)
