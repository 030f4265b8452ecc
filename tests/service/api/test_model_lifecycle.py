"""Lifecycle beyond create and delete (issue 13, item 3): PATCH of a model, rejection
reasons on the version, class names in predictions, and versions from posted
parameters; on SQLite and PostgreSQL. Pagination is tests/service/api/test_pagination.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import calibrators
from calibrators.evaluation import metrics
from calibrators.evaluation.holdout import split_indices
from service.api.app import create_app
from service.offline import main as offline_main
from service.vocabulary import DEFAULT_ALIAS, FITTED
from tests.oracles import wait_for_version
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    hold_queue,
    import_params,
    logits_data,
    make_settings,
    npz,
    promote,
    upload,
)
from tests.strategies import JSON_VALUES

NAMES = ["cat", "dog", "eel", "fox"]
IMPORT = "/v1/models/m/calibrators/import"


def shuffled_labels(n=400, k=3, seed=1):
    """Labels that are the class after the argmax: matrix scaling learns to permute the
    classes, so it changes held-out predictions."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    return logits, (logits.argmax(axis=1) + 1) % k


@pytest.fixture(scope="module")
def named(module_client) -> dict:
    """Model ``named`` (K = 4, class_names :data:`NAMES`) of ``module_client``, as created:
    the refused PATCH requests must leave it so."""
    return create_model(module_client, "named", 4, class_names=NAMES)


@pytest.fixture(scope="module")
def m_dataset(module_client) -> int:
    """Model ``m`` (K = 4) of ``module_client`` with one dataset (its id) and no version:
    the refused imports must leave it so."""
    create_model(module_client, "m", 4)
    return upload(module_client, "m", *logits_data(100, 4))["id"]


# ---------------------------------------------------------------------------
# PATCH /v1/models/{model}


def test_patch_changes_only_the_fields_given(client):
    created = create_model(client, "m", 4, description="first")
    assert created["description"] == "first" and created["updated_at"] is None
    r = client.patch("/v1/models/m", json={"class_names": NAMES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["class_names"] == NAMES
    assert (body["argmax_policy"], body["description"]) == ("require", "first")
    assert body["updated_at"] is not None
    r = client.patch("/v1/models/m", json={"argmax_policy": "off", "description": None})
    assert (r.json()["argmax_policy"], r.json()["description"]) == ("off", None)
    got = client.get("/v1/models/m").json()
    assert got["class_names"] == NAMES and got["argmax_policy"] == "off"
    assert got["description"] is None
    assert client.patch("/v1/models/m", json={"class_names": None}).json()["class_names"] is None
    assert client.patch("/v1/models/m", json={}).json() == client.get("/v1/models/m").json()


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"class_names": ["a", "b", "c"]}, "num_classes=4"),
        ({"class_names": ["a", "a", "b", "c"]}, "distinct"),
        ({"argmax_policy": None}, "argmax_policy"),
        ({"argmax_policy": "sometimes"}, "argmax_policy"),
        ({"name": "other"}, "name"),
        ({"num_classes": 5}, "num_classes"),
        ({"description": "x" * 1025}, "description"),
        ({"class_names": "cat"}, "class_names"),
    ],
)
def test_patch_refusals(module_client, named, body, word):
    r = module_client.patch("/v1/models/named", json=body)
    assert_problem(r, 422)
    assert word in r.text
    assert module_client.get("/v1/models/named").json() == named  # unchanged


def test_patch_needs_json_and_an_existing_model(client):
    create_model(client, "m", 4)
    assert_problem(client.patch("/v1/models/m", content=b"{}"), 415)
    assert_problem(client.patch("/v1/models/nope", json={"description": "x"}), 404)


