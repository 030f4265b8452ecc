"""service.api.routers.label_shift: the production priors of a skewed stream of served
CIFAR-10 rows (issue 23's protocol), their verdict, and the proposed prior-corrected
version, evaluated, policed and never promoted by itself; on SQLite and PostgreSQL."""

from __future__ import annotations

import io

import numpy as np
import pytest

from calibrators.evaluation import shift
from service.vocabulary import DEFAULT_NAMESPACE
from tests.oracles import shifted_sample, wait_for_version
from tests.service.helpers import assert_problem, create_model, families, promote, upload

NPY = "application/x-npy"


def served(client, model: str, probs: np.ndarray, **query) -> np.ndarray:
    """/predict's probabilities for ``probs`` (exact float32), in batches."""
    parts = []
    for rows in np.array_split(probs, 4):
        r = client.post(
            f"/v1/models/{model}/predict",
            json={"probabilities": rows.tolist()},
            params=query,
            headers={"accept": NPY},
        )
        assert r.status_code == 200, r.text
        parts.append(np.load(io.BytesIO(r.content)).astype(np.float64))
    return np.concatenate(parts)


def flush(client) -> None:
    state = client.app.state.welltempered
    state.served_counts.flush(state.sessions)


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(np.log(probs[np.arange(labels.size), labels])))


@pytest.fixture
def skewed(cifar10):
    """The test half resampled to Dirichlet(0.5) priors: 4,000 rows and their labels."""
    probs, labels = cifar10.test
    rows, _ = shifted_sample(labels, seed=4, n=4000)
    return probs[rows], labels[rows]


def test_skewed_stream_estimate_verdict_and_a_better_proposal(client, cifar10, skewed):
    fit_probs, fit_labels = cifar10.fit
    create_model(client, "lenet", k=10, argmax_policy="warn")
    dataset = upload(client, "lenet", fit_probs, fit_labels, kind="probabilities")
    production = promote(client, "lenet", dataset["id"])["version"]
    probs, labels = skewed

    before = served(client, "lenet", probs)
    flush(client)
    r = client.get("/v1/models/lenet/label-shift", params={"window": "30m"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["version"] == production and out["served_rows"] == labels.size
    assert out["classes"] == list(range(10))
    assert out["verdict"]["verdict"] == "shift", out["verdict"]
    estimate = out["estimate"]
    truth = np.bincount(labels, minlength=10) / labels.size
    lower, upper = np.array(estimate["lower"]), np.array(estimate["upper"])
    inside = (lower <= truth) & (truth <= upper)
    assert inside.mean() >= 0.8, (estimate, truth.tolist())
    # Nearer the truth than "no shift" is, and the distance it reports is the hold-out's.
    source = np.array(estimate["source_priors"])
    assert shift.prior_l1_error(estimate["priors"], truth) < shift.prior_l1_error(source, truth)
    assert estimate["prior_l1_distance"] == pytest.approx(
        shift.prior_l1_error(estimate["priors"], source)
    )

    # The same figures in /metrics (its window: the monitoring window, here the same rows).
    gauges = families(client.get("/metrics").text)
    key = (("model", "lenet"), ("namespace", DEFAULT_NAMESPACE), ("version", str(production)))
    assert gauges["welltempered_label_shift_served_rows"][key] == labels.size
    assert gauges["welltempered_label_shift_prior_l1_distance"][key] == pytest.approx(
        estimate["prior_l1_distance"]
    )
    assert gauges["welltempered_label_shift_p_value"][key] == pytest.approx(
        out["verdict"]["p_value"]
    )

    key = {"Idempotency-Key": "shift-1"}
    r = client.post("/v1/models/lenet/label-shift", params={"window": "30m"}, headers=key)
    assert r.status_code == 202, r.text
    again = client.post("/v1/models/lenet/label-shift", params={"window": "30m"}, headers=key)
    assert again.json() == r.json() and again.headers["idempotent-replayed"] == "true"
    proposed = wait_for_version(client, "lenet", r.json()["version"], interval=0.05)
    assert proposed["status"] == "succeeded", proposed["rejection"]
    assert proposed["method"] == "prior-shift" and proposed["source"] == "params"
    assert proposed["params"]["base"]["method"] == "temperature"
    # Evaluated like any version; it changes predictions, so argmax_policy 'warn' warns.
    assert proposed["metrics"]["after"]["n"] == proposed["metrics"]["before"]["n"]
    assert proposed["warning"]
    # Never promoted by itself.
    alias = client.get("/v1/models/lenet/aliases/production").json()
    assert alias["version"] == production

    after = served(client, "lenet", probs, version=proposed["version"])
    assert nll(after, labels) < nll(before, labels)
    print(
        f"\nskewed CIFAR-10 ({labels.size} rows): prior L1 error "
        f"{shift.prior_l1_error(estimate['priors'], truth):.4f} (no-shift "
        f"{shift.prior_l1_error(source, truth):.4f}), {inside.sum()}/10 classes in their "
        f"interval; NLL served {nll(before, labels):.4f}, proposed {nll(after, labels):.4f}"
    )


def test_no_served_rows_gives_a_verdict_and_no_proposal(client, cifar10):
    fit_probs, fit_labels = cifar10.fit
    create_model(client, "quiet", k=10)
    dataset = upload(client, "quiet", fit_probs, fit_labels, kind="probabilities")
    promote(client, "quiet", dataset["id"])
    out = client.get("/v1/models/quiet/label-shift").json()
    assert out["served_rows"] == 0 and out["estimate"] is None and out["unidentified"]
    assert out["verdict"]["verdict"] == "insufficient_data"
    assert_problem(client.post("/v1/models/quiet/label-shift"), 409, "no label-shift estimate")
    assert client.get("/v1/models/quiet/calibrators").json()["calibrators"][-1]["version"] == 1
