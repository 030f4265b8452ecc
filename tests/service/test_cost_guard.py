"""A fit no worker can hold is refused at submission (422 fit-too-large), never an
out-of-memory worker; an auto fit skips the candidates above the budget."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

import calibrators
from calibrators.holdout import split_sizes
from service.api.app import create_app
from service.jobs.fitting import _largest_k, auto_candidates, job_bytes
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    logits_data,
    make_settings,
    upload,
)

N, K, HOLDOUT = 300, 6, 0.2


def need(method: str, k: int = K, options=None) -> int:
    n_fit, n_hold = split_sizes(N, HOLDOUT)
    return job_bytes(method, options or {}, n_fit, n_hold, k, np.dtype(np.float64).itemsize)


def serve(database_url, tmp_path, budget: int) -> TestClient:
    settings = make_settings(database_url, tmp_path, fit_memory_bytes=budget)
    return TestClient(create_app(settings), raise_server_exceptions=False)


def test_an_explicit_fit_over_the_budget_is_refused_and_nothing_is_queued(database_url, tmp_path):
    dear = max(calibrators.METHODS, key=need)
    cheap = min(calibrators.METHODS, key=need)
    assert need(cheap) < need(dear)
    budget = need(dear) - 1
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", *logits_data(n=N, k=K))
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds["id"], "method": dear})
        body = assert_problem(r, 422, dear, "budget", "largest K")
        assert body["type"].endswith("/fit-too-large")
        assert body["method"] == dear and body["budget_bytes"] == budget
        assert body["estimate_bytes"] == need(dear) > budget
        largest = body["max_classes"]
        assert need(dear, largest) <= budget < need(dear, largest + 1)
        assert c.get("/v1/models/m/calibrators").json()["calibrators"] == []
        # A method whose estimate fits the same budget is accepted.
        assert fit(c, "m", ds["id"], cheap)["status"] == "succeeded"


def test_auto_skips_the_candidates_over_the_budget(database_url, tmp_path):
    everything = auto_candidates("off")
    budget = min(need(m) for m in everything)  # only the cheapest candidates fit
    dropped = {m for m in everything if need(m) > budget}
    assert dropped and dropped != set(everything)
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", *logits_data(n=N, k=K))
        v = fit(c, "m", ds["id"], "auto")
        assert v["status"] == "succeeded"
        assert set(v["candidates"]) == set(everything) - dropped
        assert "skipped" in v["warning"] and all(m in v["warning"] for m in dropped)


def test_auto_with_no_candidate_under_the_budget_names_the_cheapest(database_url, tmp_path):
    cheapest = min(calibrators.METHODS, key=need)
    budget = need(cheapest) - 1
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", *logits_data(n=N, k=K))
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds["id"], "method": "auto"})
        body = assert_problem(r, 422, cheapest)
        assert body["method"] == cheapest


def test_largest_k_is_the_boundary():
    n_fit, n_hold = split_sizes(N, HOLDOUT)
    for method in ("temperature", "matrix"):
        budget = need(method, 500)
        k = _largest_k(method, {}, n_fit, n_hold, 10_000, 8, budget)
        assert k >= 500 and need(method, k) <= budget < need(method, k + 1)