def test_policy_change_applies_to_the_next_fit_and_rejections_say_why(client):
    create_model(client, "m", 3)  # argmax_policy "require"
    logits, labels = shuffled_labels()
    ds = upload(client, "m", logits, labels)
    rejected = fit(client, "m", ds["id"], "matrix")
    assert rejected["status"] == "rejected"
    [reason] = rejected["rejection"]
    changed = rejected["argmax"]["changed"]
    assert f"matrix calibration changed the predicted class of {changed} of " in reason
    assert "argmax_policy 'require'" in reason
    # the reason is on the stored version, not only in the alias refusal
    again = client.get(f"/v1/models/m/calibrators/{rejected['version']}").json()
    assert again["rejection"] == rejected["rejection"]
    kept = fit(client, "m", ds["id"], "temperature")
    assert kept["status"] == "succeeded" and kept["rejection"] is None

    assert client.patch("/v1/models/m", json={"argmax_policy": "warn"}).status_code == 200
    warned = fit(client, "m", ds["id"], "matrix")
    assert warned["status"] == "succeeded" and warned["rejection"] is None
    assert "argmax_policy 'warn' allows it" in warned["warning"]
    # a version keeps the outcome of its own fit: rejected stays rejected
    assert client.get(f"/v1/models/m/calibrators/{rejected['version']}").json()["status"] == (
        "rejected"
    )
    r = client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": warned["version"]})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------
# class names in predictions


def test_predict_answers_class_names_when_the_model_has_them(client):
    create_model(client, "m", 4, class_names=NAMES)
    z, y = logits_data(300, 4)
    promote(client, "m", upload(client, "m", z, y)["id"])
    x = z[:5].tolist()
    body = client.post("/v1/models/m/predict", json={"logits": x}).json()
    assert body["label_names"] == [NAMES[i] for i in body["labels"]]
    top = client.post("/v1/models/m/predict?top_k=2", json={"logits": x}).json()
    assert top["top_k_names"] == [[NAMES[i] for i in row] for row in top["top_k_indices"]]
    assert top["label_names"] == body["label_names"]
    # renamed: the next answer in this process uses the new names
    renamed = [n.upper() for n in NAMES]
    assert client.patch("/v1/models/m", json={"class_names": renamed}).status_code == 200
    body = client.post("/v1/models/m/predict", json={"logits": x}).json()
    assert body["label_names"] == [renamed[i] for i in body["labels"]]
    # no names: no name fields
    assert client.patch("/v1/models/m", json={"class_names": None}).status_code == 200
    body = client.post("/v1/models/m/predict?top_k=2", json={"logits": x}).json()
    assert "label_names" not in body and "top_k_names" not in body


# ---------------------------------------------------------------------------
# POST /v1/models/{model}/calibrators/import


def _expected(cal, z, y, holdout=0.2, seed=0):
    _, hold = split_indices(len(y), holdout, seed)
    return metrics.report(cal.predict_proba(z[hold]), y[hold])


def test_import_evaluates_posted_params_like_a_fit(client):
    create_model(client, "m", 4)
    z, y = logits_data(400, 4, seed=3)
    ds = upload(client, "m", z, y)
    fit_rows, _ = split_indices(len(y), 0.5, 7)
    cal = calibrators.create("temperature").fit(z[fit_rows], y[fit_rows])
    r = client.post(
        IMPORT,
        json={"dataset_id": ds["id"], "params": cal.to_params(), "holdout": 0.5, "seed": 7},
    )
    assert r.status_code == 202, r.text  # queued like a fit
    queued = r.json()
    assert queued["status"] == "queued"
    assert r.headers["location"] == queued["status_url"] == "/v1/models/m/calibrators/1"
    v = wait_for_version(client, "m", queued["version"])
    assert (v["status"], v["source"], v["method"], v["chosen_method"]) == (
        "succeeded", "params", "temperature", "temperature"
    )
    assert v["params"]["weight"] == cal.to_params()["weight"]
    assert (v["holdout"], v["seed"], v["dataset_id"]) == (0.5, 7, ds["id"])
    want = _expected(cal, z, y, 0.5, 7)
    assert v["metrics"]["after"]["nll"] == pytest.approx(want["nll"], rel=1e-12)
    assert v["metrics"]["after"]["n"] == want["n"] == 200
    assert v["argmax"]["changed"] == 0 and v["rejection"] is None
    assert client.get(f"/v1/models/m/calibrators/{v['version']}").json() == v
    # servable like a fitted version, and it predicts what the calibrator predicts
    r = client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert r.status_code == 200, r.text
    got = client.post("/v1/models/m/predict", json={"logits": z[:8].tolist()}).json()
    np.testing.assert_allclose(got["probabilities"], cal.predict_proba(z[:8]), atol=1e-6)


