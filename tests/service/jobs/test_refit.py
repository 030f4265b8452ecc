"""A fit's ``refit``: the chosen method fitted again on every row, served, while the
version's metrics stay the hold-out estimate of the method (service/jobs/fitting.py)."""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators.evaluation import checks
from calibrators.evaluation.holdout import split_indices
from service.errors import FitTooLarge
from service.jobs.fitting import affordable, fit_job, job_bytes
from tests.service.helpers import assert_problem, create_model, fit, logits_data, upload

HOLDOUT, SEED = 0.3, 4


def job(logits, labels, method: str, refit: bool) -> dict:
    return fit_job(logits, labels, kind="logits", method=method, holdout=HOLDOUT, seed=SEED,
                   options={}, argmax_policy="off", refit=refit)


def weights(params: dict) -> dict[str, np.ndarray]:
    """The fitted arrays of ``params`` (those its method declares and has)."""
    names = calibrators.CALIBRATORS[params["method"]].fitted_arrays
    return {k: np.asarray(params[k]) for k in names if params.get(k) is not None}


@pytest.mark.parametrize("method", ["vector", "auto"])
def test_refit_serves_the_chosen_method_fitted_on_every_row(method):
    logits, labels = logits_data(n=400, k=4, seed=3)
    plain, again = job(logits, labels, method, False), job(logits, labels, method, True)
    chosen = again["chosen_method"]
    assert chosen == plain["chosen_method"]
    fit_rows, hold_rows = split_indices(len(labels), HOLDOUT, SEED)

    # Without refit: the calibrator fitted on the fit rows; with it: on every row.
    on_fit_rows = calibrators.create(chosen).fit(logits[fit_rows], labels[fit_rows])
    on_all_rows = calibrators.create(chosen).fit(logits, labels)
    for got, want in ((plain, on_fit_rows), (again, on_all_rows)):
        for name, value in weights(want.to_params()).items():
            np.testing.assert_array_equal(weights(got["params"])[name], value)
    assert any(not np.array_equal(v, weights(plain["params"])[k])
               for k, v in weights(again["params"]).items())

    # The metrics are the hold-out estimate either way; the argmax report is the served one's.
    assert again["metrics_after"] == plain["metrics_after"]
    served = calibrators.from_params(again["params"])
    held = logits[hold_rows]
    assert again["argmax"] == checks.argmax_report(held, served.predict_proba(held))


def test_the_memory_guard_counts_the_refit_on_every_row():
    n, k = 10_000, 50
    fit_rows, _ = split_indices(n, HOLDOUT, 0)
    part = job_bytes("matrix", {}, len(fit_rows), n - len(fit_rows), k, 4)
    whole = job_bytes("matrix", {}, n, n - len(fit_rows), k, 4)
    assert part < whole
    budget = (part + whole) // 2
    kwargs = {"argmax_policy": "off", "n_rows": n, "k": k, "itemsize": 4, "holdout": HOLDOUT,
              "budget": budget}
    assert affordable("matrix", {}, **kwargs) == ("matrix",)
    with pytest.raises(FitTooLarge):
        affordable("matrix", {}, refit=True, **kwargs)


def test_the_version_says_whether_it_was_refitted(client):
    create_model(client, k=4, argmax_policy="off")
    logits, labels = logits_data(n=300, k=4, seed=5)
    dataset = upload(client, "m", logits, labels)["id"]
    plain = fit(client, "m", dataset, "vector", holdout=HOLDOUT, seed=SEED)
    again = fit(client, "m", dataset, "vector", holdout=HOLDOUT, seed=SEED, refit=True)
    assert (plain["refit"], again["refit"]) == (False, True)
    assert again["status"] == plain["status"] == "succeeded"
    assert again["metrics"] == plain["metrics"]
    want = calibrators.create("vector").fit(logits, labels).to_params()
    np.testing.assert_array_equal(again["params"]["weight"], want["weight"])
    assert client.get("/v1/models/m/calibrators/2").json()["refit"] is True

    r = client.post("/v1/models/m/calibrators",
                    json={"dataset_id": dataset, "method": "vector", "refit": "yes"})
    assert_problem(r, 422, "refit")
