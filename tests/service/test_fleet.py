"""A fleet on one PostgreSQL database: API replicas and fit workers as real processes.

Workers send a heartbeat every 0.5 s and are presumed dead after 3 s of silence, so
the retries these tests wait for take seconds, not the production 30 s.
"""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from service.security.keys import create_key
from service.storage.db import make_engine
from tests.oracles import wait_for_version
from tests.service.helpers import logits_data
from tests.service.servers import Server, Worker

pytestmark = [pytest.mark.slow, pytest.mark.process]

FAST_HEARTBEATS = {"worker_heartbeat_seconds": "0.5", "worker_stalled_seconds": "3"}


@pytest.fixture
def fleet_db(pg_schema) -> str:
    from service.storage import migrate

    migrate.upgrade(pg_schema)
    return pg_schema


def npz(z: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, logits=z.astype(np.float32), labels=y)
    return buf.getvalue()


def prepare(c: httpx.Client, model: str, n: int, k: int) -> int:
    r = c.post("/v1/models", json={"name": model, "num_classes": k, "argmax_policy": "off"})
    assert r.status_code == 201, r.text
    z, y = logits_data(n=n, k=k, seed=1)
    r = c.post(
        f"/v1/models/{model}/datasets",
        content=npz(z, y),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    return r.json()["id"]


def submit(c: httpx.Client, model: str, ds: int, method: str, seed: int = 0) -> int:
    r = c.post(
        f"/v1/models/{model}/calibrators", json={"dataset_id": ds, "method": method, "seed": seed}
    )
    assert r.status_code == 202, r.text
    return r.json()["version"]


def version(c: httpx.Client, model: str, v: int) -> dict:
    r = c.get(f"/v1/models/{model}/calibrators/{v}")
    assert r.status_code == 200, r.text
    return r.json()


def pid_of(body: dict) -> int:
    return int(body["worker"].split(":")[1])


def test_killed_worker_and_restarted_replicas(fleet_db, tmp_path):
    """Two API replicas (API only) and two workers. While a fit runs: a third replica
    starts and one is restarted (nothing changes state); then the worker running the
    fit is killed with SIGKILL: the other worker completes it, as attempt 2, one result."""
    data = tmp_path / "data"
    api = dict(run_fits="false", **FAST_HEARTBEATS)
    with (
        Server(fleet_db, data, **api) as a,
        Server(fleet_db, data, **api) as b,
        Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS) as w1,
        Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS) as w2,
        a.client() as ca,
        b.client() as cb,
    ):
        ds = prepare(ca, "m", 16000, 100)  # a fit that outlasts two replica starts
        v = submit(ca, "m", ds, "matrix")
        running = wait_for_version(cb, "m", v, lambda body: body["status"] == "running")
        assert running["attempts"] == 1
        first = pid_of(running)
        assert first in (w1.pid, w2.pid)
        # replicas come and go: the fit does not notice
        with Server(fleet_db, data, **api) as c3, c3.client() as cc:
            assert version(cc, "m", v)["status"] == "running"
        assert a.stop() == 0
        a.start()
        same = version(cb, "m", v)
        assert (same["status"], same["attempts"], pid_of(same)) == ("running", 1, first)
        # the worker dies
        (w1 if first == w1.pid else w2).kill9()
        other = w2.pid if first == w1.pid else w1.pid
        done = wait_for_version(
            cb, "m", v, lambda body: body["status"] not in ("queued", "running"), timeout=480
        )
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2 and pid_of(done) == other, done
        assert done["params"]["method"] == "matrix"
        listed = cb.get("/v1/models/m/calibrators").json()["calibrators"]
        assert [x["version"] for x in listed] == [v]  # one version, one result


def test_sigterm_of_a_replica_running_fits_hands_the_fit_back(fleet_db, tmp_path):
    """A serve process that runs fits itself gets SIGTERM during a long fit: it exits
    within its grace periods; the fit is queued again (never failed), and a worker
    started later completes it as attempt 2."""
    data = tmp_path / "data"
    with Server(
        fleet_db, data, fit_executor="process", fit_grace_seconds="1", **FAST_HEARTBEATS
    ) as s:
        with s.client() as c:
            ds = prepare(c, "m", 4000, 100)
            v = submit(c, "m", ds, "matrix")
            wait_for_version(c, "m", v, lambda body: body["status"] == "running")
        t0 = time.monotonic()
        assert s.stop() == 0
        took = time.monotonic() - t0
    assert took < 1 + 10, took  # fit grace + a margin far below the fit's own time
    with (
        Server(fleet_db, data, run_fits="false", **FAST_HEARTBEATS) as api,
        api.client() as c,
    ):
        body = version(c, "m", v)
        assert (body["status"], body["attempts"], body["error"]) == ("queued", 1, None), body
        with Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS):
            done = wait_for_version(c, "m", v, lambda b: b["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded" and done["attempts"] == 2, done


def test_a_busy_namespace_does_not_starve_another(fleet_db, tmp_path):
    """Namespace a queues 6 slow fits; b's fit submitted after them starts within
    seconds (a namespace runs at most one fit at once here, two workers)."""
    data = tmp_path / "data"
    engine = make_engine(fleet_db)
    try:
        with sessionmaker(engine)() as s:
            keys = {ns: create_key(s, ns, "write")[1] for ns in ("a", "b")}
    finally:
        engine.dispose()
    settings = dict(auth="on", max_running_fits_per_namespace="1", **FAST_HEARTBEATS)
    with (
        Server(fleet_db, data, run_fits="false", **settings) as api,
        Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS),
        Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS),
        api.client(headers={"Authorization": f"Bearer {keys['a']}"}) as ca,
        api.client(headers={"Authorization": f"Bearer {keys['b']}"}) as cb,
    ):
        ds_a = prepare(ca, "m", 4000, 100)
        ds_b = prepare(cb, "m", 1000, 10)
        busy = [submit(ca, "m", ds_a, "matrix", seed=i) for i in range(6)]
        wait_for_version(ca, "m", busy[0], lambda body: body["status"] == "running")
        t0 = time.monotonic()
        mine = submit(cb, "m", ds_b, "temperature")
        done = wait_for_version(
            cb, "m", mine, lambda body: body["status"] == "succeeded", timeout=60
        )
        assert time.monotonic() - t0 < 10, done
        states = [version(ca, "m", v)["status"] for v in busy]
        assert states.count("running") <= 1 and states.count("queued") >= 4, states
        for v in busy:  # no need to wait for them
            assert ca.post(f"/v1/models/m/calibrators/{v}/cancel").status_code in (200, 409)


