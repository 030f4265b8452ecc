"""Fits run in a worker pool (service/jobs/): the API answers while they run (measured,
not assumed)."""

from __future__ import annotations

import dataclasses
import io
import time
from datetime import UTC, datetime

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from service.api.app import create_app
from tests.oracles import wait_for_version
from tests.service.helpers import (
    create_model,
    fit,
    hold_queue,
    logits_data,
    make_settings,
    upload,
)


def test_fit_in_a_worker_process(database_url, tmp_path):
    """The default pool: a spawned process with its own database connection."""
    settings = make_settings(database_url, tmp_path, fit_executor="process")
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4, argmax_policy="off")
        logits, labels = logits_data()
        ds = upload(c, "m", logits, labels)
        v = fit(c, "m", ds["id"], "vector")
        assert v["status"] == "succeeded" and v["params"]["method"] == "vector", v


def _stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC).timestamp()


@pytest.mark.slow
def test_predict_is_not_blocked_by_a_running_fit(tmp_path):
    settings = make_settings(
        f"sqlite:///{tmp_path / 'r.sqlite3'}", tmp_path, fit_executor="process"
    )
    with TestClient(create_app(settings)) as c:
        # Model A: served.
        create_model(c, "served", 10)
        z, y = logits_data(n=500, k=10, seed=2)
        ds = upload(c, "served", z, y)
        v = fit(c, "served", ds["id"], "temperature")  # also starts the worker process
        c.put("/v1/models/served/aliases/production", json={"version": v["version"]})
        row = {"logits": z[:1].tolist()}

        def predict_once() -> tuple[float, float, float]:
            t0 = time.time()
            p0 = time.perf_counter()
            r = c.post("/v1/models/served/predict", json=row)
            took = time.perf_counter() - p0
            assert r.status_code == 200, r.text
            return t0, time.time(), took

        for _ in range(20):  # warm up (ONNX session, pools)
            predict_once()
        idle = np.array([predict_once()[2] for _ in range(200)])

        # Model B: heavy fits (matrix scaling, penalties chosen by cross-validation).
        create_model(c, "heavy", 40, argmax_policy="off")
        zb, yb = logits_data(n=40_000, k=40, seed=3)
        buf = io.BytesIO()
        np.savez(buf, logits=zb.astype(np.float32), labels=yb)
        r = c.post(
            "/v1/models/heavy/datasets",
            content=buf.getvalue(),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        heavy = r.json()["id"]
        versions = []
        for seed in range(2):  # two queued fits keep the single worker busy longer
            r = c.post(
                "/v1/models/heavy/calibrators",
                json={"dataset_id": heavy, "method": "matrix", "seed": seed},
            )
            assert r.status_code == 202, r.text
            versions.append(r.json()["version"])
        samples = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            samples.append(predict_once())
            if len(samples) % 50 == 0:
                states = [
                    c.get(f"/v1/models/heavy/calibrators/{n}").json()["status"] for n in versions
                ]
                if all(s in ("succeeded", "rejected", "failed") for s in states):
                    break
        fits = [wait_for_version(c, "heavy", n) for n in versions]
        assert all(f["status"] == "succeeded" for f in fits), fits
        windows = [(_stamp(f["started_at"]), _stamp(f["finished_at"])) for f in fits]
        during = np.array(
            [took for t0, t1, took in samples if any(a <= t0 and t1 <= b for a, b in windows)]
        )
        fit_seconds = sum(b - a for a, b in windows)
        print(
            f"\nidle p50 {np.median(idle) * 1e3:.2f} ms "
            f"p99 {np.quantile(idle, 0.99) * 1e3:.2f} ms; "
            f"during {fit_seconds:.1f} s of fits: {during.size} predicts, p50 "
            f"{np.median(during) * 1e3:.2f} ms p99 {np.quantile(during, 0.99) * 1e3:.2f} ms"
        )
        assert during.size >= 50, "the fits were too short to measure anything"
        # Generous: the fit competes for the 2 cores, but never holds the API up.
        assert np.quantile(during, 0.99) < max(10 * np.quantile(idle, 0.99), 0.25)
        assert during.max() < 2.0


def test_a_fit_process_that_ends_without_its_outcome_fails_the_version(client, monkeypatch):
    """A child that exits 0 without recording an outcome (a SystemExit inside the fit
    ends a process with 0) leaves no version running with its job gone: the attempt
    records it failed. Forked here, so the child runs this test's run_claimed."""
    import multiprocessing

    from service.jobs import attempts

    create_model(client, k=4)
    logits, labels = logits_data(n=80, k=4, seed=2)
    dataset = upload(client, "m", logits, labels)["id"]
    hold_queue(client)
    r = client.post("/v1/models/m/calibrators", json={"dataset_id": dataset,
                                                     "method": "temperature"})
    assert r.status_code == 202, r.text
    state = client.app.state.welltempered
    with state.sessions() as s:
        version_id = s.scalar(text("SELECT id FROM calibrator_versions"))

    def exits(*args, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr(attempts, "run_claimed", exits)
    monkeypatch.setattr(attempts, "_process_context", lambda: multiprocessing.get_context("fork"))
    config = dataclasses.replace(state.fits.config, executor="process")
    assert attempts.execute(version_id, config, state.sessions, "test") == "failed"
    got = client.get(f"/v1/models/m/calibrators/{r.json()['version']}").json()
    assert got["status"] == "failed" and "without recording an outcome" in got["error"]
