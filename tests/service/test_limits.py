"""Limits and back-pressure: rows, classes, queued fits (429), streamed body limits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import (
    assert_problem,
    create_model,
    fit,
    logits_data,
    make_settings,
    upload,
)


@pytest.fixture
def limited(database_url, tmp_path):
    settings = make_settings(
        database_url,
        tmp_path,
        max_predict_rows=10,
        max_dataset_rows=500,
        max_classes=50,
        max_queued_fits=1,
        max_json_bytes=200_000,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def test_rows_classes_and_fit_queue(limited):
    c = limited
    assert_problem(c.post("/v1/models", json={"name": "big", "num_classes": 51}), 422, "50")
    create_model(c, "m", 3)
    z, y = logits_data(501, 3)
    r = c.post("/v1/models/m/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    assert_problem(r, 413, "500 rows")
    ds = upload(c, "m", z[:300], y[:300])
    v = fit(c, "m", ds["id"])
    c.put("/v1/models/m/aliases/production", json={"version": v["version"]})
    assert c.post("/v1/models/m/predict", json={"logits": z[:10].tolist()}).status_code == 200
    assert_problem(c.post("/v1/models/m/predict", json={"logits": z[:11].tolist()}), 413, "10")
    npy = __import__("io").BytesIO()
    np.save(npy, z[:11].astype(np.float32))
    r = c.post(
        "/v1/models/m/predict",
        content=npy.getvalue(),
        headers={"content-type": "application/x-npy"},
    )
    assert_problem(r, 413)
    # the queue: fits are not started (submit is a no-op), so the first one stays queued
    c.app.state.welltempered.fits.submit = lambda version_id: None
    body = {"dataset_id": ds["id"], "method": "temperature"}
    assert c.post("/v1/models/m/calibrators", json=body).status_code == 202
    r = c.post("/v1/models/m/calibrators", json=body)
    assert_problem(r, 429, "queued")
    assert int(r.headers["retry-after"]) > 0


def test_oversized_chunked_body_is_refused_without_reading_it(settings):
    """No Content-Length, an endless body: 413 after about `limit` bytes, not the whole."""
    app = create_app(settings.model_copy(update={"max_metadata_bytes": 64 * 1024}))
    chunk = b"x" * 8192
    sent = {"chunks": 0}
    messages = []

    async def receive():
        sent["chunks"] += 1
        if sent["chunks"] > 10_000:  # 80 MB: far beyond; the server must stop long before
            raise AssertionError("the whole body was read")
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }

    async def run():
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in messages if m["type"] == "http.response.start")
    assert start["status"] == 413
    assert sent["chunks"] * len(chunk) <= 64 * 1024 + 2 * len(chunk)