def test_cancel_a_running_fit_on_a_worker(fleet_db, tmp_path):
    """A K = 1,000 Dirichlet fit on a worker, cancelled through an API replica: the
    version is cancelled at once, and the worker (concurrency 1) is free for the next
    fit within 5 s."""
    data = tmp_path / "data"
    with (
        Server(fleet_db, data, run_fits="false", **FAST_HEARTBEATS) as api,
        Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS) as w,
        api.client() as c,
    ):
        ds = prepare(c, "m", 2000, 1000)
        v = submit(c, "m", ds, "dirichlet")
        wait_for_version(c, "m", v, lambda body: body["status"] == "running", timeout=60)
        nxt = submit(c, "m", ds, "temperature")
        time.sleep(1.0)  # well into the fit
        assert version(c, "m", nxt)["status"] == "queued"
        t0 = time.monotonic()
        r = c.post(f"/v1/models/m/calibrators/{v}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        started = wait_for_version(c, "m", nxt, lambda body: body["status"] != "queued", timeout=30)
        assert time.monotonic() - t0 < 5, started
        assert pid_of(started) == w.pid
        assert version(c, "m", v)["status"] == "cancelled"


@pytest.mark.postgres
def test_rolling_restart_of_both_replicas_behind_the_load_balancer(fleet_db, tmp_path):
    """Two real API replicas behind HAProxy (the shipped config, tests/fleet_lb.py) and 8
    clients predicting; each replica in turn gets SIGTERM and is started again: not one
    request fails."""
    import threading

    from tests import fleet_lb

    data = tmp_path / "data"
    a = Server(fleet_db, data, host="127.0.0.2", **FAST_HEARTBEATS)
    b = Server(fleet_db, data, host="127.0.0.3", run_fits="false", **FAST_HEARTBEATS)
    with a, b, a.client() as c:
        ds = prepare(c, "m", 1000, 10)
        v = submit(c, "m", ds, "temperature")
        wait_for_version(c, "m", v, lambda body: body["status"] == "succeeded")
        assert c.put("/v1/models/m/aliases/production", json={"version": v}).status_code == 200
        row = {"logits": logits_data(n=1, k=10)[0].tolist()}
        with fleet_lb.running_haproxy([(a.host, a.port), (b.host, b.port)]) as lb:
            lb.wait_until_up(2)
            stop = threading.Event()
            answered: list[int] = []
            failures: list[str] = []

            def client(i: int) -> None:
                with httpx.Client(base_url=lb.base_url, timeout=30) as h:
                    while not stop.is_set():
                        try:
                            r = h.post("/v1/models/m/predict", json=row)
                        except httpx.HTTPError as exc:
                            failures.append(f"client {i}: {exc!r}")
                            continue
                        if r.status_code == 200 and r.json()["version"] == v:
                            answered.append(i)
                        else:
                            failures.append(f"client {i}: {r.status_code} {r.text[:200]}")

            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            try:
                time.sleep(1.0)
                for replica, name in ((a, "s1"), (b, "s2")):
                    assert replica.stop() == 0
                    lb.wait_until({name: "DOWN"})
                    replica.start()
                    lb.wait_until({name: "UP"})
                    time.sleep(1.0)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=60)
        assert failures == [], failures[:10]
        assert len(answered) > 100


def test_sigterm_of_a_worker_hands_its_fit_back(fleet_db, tmp_path):
    """SIGTERM to a dedicated worker mid-fit: it exits 0 after its grace period, the
    fit is queued again (attempt 1, no error), and another worker completes it."""
    data = tmp_path / "data"
    with (
        Server(fleet_db, data, run_fits="false", **FAST_HEARTBEATS) as api,
        api.client() as c,
    ):
        ds = prepare(c, "m", 4000, 100)
        with Worker(
            fleet_db, data, fit_executor="process", fit_grace_seconds="1", **FAST_HEARTBEATS
        ) as w:
            v = submit(c, "m", ds, "matrix")
            wait_for_version(c, "m", v, lambda body: body["status"] == "running")
            t0 = time.monotonic()
            assert w.terminate() == 0, w.output()
            assert time.monotonic() - t0 < 1 + 10
        body = version(c, "m", v)
        assert (body["status"], body["attempts"], body["error"]) == ("queued", 1, None), body
        with Worker(fleet_db, data, fit_executor="process", **FAST_HEARTBEATS) as other:
            done = wait_for_version(c, "m", v, lambda b: b["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded" and done["attempts"] == 2, done
        assert pid_of(done) == other.pid