def test_import_of_a_matrix_larger_than_a_metadata_body(client):
    """K x K weights: 1.4 MB of params at K = 250, over MAX_METADATA_BYTES (1 MiB), under
    MAX_JSON_BYTES, the import's limit (it was a 413)."""
    k = 250
    create_model(client, "m", k, argmax_policy="warn")
    z, y = logits_data(300, k, seed=1)
    ds = upload(client, "m", z, y)
    params = calibrators.create("matrix", reg_lambda=10.0, reg_mu=10.0).fit(z, y).to_params()
    assert len(json.dumps(params)) > client.app.state.welltempered.settings.max_metadata_bytes
    v = import_params(client, "m", ds["id"], params)
    assert (v["status"], v["method"]) == ("succeeded", "matrix"), v


def test_import_takes_the_params_of_welltempered_fit_json(client, tmp_path):
    create_model(client, "m", 4)
    z, y = logits_data(300, 4, seed=5)
    (tmp_path / "d.npz").write_bytes(npz(logits=z, labels=y))
    out = tmp_path / "fit.json"
    code = offline_main([str(tmp_path / "d.npz"), "--method", "ets", "--json", str(out)])
    assert code == 0
    params = json.loads(out.read_text())["methods"]["ets"]["params"]
    ds = upload(client, "m", z, y)
    v = import_params(client, "m", ds["id"], params)
    assert v["status"] == "succeeded" and v["method"] == "ets"
    want = _expected(calibrators.from_params(params), z, y)
    assert v["metrics"]["after"]["nll"] == pytest.approx(want["nll"], rel=1e-12)


def test_imported_params_are_policed_by_the_argmax_policy(client):
    create_model(client, "m", 3)  # require
    logits, labels = shuffled_labels()
    ds = upload(client, "m", logits, labels)
    cal = calibrators.create("matrix", reg_lambda=0.0).fit(logits, labels)
    v = import_params(client, "m", ds["id"], cal.to_params())
    assert v["status"] == "rejected" and v["argmax"]["changed"] > 0
    assert "matrix calibration changed the predicted class" in v["rejection"][0]
    r = client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert_problem(r, 409, "argmax")


