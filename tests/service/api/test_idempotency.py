"""Idempotency-Key on every unsafe route that can duplicate work (feedback as JSON and
.npz, dataset uploads as JSON, .npz and multipart, fits, imports), on both backends.

The rules of draft-ietf-httpapi-idempotency-key-header ("Idempotency Fingerprint",
"Error Scenarios"), kept by service/api/idempotent.py and service/storage/idempotency.py:
the same request again with the key is the first answer (``Idempotent-Replayed: true``),
applied once; the key with another request (another body, query or model) is a 422
``idempotency-key-reused`` problem, an invalid body included; while the first request
with the key is in flight, a 409 ``idempotency-key-in-flight`` problem with
``Retry-After``, until the first's lease passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

import calibrators
from service.errors import IdempotencyKeyInFlight
from service.storage import idempotency
from service.storage.db import IdempotencyKey, Model, utcnow
from service.vocabulary import DEFAULT_ALIAS, IN_FLIGHT
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    hold_queue,
    logits_data,
    npz,
    upload,
)
from tests.service.server.test_db_faults import FailNext

MODEL = "/v1/models/m"
OCTET = {"content-type": "application/octet-stream"}
LEASE = 60.0  # the default WELLTEMPERED_IDEMPOTENCY_LEASE_SECONDS


@pytest.fixture
def ready(client):
    """A model (K=3) with a dataset and an aliased version; fits submitted from here on
    stay queued (the tests count versions, they need no fitting)."""
    create_model(client, "m", k=3)
    z, y = logits_data(300, 3)
    dataset = upload(client, "m", z, y)
    v = fit(client, "m", dataset["id"], method="temperature")
    r = client.put(f"{MODEL}/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert r.status_code == 200, r.text
    hold_queue(client)
    params = calibrators.create("temperature").fit(z, y).to_params()
    return client, {"z": z, "y": y, "dataset_id": dataset["id"], "params": params}


def _rows(n: int, seed: int):
    return logits_data(n, 3, seed=seed)


# Each route: (url, request kwargs for variant i: 0 and 1 are two different valid requests,
# "bad" an invalid one, and how many things the route has made (rows, datasets, versions).
Request = Callable[[dict, Any], dict]


def feedback_json(d, i):
    if i == "bad":
        return {"json": {"logits": [[1.0, 2.0]], "labels": [0]}}  # K=2, the model has 3
    return {
        "json": {
            "logits": d["z"][i * 20 : i * 20 + 20].tolist(),
            "labels": d["y"][i * 20 : i * 20 + 20].tolist(),
        }
    }


def feedback_npz(d, i):
    if i == "bad":
        return {"content": b"PK\x03\x04 not a zip", "headers": OCTET}
    rows = slice(i * 20, i * 20 + 20)
    return {"content": npz(logits=d["z"][rows], labels=d["y"][rows]), "headers": OCTET}


def dataset_json(d, i):
    if i == "bad":
        return {"json": {"logits": [[1.0, 2.0]], "labels": [0]}}  # K=2, the model has 3
    z, y = _rows(50, seed=10 + i)
    return {"json": {"logits": z.tolist(), "labels": y.tolist()}}


def dataset_npz(d, i):
    if i == "bad":
        return {"content": b"not an npz", "headers": OCTET}
    z, y = _rows(50, seed=20 + i)
    return {"content": npz(logits=z, labels=y), "headers": OCTET}


def dataset_multipart(d, i):
    if i == "bad":
        return {"files": {"file": ("d.npz", b"not an npz", "application/octet-stream")}}
    z, y = _rows(50, seed=30 + i)
    return {"files": {"file": ("d.npz", npz(logits=z, labels=y), "application/octet-stream")}}


def fit_request(d, i):
    if i == "bad":
        return {"json": {"dataset_id": d["dataset_id"], "method": "no-such-method"}}
    return {"json": {"dataset_id": d["dataset_id"], "method": "temperature", "seed": i}}


def import_request(d, i):
    if i == "bad":
        return {"json": {"dataset_id": d["dataset_id"], "params": {"method": "bogus"}}}
    return {"json": {"dataset_id": d["dataset_id"], "params": d["params"], "seed": i}}


def live_rows(client) -> int:
    return client.get(f"{MODEL}/monitoring", params={"window": "1h"}).json()["live"]["n"]


def n_datasets(client) -> int:
    return len(client.get(f"{MODEL}/datasets").json()["datasets"])


def n_versions(client) -> int:
    return len(client.get(f"{MODEL}/calibrators").json()["calibrators"])


ROUTES = {
    "feedback-json": (f"{MODEL}/feedback", feedback_json, live_rows),
    "feedback-npz": (f"{MODEL}/feedback", feedback_npz, live_rows),
    "dataset-json": (f"{MODEL}/datasets", dataset_json, n_datasets),
    "dataset-npz": (f"{MODEL}/datasets", dataset_npz, n_datasets),
    "dataset-multipart": (f"{MODEL}/datasets", dataset_multipart, n_datasets),
    "fit": (f"{MODEL}/calibrators", fit_request, n_versions),
    "import": (f"{MODEL}/calibrators/import", import_request, n_versions),
}


@pytest.fixture(params=list(ROUTES))
def route(request):
    return ROUTES[request.param]


def post(client, url: str, kwargs: dict, key: str | None):
    kwargs = dict(kwargs)
    if key is not None:
        kwargs["headers"] = {**kwargs.get("headers", {}), "Idempotency-Key": key}
    return client.post(url, **kwargs)


def sessions(client):
    return client.app.state.welltempered.sessions


def test_the_same_request_again_is_the_first_answer_applied_once(ready, route):
    client, d = ready
    url, make, count = route
    first = post(client, url, make(d, 0), "k-1")
    assert first.status_code in (200, 201, 202), first.text
    assert "idempotent-replayed" not in first.headers
    made = count(client)
    again = post(client, url, make(d, 0), "k-1")
    assert again.status_code == first.status_code
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers.get("location") == first.headers.get("location")
    assert count(client) == made  # applied once
    other = post(client, url, make(d, 0), "k-2")  # another key: another request
    assert other.status_code in (200, 201, 202) and "idempotent-replayed" not in other.headers


def test_the_key_with_another_request_is_a_422_and_changes_nothing(ready, route):
    client, d = ready
    url, make, count = route
    first = post(client, url, make(d, 0), "k-1")
    assert first.status_code in (200, 201, 202), first.text
    made = count(client)
    for variant in (1, "bad"):  # an invalid body is judged by its fingerprint first
        r = post(client, url, make(d, variant), "k-1")
        body = assert_problem(r, 422, "k-1")
        assert body["type"] == "/problems/idempotency-key-reused", r.text
        assert body["idempotency_key"] == "k-1"
        assert "idempotent-replayed" not in r.headers
    assert count(client) == made
    # the first request is still the key's: its retry is still answered
    again = post(client, url, make(d, 0), "k-1")
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"


def _in_flight_copy(client, done_key: str, key: str, age: float = 0.0) -> None:
    """Row ``key`` in flight for the request ``done_key`` was made for (its route and
    fingerprint), begun ``age`` seconds ago by an attempt that is not this test's: the
    state a request leaves while it runs, made without racing one."""
    with sessions(client)() as s:
        done = s.scalar(select(IdempotencyKey).where(IdempotencyKey.key == done_key))
        s.add(
            IdempotencyKey(
                namespace=done.namespace,
                key=key,
                model_id=done.model_id,
                route=done.route,
                fingerprint=done.fingerprint,
                state=IN_FLIGHT,
                attempt="someone-else",
                created_at=utcnow() - timedelta(seconds=age),
            )
        )
        s.commit()


def test_a_request_while_the_first_is_in_flight_is_a_409_until_its_lease_passes(ready, route):
    client, d = ready
    url, make, count = route
    assert post(client, url, make(d, 0), "done").status_code in (200, 201, 202)
    _in_flight_copy(client, "done", "running")
    made = count(client)
    r = post(client, url, make(d, 0), "running")
    body = assert_problem(r, 409, "running")
    assert (
        body["type"] == "/problems/idempotency-key-in-flight"
        and body["idempotency_key"] == "running"
    )
    assert 1 <= int(r.headers["retry-after"]) <= LEASE
    # another request with the key is a 422 even while the first runs
    assert_problem(post(client, url, make(d, 1), "running"), 422, "running")
    assert count(client) == made
    # the first attempt outlived its lease: presumed lost, the retry takes the key over
    with sessions(client)() as s:
        s.execute(
            update(IdempotencyKey)
            .where(IdempotencyKey.key == "running")
            .values(created_at=utcnow() - timedelta(seconds=LEASE + 1))
        )
        s.commit()
    taken = post(client, url, make(d, 0), "running")
    assert taken.status_code in (200, 201, 202), taken.text
    assert "idempotent-replayed" not in taken.headers
    again = post(client, url, make(d, 0), "running")
    assert again.json() == taken.json() and again.headers["idempotent-replayed"] == "true"


def test_a_retry_racing_the_first_request_is_a_409(ready, monkeypatch):
    """A real race: the first fit request is held inside its handler while the retry
    arrives."""
    client, d = ready
    from service.api.routers import calibrators as router

    entered, go = threading.Event(), threading.Event()
    check = router.check_fit_request

    def held(*args, **kwargs):
        entered.set()
        assert go.wait(30)
        return check(*args, **kwargs)

    monkeypatch.setattr(router, "check_fit_request", held)
    url, kwargs = f"{MODEL}/calibrators", fit_request(d, 0)
    answers = []
    first = threading.Thread(target=lambda: answers.append(post(client, url, kwargs, "race")))
    first.start()
    try:
        assert entered.wait(30)
        monkeypatch.setattr(router, "check_fit_request", check)
        r = post(client, url, kwargs, "race")
        assert_problem(r, 409, "race")
        assert r.headers["retry-after"]
    finally:
        go.set()
        first.join(30)
    assert answers[0].status_code == 202, answers[0].text
    again = post(client, url, kwargs, "race")
    assert again.json() == answers[0].json() and again.headers["idempotent-replayed"] == "true"


def test_a_failed_request_frees_its_key(ready):
    """Errors are not stored: a request refused with the key may be corrected and sent
    again with it."""
    client, d = ready
    url = f"{MODEL}/datasets"
    r = post(client, url, dataset_json(d, "bad"), "fix-me")
    assert assert_problem(r, 422)["type"] == "/problems/invalid-input"
    r = post(client, url, dataset_json(d, 0), "fix-me")
    assert r.status_code == 201 and "idempotent-replayed" not in r.headers


def test_a_write_that_fails_with_a_key_is_not_applied_and_the_retry_runs(ready):
    """The key's in-flight row is bookkeeping: a write failing after it is still
    'applied: no', and the key is free again for the retry."""
    client, d = ready
    before = live_rows(client)
    fault = FailNext(client.app.state.welltempered.engine, "INSERT INTO feedback_bins")
    try:
        r = post(client, f"{MODEL}/feedback", feedback_json(d, 0), "flaky")
    finally:
        fault.remove()
    assert assert_problem(r, 503)["applied"] == "no"
    r = post(client, f"{MODEL}/feedback", feedback_json(d, 0), "flaky")
    assert r.status_code == 200 and "idempotent-replayed" not in r.headers
    assert live_rows(client) == before + 20


def test_the_fingerprint_has_the_declared_query_parameters_only(ready):
    client, d = ready
    url = f"{MODEL}/datasets"
    assert post(client, url, dataset_json(d, 0), "q").status_code == 201
    again = post(client, f"{url}?unrelated=1", dataset_json(d, 0), "q")
    assert again.headers["idempotent-replayed"] == "true"
    assert_problem(post(client, f"{url}?kind=logits", dataset_json(d, 0), "q"), 422, "q")


def test_an_attempt_whose_key_was_taken_over_cannot_store_its_answer(ready):
    """After its lease, a retry takes the key over; the first attempt, if it still ends,
    fails to store its answer (its write rolls back) and the retry's answer stands."""
    client, _ = ready
    with sessions(client)() as s:
        model = s.scalar(select(Model).where(Model.name == "m"))
        args = dict(model_id=model.id, route="POST /x", fingerprint="f" * 64, ttl=3600.0)
        first = idempotency.begin(s, model.namespace, "lost", lease=LEASE, **args)
        assert isinstance(first, idempotency.Attempt)
        with pytest.raises(IdempotencyKeyInFlight):
            idempotency.begin(s, model.namespace, "lost", lease=LEASE, **args)
        retry = idempotency.begin(s, model.namespace, "lost", lease=0.0, **args)  # lease over
        assert isinstance(retry, idempotency.Attempt) and retry.token != first.token
        with pytest.raises(IdempotencyKeyInFlight):
            idempotency.complete(s, first, 200, {"by": "first"}, {})
        s.rollback()
        idempotency.release(s, first)  # not its row any more: nothing happens
        idempotency.complete(s, retry, 200, {"by": "retry"}, {})
        s.commit()
        done = idempotency.begin(s, model.namespace, "lost", lease=LEASE, **args)
        assert isinstance(done, IdempotencyKey) and done.response == {"by": "retry"}


