"""The held-out NLL policy: a version (imported or fitted) whose held-out NLL is worse
than the uncalibrated scores' beyond the tolerance is rejected with its reason, whatever
the argmax policy, and never served; a normal one succeeds, and temperature scaling
fitted on real outputs is never rejected. On SQLite and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest

import calibrators
from calibrators.evaluation.holdout import split_indices
from service.demo import digits_logits
from service.jobs import evaluation
from service.jobs.fitting import fit_job
from service.vocabulary import ARGMAX_CHANGED, NLL_WORSE
from tests.helpers import load_shared
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    import_params,
    logits_data,
    upload,
)

N, K = 1000, 4


def one_hot_params(z, y) -> dict:
    """Vector scaling with every weight 1e30: one-hot probabilities (the adversarial
    finding: 'succeeded', held-out NLL 35.1 against 0.93 uncalibrated)."""
    params = calibrators.create("vector").fit(z, y).to_params()
    return {**params, "weight": [1e30] * K}


def misleading_split(n: int = 600, holdout: float = 0.2, seed: int = 0):
    """Logits whose fit rows are always right and whose held-out rows are always wrong
    (the class after the argmax): a temperature fit sharpens them, which ruins the
    held-out NLL."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 3)) * 2
    y = z.argmax(axis=1)
    _, hold = split_indices(n, holdout, seed)
    y[hold] = (y[hold] + 1) % 3
    return z, y


@pytest.mark.parametrize("policy", ["off", "require"])
def test_the_one_hot_import_is_rejected_with_its_reason(client, policy):
    create_model(client, "m", K, argmax_policy=policy)
    z, y = logits_data(N, K)
    ds = upload(client, "m", z, y)["id"]
    v = import_params(client, "m", ds, one_hot_params(z, y))
    assert v["status"] == "rejected", v
    assert v["rejected_for"] == [NLL_WORSE]
    (sentence,) = v["rejection"]
    assert "held-out NLL worse than the uncalibrated" in sentence
    assert v["metrics"]["after"]["nll"] > 30 * v["metrics"]["before"]["nll"]
    # never served: no alias, no predict by number
    r = client.put("/v1/models/m/aliases/production", json={"version": v["version"]})
    body = assert_problem(r, 409, "rejected", "held-out NLL")
    assert body["type"].endswith("/not-ready") and body["version_status"] == "rejected"
    r = client.post(f"/v1/models/m/predict?version={v['version']}", json={"logits": z[:2].tolist()})
    assert_problem(r, 409)


def test_a_normal_import_succeeds(client):
    create_model(client, "m", K)
    z, y = logits_data(N, K)
    ds = upload(client, "m", z, y)["id"]
    fit_rows, _ = split_indices(N, 0.2, 0)
    params = calibrators.create("temperature").fit(z[fit_rows], y[fit_rows]).to_params()
    v = import_params(client, "m", ds, params)
    assert (v["status"], v["rejection"], v["rejected_for"]) == ("succeeded", None, None), v
    assert v["metrics"]["after"]["nll"] < v["metrics"]["before"]["nll"]


def test_a_fit_worse_than_uncalibrated_is_rejected(client):
    create_model(client, "m", 3)
    ds = upload(client, "m", *misleading_split())["id"]
    v = fit(client, "m", ds, "temperature")
    assert v["status"] == "rejected", v
    assert v["rejected_for"] == [NLL_WORSE]
    assert v["argmax"]["changed"] == 0  # temperature keeps every argmax: the NLL alone
    assert "temperature calibration made the held-out NLL worse" in v["rejection"][0]
    assert v["params"]["weight"] > 1  # sharpened
    r = client.put("/v1/models/m/aliases/production", json={"version": v["version"]})
    assert_problem(r, 409, "held-out NLL")


def test_auto_reports_each_candidates_reasons(client):
    create_model(client, "m", 3, argmax_policy="require")
    ds = upload(client, "m", *misleading_split())["id"]
    v = fit(client, "m", ds, "auto")
    assert v["status"] == "rejected", v
    assert all(NLL_WORSE in c["rejected_for"] for c in v["candidates"].values()), v
    assert v["rejected_for"][-1] == NLL_WORSE
    assert set(v["rejected_for"]) <= {ARGMAX_CHANGED, NLL_WORSE}


def test_a_version_rejected_for_its_argmax_keeps_its_problem(client):
    create_model(client, "m", 3, argmax_policy="require")
    rng = np.random.default_rng(1)
    z = rng.normal(size=(400, 3)) * 2
    ds = upload(client, "m", z, (z.argmax(axis=1) + 1) % 3)["id"]  # matrix learns to permute
    v = fit(client, "m", ds, "matrix")
    assert v["status"] == "rejected" and v["rejected_for"] == [ARGMAX_CHANGED], v
    r = client.put("/v1/models/m/aliases/production", json={"version": v["version"]})
    assert assert_problem(r, 409)["type"].endswith("/argmax-changed")


# ---------------------------------------------------------------------------
# the tolerance


def report(difference: float, se: float | None, before: float = 1.0) -> dict:
    return {
        "n": 100,
        "before_loss": before,
        "after_loss": before + difference,
        "difference": difference,
        "standard_error": se,
    }


@pytest.mark.parametrize(
    ("nll", "worse"),
    [
        (report(0.011, 0.001), True),  # 1.1% and 11 standard errors
        (report(0.009, 0.0001), False),  # significant, under 1%
        (report(0.5, 0.2), False),  # 50% worse, 2.5 standard errors: the rows cannot tell
        (report(0.5, 0.09), True),
        (report(-0.3, 0.01), False),  # better
        (report(0.0, 0.0), False),  # the identity
        (report(34.0, None), False),  # one held-out row: no standard error
    ],
)
def test_the_tolerance_needs_both_a_relative_and_a_significant_difference(nll, worse):
    assert evaluation.nll_worse(nll) is worse


def _real_outputs():
    for stem in ("wideresnet-16-4-cifar-100", "lenet-5-cifar-10"):
        data = load_shared(stem)
        yield stem, data.probs, data.labels, "probabilities"
    _, _, z, y = digits_logits()
    yield "digits-mlp", z, y, "logits"


@pytest.mark.slow
def test_temperature_fits_on_real_outputs_are_never_rejected():
    """Every shipped real output, whole, at several splits (bench/holdout_policy.py
    measures many more, and subsamples)."""
    for name, scores, labels, kind in _real_outputs():
        for holdout in (0.1, 0.2, 0.5):
            for seed in range(5):
                out = fit_job(
                    scores, labels, kind=kind, method="temperature", holdout=holdout,
                    seed=seed, options={}, argmax_policy="require",
                )
                assert out["status"] == "succeeded", (name, holdout, seed, out["rejection"])
