"""The fit queue inside one process: attempts, cancel, fairness, the queue's gauges
(the same rules on SQLite's embedded queue and on PostgreSQL's job engine). The fleet
of processes is tested in tests/service/test_fleet.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from procrastinate.job_context import AbortReason
from prometheus_client.parser import text_string_to_metric_families

from service.api.app import create_app
from service.jobs import engine as engine_module
from service.jobs import local
from service.jobs.attempts import HANDED_BACK, WorkerConfig
from service.jobs.local import LocalQueue
from service.storage import fits, registry
from service.vocabulary import DEFAULT_NAMESPACE
from tests.oracles import wait_for_version
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    hold_queue,
    logits_data,
    make_settings,
    upload,
)


def version_id(client: TestClient, model: str, version: int) -> int:
    with client.app.state.welltempered.sessions() as s:
        return registry.find_version(
            s, registry.find_model(s, model, DEFAULT_NAMESPACE), version
        ).id


def submit(client: TestClient, model: str, dataset_id: int, method: str = "temperature", **extra):
    body = {"dataset_id": dataset_id, "method": method, **extra}
    r = client.post(f"/v1/models/{model}/calibrators", json=body)
    assert r.status_code == 202, r.text
    return r.json()["version"]


def test_only_the_current_attempt_writes_the_result(client):
    """A worker presumed dead finishes late: its result is discarded, the attempt that
    owns the version writes the one result."""
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    hold_queue(client)
    v = submit(client, "m", ds)
    vid = version_id(client, "m", v)
    sessions = client.app.state.welltempered.sessions
    first = fits.claim(sessions, vid, "a:1:worker", max_attempts=5)
    assert first.attempt == 1
    assert fits.claim(sessions, vid, "b:2:worker", max_attempts=5) == "running"  # no double claim
    assert fits.hand_back(sessions, vid)  # the reaper: worker a is silent
    second = fits.claim(sessions, vid, "b:2:worker", max_attempts=5)
    assert second.attempt == 2
    assert not fits.finish(sessions, vid, first.attempt, status="failed", error="late")
    assert not fits.hand_back(sessions, vid, first.attempt)
    assert fits.finish(sessions, vid, second.attempt, status="failed", error="the real one")
    body = client.get(f"/v1/models/m/calibrators/{v}").json()
    assert (body["attempts"], body["worker"], body["error"]) == (2, "b:2:worker", "the real one")


def test_attempts_are_capped(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    hold_queue(client)
    vid = version_id(client, "m", submit(client, "m", ds))
    sessions = client.app.state.welltempered.sessions
    for attempt in (1, 2):
        assert fits.claim(sessions, vid, "w", max_attempts=2).attempt == attempt
        assert fits.hand_back(sessions, vid, attempt)
    assert fits.claim(sessions, vid, "w", max_attempts=2) == "failed"
    assert "gave up after 2 attempts" in client.get("/v1/models/m/calibrators/1").json()["error"]


def test_cancel_a_queued_fit(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    done = fit(client, "m", ds)["version"]
    hold_queue(client)
    v = submit(client, "m", ds)
    r = client.post(f"/v1/models/m/calibrators/{v}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled" and r.json()["params"] is None
    body = assert_problem(client.post(f"/v1/models/m/calibrators/{v}/cancel"), 409, "cancelled")
    assert body["version_status"] == "cancelled"
    assert_problem(client.post(f"/v1/models/m/calibrators/{done}/cancel"), 409, "succeeded")
    assert_problem(client.post("/v1/models/m/calibrators/99/cancel"), 404)
    listed = client.get("/v1/models/m/calibrators").json()["calibrators"]
    assert [c["status"] for c in listed] == ["succeeded", "cancelled"]
    assert client.delete(f"/v1/models/m/calibrators/{v}").status_code == 200  # it has ended


@pytest.mark.slow
def test_cancel_a_running_fit_frees_the_worker(database_url, tmp_path):
    """A long Dirichlet fit in a child process: cancelled at once, killed within
    seconds, and the one worker goes on to the next fit."""
    settings = make_settings(database_url, tmp_path, fit_executor="process", fit_workers=1)
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 300, argmax_policy="off")
        z, y = logits_data(n=4000, k=300, seed=1)
        ds = upload(c, "m", z, y)["id"]
        slow = submit(c, "m", ds, "dirichlet")
        deadline = time.monotonic() + 60
        while c.get(f"/v1/models/m/calibrators/{slow}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        quick = submit(c, "m", ds, "temperature")
        t0 = time.monotonic()
        r = c.post(f"/v1/models/m/calibrators/{slow}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        after = wait_for_version(c, "m", quick, timeout=30)
        assert after["status"] == "succeeded", after
        assert time.monotonic() - t0 < 15  # the worker was freed: the dirichlet fit takes minutes
        assert c.get(f"/v1/models/m/calibrators/{slow}").json()["status"] == "cancelled"


def test_a_namespace_limit_names_the_namespace(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, max_queued_fits_per_namespace=2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create_model(c, "m", 4)
        z, y = logits_data()
        ds = upload(c, "m", z, y)["id"]
        hold_queue(c)
        submit(c, "m", ds)
        submit(c, "m", ds)
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds, "method": "temperature"})
        body = assert_problem(r, 429, "QUEUED_FITS_PER_NAMESPACE")
        assert body["namespace"] == DEFAULT_NAMESPACE and body["limit"] == 2
        assert int(r.headers["retry-after"]) > 0
        c.post("/v1/models/m/calibrators/1/cancel")
        assert (
            c.post(
                "/v1/models/m/calibrators", json={"dataset_id": ds, "method": "temperature"}
            ).status_code
            == 202
        )


def test_the_embedded_queue_is_round_robin_across_namespaces(monkeypatch):
    """Namespace a queues four fits, then b two: with one worker they run a, b, a, b, a, a;
    at most ``running_per_namespace`` of a namespace at once."""
    ran: list[int] = []
    gate = threading.Event()

    def execute(version_id, config, sessions, worker, stop, on_cache=None):
        gate.wait(10)
        ran.append(version_id)
        return "succeeded"

    monkeypatch.setattr(local, "execute", execute)
    monkeypatch.setattr(local.fits, "requeue_running", lambda sessions: 0)
    monkeypatch.setattr(local.fits, "queued", lambda sessions: [])
    queue = LocalQueue(WorkerConfig("sqlite://", "/nowhere", 1.0), None, workers=1)
    queue.start()
    for vid in (1, 2, 3, 4):
        queue.submitted(vid, "a")
    for vid in (11, 12):
        queue.submitted(vid, "b")
    gate.set()
    deadline = time.monotonic() + 10
    while len(ran) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.stop()
    assert ran == [1, 11, 2, 12, 3, 4]


def test_the_embedded_queue_hands_back_on_stop(monkeypatch):
    """Stopping waits up to the grace period, then the running attempt is told to stop."""
    reasons: list[str | None] = []

    def execute(version_id, config, sessions, worker, stop, on_cache=None):
        while (reason := stop()) is None:
            time.sleep(0.01)
        reasons.append(reason)
        return HANDED_BACK

    monkeypatch.setattr(local, "execute", execute)
    monkeypatch.setattr(local.fits, "requeue_running", lambda sessions: 0)
    monkeypatch.setattr(local.fits, "queued", lambda sessions: [])
    queue = LocalQueue(WorkerConfig("sqlite://", "/nowhere", 1.0), None, grace_seconds=0.3)
    queue.start()
    queue.submitted(1, "a")
    time.sleep(0.1)
    t0 = time.monotonic()
    queue.stop()
    assert reasons == ["shutdown"] and 0.2 < time.monotonic() - t0 < 5


def gauges(client: TestClient) -> dict[str, dict[tuple, float]]:
    text = client.get("/metrics").text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_queue_gauges_come_from_the_database(client, database_url):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    fit(client, "m", ds)
    hold_queue(client)
    submit(client, "m", ds)
    g = gauges(client)
    ns = ("namespace", DEFAULT_NAMESPACE)
    assert g["welltempered_fit_jobs"][(ns, ("status", "queued"))] == 1
    assert g["welltempered_fit_jobs"][(ns, ("status", "succeeded"))] == 1
    assert g["welltempered_fit_jobs"][(ns, ("status", "cancelled"))] == 0
    assert 0 <= g["welltempered_fit_queue_oldest_seconds"][(ns,)] < 60
    assert g["welltempered_fit_retries"][(ns,)] == 0
    took = [g["welltempered_fit_seconds"][(ns, ("quantile", q))] for q in ("0.5", "0.95", "1")]
    assert 0 < took[0] <= took[1] <= took[2] and np.isfinite(took).all()
    assert g["welltempered_fit_wait_seconds"][(ns, ("quantile", "1"))] >= 0
    if database_url.startswith("sqlite"):
        assert "welltempered_fit_workers_alive" not in g
    else:  # the serve process's own worker, registered with its heartbeat
        assert g["welltempered_fit_workers_alive"][()] == 1


@pytest.mark.parametrize(("status", "want"), [("cancelled", "cancel"), ("running", None)])
def test_an_abort_request_stops_a_fit_only_when_its_version_was_cancelled(
    monkeypatch, status, want
):
    """An abort request reaches the worker by a NOTIFY naming a job id, heard by every
    listener of the database: the job of the same id in another schema (each test has
    its own) stopped a running fit and left its version running with its job done (the
    e2e CIFAR-100 fit of the full suite). The fit stops only if its own version is
    cancelled; a shutdown still stops it."""
    seen = []

    def execute(version_id, config, sessions, worker, stop, on_cache=None):
        seen.append(stop())
        return "succeeded"

    class Context:
        def __init__(self, reason):
            self.reason = reason

        def abort_reason(self):
            return self.reason

    monkeypatch.setattr(engine_module, "execute", execute)
    monkeypatch.setattr(engine_module.fits, "status_of", lambda sessions, vid: status)
    engine = engine_module.JobEngine(
        WorkerConfig("postgresql+psycopg://nobody@127.0.0.1:1/none", "/nowhere", 1.0), None
    )
    engine._fit(Context(AbortReason.USER_REQUEST), 7)
    engine._fit(Context(AbortReason.SHUTDOWN), 7)
    engine._fit(Context(None), 7)
    assert seen == [want, "shutdown", None]