def test_every_unsafe_route_documents_the_header(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/models/{model}/feedback",
        "/v1/models/{model}/datasets",
        "/v1/models/{model}/calibrators",
        "/v1/models/{model}/calibrators/import",
    ):
        params = paths[path]["post"]["parameters"]
        header = [p for p in params if (p["in"], p["name"]) == ("header", "Idempotency-Key")]
        assert len(header) == 1, path
        assert "422" in header[0]["description"] and "409" in header[0]["description"]


def test_a_key_stored_before_fingerprints_is_judged_by_route_and_model(ready):
    """Rows migrated from before fingerprints (feedback answers, fingerprint NULL) are
    replayed for a feedback post to the same model, as they were; anything else is a 422."""
    client, d = ready
    with sessions(client)() as s:
        model = s.scalar(select(Model).where(Model.name == "m"))
        s.add(
            IdempotencyKey(
                namespace=model.namespace,
                key="legacy",
                model_id=model.id,
                route="POST /v1/models/{model}/feedback",
                state="done",
                status_code=200,
                response={"rows": 5},
                created_at=utcnow(),
            )
        )
        s.commit()
    before = live_rows(client)
    r = post(client, f"{MODEL}/feedback", feedback_json(d, 0), "legacy")
    assert r.json() == {"rows": 5} and r.headers["idempotent-replayed"] == "true"
    assert live_rows(client) == before
    assert_problem(post(client, f"{MODEL}/datasets", dataset_json(d, 0), "legacy"), 422)
