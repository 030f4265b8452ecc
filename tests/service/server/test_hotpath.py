"""The serving routes' short way past Starlette's and FastAPI's layers (service/server/hotpath.py).

Starlette builds an app's middleware stack on its first request through it; a POST to
predict that leaves ``app.middleware_stack`` unbuilt never entered the full stack.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.api.app import create_app
from service.api.routers import predict
from service.observe.metrics import ServiceMetrics
from tests.service.helpers import create_model, logits_data, make_settings, promote, upload

PREDICT = "/v1/models/m/predict"


def requests_counted(metrics: ServiceMetrics, route: str, status: str) -> float:
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for s in family.samples:
            if s.name == "welltempered_http_requests_total" and s.labels == {
                "route": route,
                "method": "POST",
                "status": status,
            }:
                return s.value
    return 0.0


@pytest.fixture
def served(tmp_path):
    """A fresh app with a servable model "m" (the setup's requests use the full stack),
    its metrics, and the logits it was fitted on."""
    settings = make_settings(f"sqlite:///{tmp_path / 'r.sqlite3'}", tmp_path)
    metrics = ServiceMetrics()
    logits, labels = logits_data(200)
    app = create_app(settings, metrics)
    with TestClient(app, raise_server_exceptions=False) as client:
        create_model(client)
        promote(client, "m", upload(client, "m", logits, labels)["id"])
        app.middleware_stack = None  # forget the setup's stack: rebuilt only if entered
        yield app, client, metrics, logits


def test_a_prediction_skips_the_full_stack_and_is_still_counted(served):
    app, client, metrics, logits = served
    r = client.post(PREDICT, json={"logits": logits[:3].tolist()})
    assert r.status_code == 200, r.text
    assert len(r.json()["labels"]) == 3
    assert app.middleware_stack is None
    assert requests_counted(metrics, predict.PATH, "2xx") == 1


def test_errors_on_the_short_way_are_the_full_stacks_problems(served):
    app, client, metrics, logits = served
    # the endpoint's own error (a domain error's handler): 422 problem+json
    r = client.post(PREDICT, json={"logits": [[1.0, 2.0]]})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    # FastAPI's validation error, raised by the endpoint for a bad query: 422 problem
    r = client.post(PREDICT + "?top_k=zero", json={"logits": logits[:1].tolist()})
    assert r.status_code == 422 and r.json()["type"].endswith("validation-error")
    # the body limit middleware, on the short stack too: 413 from the declared length
    r = client.post(
        PREDICT,
        content=b"{}",
        headers={"content-type": "application/json", "content-length": str(1 << 40)},
    )
    assert r.status_code == 413
    assert app.middleware_stack is None
    assert requests_counted(metrics, predict.PATH, "4xx") == 3


def test_an_unexpected_error_is_a_500_problem_and_raised(served, monkeypatch):
    app, client, metrics, logits = served

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(predict, "respond", broken)
    r = client.post(PREDICT, json={"logits": logits[:1].tolist()})
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/problem+json"
    assert "a bug" not in r.text  # the log has it, not the caller
    assert requests_counted(metrics, predict.PATH, "5xx") == 1
    with pytest.raises(RuntimeError, match="a bug"):  # raised again, for uvicorn to log
        TestClient(app).post(PREDICT, json={"logits": logits[:1].tolist()})


def test_other_methods_and_paths_take_the_full_stack(served):
    app, client, _, _ = served
    assert client.get(PREDICT).status_code == 405
    assert app.middleware_stack is not None


def test_with_opentelemetry_on_every_request_takes_the_full_stack(tmp_path, monkeypatch):
    settings = make_settings(f"sqlite:///{tmp_path / 'r.sqlite3'}", tmp_path)
    logits, labels = logits_data(200)
    app = create_app(settings, ServiceMetrics())
    # as when a tracer provider is configured before the first prediction
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: True)
    with TestClient(app) as client:
        create_model(client)
        promote(client, "m", upload(client, "m", logits, labels)["id"])
        app.middleware_stack = None
        r = client.post(PREDICT, json={"logits": logits[:2].tolist()})
        assert r.status_code == 200
        assert app.middleware_stack is not None
