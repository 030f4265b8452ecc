"""service.observe.token_nll: per-token NLL quantiles of labelled feedback from a fixed
histogram, in the library and through feedback and /metrics (SQLite and PostgreSQL)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from service.observe import token_nll
from tests.service.helpers import create_model, families, logits_data, promote, upload

#: The histogram's promise: a quantile within this factor of the exact one (>= 1e-4 nats).
RATIO = 10 ** (1 / token_nll.BINS_PER_DECADE)


def within_a_bin(estimate: float, exact: float) -> bool:
    if exact < token_nll.SMALLEST:
        return abs(estimate - exact) <= token_nll.SMALLEST
    return exact / RATIO <= estimate <= exact * RATIO


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3000),
    st.floats(-8.0, 3.0),
    st.floats(0.1, 3.0),
    st.integers(0, 2**32 - 1),
)
def test_quantiles_lie_in_the_bin_of_the_exact_ones(n, mu, sigma, seed):
    # At most -log(2**-149), the largest NLL the service computes.
    nll = np.minimum(np.random.default_rng(seed).lognormal(mu, sigma, n), 149 * np.log(2))
    estimates = token_nll.quantiles(token_nll.nll_histogram(nll))
    exact = np.quantile(nll, token_nll.QUANTILES, method="inverted_cdf")
    for e, x in zip(estimates, exact, strict=True):
        assert within_a_bin(e, x), (e, x)


def test_histograms_add_up_and_an_empty_one_has_no_quantiles():
    a, b = np.random.default_rng(0).exponential(1.0, (2, 500))
    assert (
        token_nll.nll_histogram(a) + token_nll.nll_histogram(b)
        == token_nll.nll_histogram(np.concatenate([a, b]))
    ).all()
    assert token_nll.quantiles(np.zeros(token_nll.N_BINS, dtype=int)) == [None, None]


def test_feedback_exports_the_token_nll_quantiles(client):
    logits, labels = logits_data(n=600, k=6, seed=5)
    create_model(client, "lm", k=6)
    promote(client, "lm", upload(client, "lm", logits, labels)["id"])
    for rows in np.array_split(np.arange(600), 3):  # three posts add up
        r = client.post(
            "/v1/models/lm/feedback",
            json={"logits": logits[rows].tolist(), "labels": labels[rows].tolist()},
        )
        assert r.status_code == 200, r.text
    served = client.post("/v1/models/lm/predict", json={"logits": logits.tolist()})
    probs = np.asarray(served.json()["probabilities"], dtype=np.float64)
    nll = -np.log(probs[np.arange(600), labels])
    exact = np.quantile(nll, token_nll.QUANTILES, method="inverted_cdf")
    gauges = families(client.get("/metrics").text)["welltempered_live_token_nll_nats"]
    got = {dict(labels_)["quantile"]: v for labels_, v in gauges.items()}
    assert set(got) == {"0.5", "0.95"}
    for q, x in zip(("0.5", "0.95"), exact, strict=True):
        assert within_a_bin(got[q], x), (q, got[q], x)
    # Not just the mean: the median is below it, the p95 above.
    assert got["0.5"] < nll.mean() < got["0.95"]
    # The same figures in GET monitoring's live_nll, beside its exact mean.
    body = client.get("/v1/models/lm/monitoring", params={"window": "1h"}).json()
    live_nll = body["live_nll"]
    assert live_nll["n"] == body["live"]["n"] == 600 and live_nll["complete"]
    assert (live_nll["median"], live_nll["p95"]) == (got["0.5"], got["0.95"])
    assert live_nll["relative_error"] == RATIO - 1
    assert abs(body["live"]["nll"] - nll.mean()) < 1e-9


def test_monitoring_without_feedback_has_no_nll_quantiles(client):
    logits, labels = logits_data(n=200, k=4, seed=6)
    create_model(client, "quiet", k=4)
    promote(client, "quiet", upload(client, "quiet", logits, labels)["id"])
    live_nll = client.get("/v1/models/quiet/monitoring").json()["live_nll"]
    assert live_nll["n"] == 0 and live_nll["median"] is None and live_nll["p95"] is None
    assert live_nll["complete"]
