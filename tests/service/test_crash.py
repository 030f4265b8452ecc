"""Crash safety with real `welltempered serve` processes, on SQLite and PostgreSQL.

SIGKILL during a fit and an upload; SIGTERM with a request in flight;
PostgreSQL backends killed under a running server; an alias moved many times
while 8 clients predict.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

import calibrators
from service.storage.arrays import ArrayStore
from tests.oracles import status_is, wait_for_version
from tests.service.helpers import logits_data
from tests.service.servers import Server

pytestmark = [pytest.mark.slow, pytest.mark.process]


def npz_bytes(logits: np.ndarray, labels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, logits=logits.astype(np.float32), labels=labels)
    return buf.getvalue()


def slow_body(payload: bytes, pieces: int, pause: float, stop: threading.Event):
    step = -(-len(payload) // pieces)
    for i in range(0, len(payload), step):
        if stop.is_set():
            return
        yield payload[i : i + step]
        time.sleep(pause)


FAST_HEARTBEATS = {"worker_heartbeat_seconds": "0.5", "worker_stalled_seconds": "3"}


def test_sigkill_during_fit_and_upload_leaves_nothing_half_written(database_url, tmp_path):
    data = tmp_path / "data"
    z, y = logits_data(40_000, 40, seed=1)
    with (
        Server(database_url, data, FIT_EXECUTOR="process", **FAST_HEARTBEATS) as server,
        server.client() as c,
    ):
        c.post("/v1/models", json={"name": "m", "num_classes": 40, "argmax_policy": "off"})
        r = c.post(
            "/v1/models/m/datasets",
            content=npz_bytes(z, y),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        ds = r.json()["id"]
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds, "method": "temperature"})
        assert wait_for_version(c, "m", r.json()["version"], status_is("succeeded"))["version"] == 1
        assert c.put("/v1/models/m/aliases/production", json={"version": 1}).status_code == 200
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds, "method": "matrix"})
        assert r.status_code == 202 and r.json()["version"] == 2
        wait_for_version(c, "m", 2, status_is("running"))
        # an upload streaming in while the server dies
        stop = threading.Event()
        other = npz_bytes(*logits_data(5_000, 40, seed=2))

        def upload():
            try:
                httpx.post(
                    f"{server.base}/v1/models/m/datasets",
                    content=slow_body(other, 50, 0.05, stop),
                    headers={"content-type": "application/octet-stream"},
                    timeout=30,
                )
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=upload)
        t.start()
        time.sleep(0.6)
        assert c.get("/v1/models/m/calibrators/2").json()["status"] == "running"
        server.kill9()
        stop.set()
        t.join(30)
    spool = ArrayStore(data).tmp
    assert any(spool.iterdir()), "the kill did not catch the upload mid-stream"
    sqlite = database_url.startswith("sqlite")
    with Server(database_url, data, **FAST_HEARTBEATS) as server, server.client() as c:
        # Handed back, never failed: the restart (SQLite) or the heartbeat expiry of the
        # dead process's worker (PostgreSQL) queues it again as its second attempt.
        v2 = wait_for_version(c, "m", 2, status_is("running"))
        deadline = time.monotonic() + 60
        while v2["attempts"] < 2:
            assert v2["status"] in ("queued", "running") and time.monotonic() < deadline, v2
            time.sleep(0.1)
            v2 = c.get("/v1/models/m/calibrators/2").json()
        assert v2["error"] is None and v2["params"] is None and v2["metrics"] is None
        assert c.post("/v1/models/m/calibrators/2/cancel").json()["status"] == "cancelled"
        assert c.get("/v1/models/m/aliases/production").json()["version"] == 1
        assert [d["id"] for d in c.get("/v1/models/m/datasets").json()["datasets"]] == [ds]
        r = c.post("/v1/models/m/predict", json={"logits": z[:2].tolist()})
        assert r.status_code == 200 and r.json()["version"] == 1
        assert c.put("/v1/models/m/aliases/production", json={"version": 2}).status_code == 409
    if sqlite:  # the restart removed the half-received upload
        assert list(spool.iterdir()) == []
    else:  # another replica might be receiving it: only older ones go (the grace period)
        assert any(spool.iterdir())


def test_sigterm_finishes_the_request_in_flight_and_exits_0(database_url, tmp_path):
    z, y = logits_data(3_000, 5)
    payload = npz_bytes(z, y)
    server = Server(database_url, tmp_path / "data", SHUTDOWN_GRACE_SECONDS="20").start()
    try:
        with server.client() as c:
            c.post("/v1/models", json={"name": "m", "num_classes": 5})
        result = {}

        def upload():
            result["r"] = httpx.post(
                f"{server.base}/v1/models/m/datasets",
                content=slow_body(payload, 20, 0.1, threading.Event()),  # ~2 s
                headers={"content-type": "application/octet-stream"},
                timeout=30,
            )

        t = threading.Thread(target=upload)
        t.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{server.base}/healthz", timeout=2)
        t.join(30)
        assert result["r"].status_code == 201, result["r"].text
        assert server.proc.wait(timeout=30) == 0, server.output()
    finally:
        server.__exit__()


@pytest.mark.postgres
def test_postgres_backends_killed_while_serving(pg_schema, pg_admin, tmp_path):
    from service.storage import migrate

    migrate.upgrade(pg_schema)
    app_name = f"wt_{uuid.uuid4().hex[:10]}"
    url = make_url(pg_schema).update_query_dict({"application_name": app_name})
    url = url.render_as_string(hide_password=False)
    with Server(url, tmp_path / "data") as server, server.client() as c:
        c.post("/v1/models", json={"name": "m", "num_classes": 3})
        assert c.get("/v1/models").status_code == 200

        def kill_backends() -> int:
            with pg_admin.connect() as conn:
                return conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :n"
                    ),
                    {"n": app_name},
                ).scalar()

        assert kill_backends() >= 1
        for i in range(3):
            # pool_pre_ping replaces the dead connections: the first request succeeds
            assert c.get("/readyz").status_code == 200, server.output()
            assert c.get("/v1/models/m").status_code == 200
            r = c.post("/v1/models", json={"name": f"m{i}", "num_classes": 3})
            assert r.status_code == 201, r.text
            kill_backends()
        assert server.proc.poll() is None, server.output()


def test_alias_moves_under_load_never_mix_versions(database_url, tmp_path):
    """8 clients predict while the alias flips between two versions: every answer is the
    exact output of the version it names."""
    k = 5
    z, y = logits_data(400, k, scale=4.0)
    rows = z[:4]
    with Server(database_url, tmp_path / "data", "--workers", "2") as server, server.client() as c:
        c.post("/v1/models", json={"name": "m", "num_classes": k, "argmax_policy": "off"})
        params = {}
        for scale in (1.0, 0.25):  # two datasets, two temperatures
            r = c.post(
                "/v1/models/m/datasets",
                json={"logits": (z * scale).tolist(), "labels": y.tolist()},
            )
            body = {"dataset_id": r.json()["id"], "method": "temperature"}
            v = c.post("/v1/models/m/calibrators", json=body).json()["version"]
            params[v] = wait_for_version(c, "m", v, status_is("succeeded"))["params"]
        expected = {v: calibrators.from_params(p).predict_proba(rows) for v, p in params.items()}
        assert np.abs(expected[1] - expected[2]).max() > 0.05  # distinguishable
        c.put("/v1/models/m/aliases/production", json={"version": 1})
        stop = threading.Event()
        seen = {1: 0, 2: 0}
        errors: list[str] = []
        lock = threading.Lock()

        def client():
            with server.client(timeout=30) as cc:
                while not stop.is_set():
                    r = cc.post("/v1/models/m/predict", json={"logits": rows.tolist()})
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text}")
                        continue
                    body = r.json()
                    v = body["version"]
                    got = np.asarray(body["probabilities"])
                    if np.abs(got - expected[v]).max() > 1e-5:
                        errors.append(f"version {v} answered {got.tolist()}")
                    with lock:
                        seen[v] += 1

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        moves = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            r = c.put("/v1/models/m/aliases/production", json={"version": 2 - moves % 2})
            assert r.status_code == 200, r.text
            moves += 1
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == [], errors[:5]
    assert moves >= 20 and seen[1] > 20 and seen[2] > 20, (moves, seen)
    print(f"alias moved {moves} times; answers by version: {seen}", file=os.sys.stderr)


@pytest.mark.postgres
def test_readyz_is_503_exactly_while_the_database_is_unreachable(pg_schema, tmp_path):
    """In-process: the app's engine is pointed at a closed port, then back."""
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.storage import migrate
    from service.storage.db import make_engine
    from tests.service.helpers import make_settings
    from tests.service.servers import free_port

    migrate.upgrade(pg_schema)
    with TestClient(create_app(make_settings(pg_schema, tmp_path))) as c:
        state = c.app.state.welltempered
        assert c.get("/readyz").status_code == 200
        good = state.engine
        dead = make_url(pg_schema).set(port=free_port()).render_as_string(hide_password=False)
        state.engine = make_engine(dead)
        try:
            r = c.get("/readyz")
            assert r.status_code == 503 and "unreachable" in r.json()["detail"]
        finally:
            state.engine.dispose()
            state.engine = good
        assert c.get("/readyz").status_code == 200
