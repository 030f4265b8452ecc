"""PREDICT_THREADS: how many predictions the thread pool computes at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.routers import predict
from tests.service.helpers import create_model, logits_data, make_settings, promote, upload


@pytest.mark.parametrize("threads", [1, 3])
def test_at_most_predict_threads_predictions_run_at_once(tmp_path, monkeypatch, threads):
    running = peak = 0
    lock = threading.Lock()
    respond = predict.respond

    def slow_respond(*args):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.3)
        with lock:
            running -= 1
        return respond(*args)

    monkeypatch.setattr(predict, "respond", slow_respond)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'r.sqlite3'}",
        tmp_path,
        predict_threads=threads,
        inline_predict_bytes=0,  # every predict in the thread pool
    )
    logits, labels = logits_data(200)
    with TestClient(create_app(settings)) as client:
        create_model(client)
        promote(client, "m", upload(client, "m", logits, labels)["id"])

        def one(i: int) -> int:
            body = {"logits": logits[i : i + 2].tolist()}
            return client.post("/v1/models/m/predict", json=body).status_code

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(one, range(6))) == [200] * 6
    assert peak == threads