def test_an_import_is_a_job_of_the_fit_queue(database_url, tmp_path):
    """Queued like a fit: the queue's limits count it, a fit counts against it, it can be
    cancelled, and its posted params are not answered before it is evaluated."""
    config = make_settings(database_url, tmp_path, max_queued_fits_per_namespace=1)
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(100, 4))["id"]
        hold_queue(c)
        r = c.post(IMPORT, json={"dataset_id": ds, "params": _valid_params()})
        assert r.status_code == 202, r.text
        v = c.get(r.headers["location"]).json()
        assert (v["status"], v["source"], v["params"], v["metrics"]) == (
            "queued", "params", None, None
        )
        assert_problem(c.post(IMPORT, json={"dataset_id": ds, "params": _valid_params()}),
                       429, "QUEUED_FITS_PER_NAMESPACE")
        assert_problem(c.post("/v1/models/m/calibrators", json={"dataset_id": ds}), 429)
        r = c.post(f"{r.headers['location']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text


@pytest.mark.slow
@pytest.mark.process
def test_an_import_runs_in_a_fit_worker_process(database_url, tmp_path):
    """The evaluation runs where fits run: in a child process of the fit worker, never in
    the API's threads (the task, posted params included, crosses the process boundary)."""
    config = make_settings(database_url, tmp_path, fit_executor="process")
    with TestClient(create_app(config)) as c:
        create_model(c, "m", 4, argmax_policy="off")
        z, y = logits_data(400, 4, seed=3)
        ds = upload(c, "m", z, y)["id"]
        cal = calibrators.create("vector").fit(z, y)
        v = import_params(c, "m", ds, cal.to_params())
        assert (v["status"], v["source"], v["attempts"]) == ("succeeded", "params", 1), v
        assert v["metrics"]["after"]["nll"] == pytest.approx(_expected(cal, z, y)["nll"])


def _valid_params():
    z, y = logits_data(100, 4)
    return calibrators.create("vector").fit(z, y).to_params()


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"n_classes": 3}, "n_classes"),
        ({"n_classes": True}, "n_classes"),
        ({"method": "nope"}, "nope"),
        ({"method": None}, "method"),
        ({"weight": [1.0, 2.0]}, "weight"),
        ({"weight": "abc"}, "weight"),
        ({"bias": [[1.0]] * 4}, "bias"),
        ({"format": "other/9"}, "format"),
        ({"options": {"lambda": 1}}, "lambda"),
        ({"fit_info": [1, 2]}, "fit_info must be an object"),
        ({"fit_info": "ab"}, "fit_info must be an object"),
        ({"fit_info": [["converged", True]]}, "fit_info must be an object"),
        ({"fit_info": 3}, "fit_info must be an object"),
        ({"weight": ["1", "2", "3", "4"]}, "weight for vector must be numbers"),
        ({"weight": [True, False, True, True]}, "weight for vector must be numbers"),
        ({"bias": [10**400, 0, 0, 0]}, "bias for vector must be numbers"),
        ({"options": {"tol": 10**400}}, "tol"),
        ({"options": {"max_iter": 10**400}}, "max_iter must be an integer >= 1 and <= 1000000"),
    ],
)
def test_import_refusals(module_client, m_dataset, change, word):
    params = {**_valid_params(), **change}
    r = module_client.post(IMPORT, json={"dataset_id": m_dataset, "params": params})
    assert_problem(r, 422, word)
    assert module_client.get("/v1/models/m/calibrators").json()["calibrators"] == []


def test_import_refuses_a_foreign_dataset_and_a_bad_split(client):
    create_model(client, "m", 4)
    create_model(client, "other", 4)
    ds = upload(client, "other", *logits_data(100, 4))
    params = _valid_params()
    r = client.post(IMPORT, json={"dataset_id": ds["id"], "params": params})
    assert_problem(r, 404)
    mine = upload(client, "m", *logits_data(3, 4, seed=9))
    r = client.post(
        IMPORT,
        json={"dataset_id": mine["id"], "params": params, "holdout": 0.01},
    )
    assert_problem(r, 422)
    r = client.post(IMPORT, json={"dataset_id": mine["id"]})
    assert_problem(r, 422)


KEYS = st.sampled_from(["format", "method", "n_classes", "options", "weight", "bias",
                        "fit_info", "extra"])


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.dictionaries(KEYS, JSON_VALUES, min_size=1, max_size=3),
       method=st.sampled_from(sorted(calibrators.METHODS)))
def test_any_params_are_a_202_or_a_422(client, changes, method):
    if client.get("/v1/models/m").status_code == 404:
        create_model(client, "m", 4)
        upload(client, "m", *logits_data(100, 4))
    params = {"method": method, "n_classes": 4, **changes}
    r = client.post(IMPORT, json={"dataset_id": 1, "params": params})
    assert r.status_code in (202, 422), r.text
    if r.status_code == 202:  # refused now, or evaluated: never a failed job
        assert wait_for_version(client, "m", r.json()["version"])["status"] in FITTED
