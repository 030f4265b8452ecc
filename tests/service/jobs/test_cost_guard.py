"""A fit no worker can hold is refused at submission (422 fit-too-large), never an
out-of-memory worker; an auto fit skips the candidates above the budget. An import of
parameters fitted elsewhere is guarded the same way, on the evaluation it runs."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

import calibrators
from calibrators.evaluation.holdout import split_sizes
from service.api.app import create_app
from service.errors import FitTooLarge
from service.jobs.fitting import _largest_k, auto_candidates, hold_bytes, import_job, job_bytes
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    import_params,
    logits_data,
    make_settings,
    upload,
)

N, K, HOLDOUT = 300, 6, 0.2


def need(method: str, k: int = K, options=None, refit: bool = False) -> int:
    """A fit's estimate; with ``refit`` (auto's default) its fit on every row."""
    n_fit, n_hold = split_sizes(N, HOLDOUT)
    n_fit = N if refit else n_fit
    return job_bytes(method, options or {}, n_fit, n_hold, k, np.dtype(np.float64).itemsize)


def auto_need(method: str) -> int:
    """An auto fit's estimate of a candidate: auto refits its choice on every row."""
    return need(method, refit=True)


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
    budget = min(auto_need(m) for m in everything)  # only the cheapest candidates fit
    dropped = {m for m in everything if auto_need(m) > budget}
    assert dropped and dropped != set(everything)
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", *logits_data(n=N, k=K))
        v = fit(c, "m", ds["id"], "auto")
        assert v["status"] == "succeeded"
        assert set(v["candidates"]) == set(everything) - dropped
        assert "skipped" in v["warning"] and all(m in v["warning"] for m in dropped)


def test_auto_with_no_candidate_under_the_budget_names_the_cheapest(database_url, tmp_path):
    cheapest = min(calibrators.METHODS, key=auto_need)
    budget = auto_need(cheapest) - 1
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", *logits_data(n=N, k=K))
        r = c.post("/v1/models/m/calibrators", json={"dataset_id": ds["id"], "method": "auto"})
        body = assert_problem(r, 422, cheapest)
        assert body["method"] == cheapest


def test_largest_k_is_the_boundary():
    for method in ("temperature", "matrix"):
        budget = need(method, 500)
        k = _largest_k(lambda kk, m=method: need(m, kk), 10_000, budget)
        assert k >= 500 and need(method, k) <= budget < need(method, k + 1)


# -- imports: posted parameters, evaluated on the hold-out, no fit -------------------


def import_need(k: int = K) -> int:
    _, n_hold = split_sizes(N, HOLDOUT)
    return hold_bytes(n_hold, k, np.dtype(np.float64).itemsize)


def test_an_import_over_the_budget_is_refused_and_nothing_is_queued(database_url, tmp_path):
    """The guard of a fit, on what an import runs: the evaluation of the hold-out rows
    (hold_bytes), not the fit it does not do."""
    z, y = logits_data(n=N, k=K)
    params = calibrators.create("vector").fit(z, y).to_params()
    budget = import_need() - 1
    assert need("vector") > import_need()  # a fit's estimate would refuse far sooner
    with serve(database_url, tmp_path, budget) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", z, y)
        r = c.post(
            "/v1/models/m/calibrators/import", json={"dataset_id": ds["id"], "params": params}
        )
        body = assert_problem(r, 422, "vector", "held-out", "budget", "largest K")
        assert body["type"].endswith("/fit-too-large")
        assert body["method"] == "vector" and body["budget_bytes"] == budget
        assert body["estimate_bytes"] == import_need() > budget
        largest = body["max_classes"]
        assert import_need(largest) <= budget < import_need(largest + 1)
        assert c.get("/v1/models/m/calibrators").json()["calibrators"] == []
        # a smaller hold-out fits the same budget; so does a fit's budget of the estimate
        v = import_params(c, "m", ds["id"], params, holdout=0.1)
        assert v["status"] == "succeeded" and v["source"] == "params"


def test_an_import_at_the_budget_runs_in_the_fit_queue(database_url, tmp_path):
    z, y = logits_data(n=N, k=K)
    params = calibrators.create("temperature").fit(z, y).to_params()
    with serve(database_url, tmp_path, import_need()) as c:
        create_model(c, "m", K, argmax_policy="off")
        ds = upload(c, "m", z, y)
        v = import_params(c, "m", ds["id"], params)
        assert (v["status"], v["source"], v["attempts"]) == ("succeeded", "params", 1)
        assert v["worker"] and v["started_at"] and v["finished_at"] and v["error"] is None


def test_the_import_job_checks_the_budget_where_it_runs():
    """A worker whose budget is smaller than the API's fails the job, naming it."""
    z, y = logits_data(n=N, k=K)
    params = calibrators.create("temperature").fit(z, y).to_params()
    spec = {"kind": "logits", "holdout": HOLDOUT, "seed": 0, "argmax_policy": "off"}
    out = import_job(params, z, y, memory_budget=import_need(), **spec)
    assert out["status"] == "succeeded" and out["params"]["weight"] == params["weight"]
    with pytest.raises(FitTooLarge, match="temperature"):
        import_job(params, z, y, memory_budget=import_need() - 1, **spec)
