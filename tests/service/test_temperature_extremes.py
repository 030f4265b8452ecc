"""A temperature fit over the HTTP API on logits at the edges of float64: the fit
succeeds with the answer of the moderate logits, or fails with the library's reason;
never a 500."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.service.helpers import create_model, fit, logits_data, upload


@pytest.mark.parametrize("e", [-1000, 1000])
def test_temperature_on_logits_scaled_by_two_to_the_thousand(client, e):
    logits, labels = logits_data(n=200, k=4, seed=3)
    betas = []
    for name, scores in (("plain", logits), ("scaled", np.ldexp(logits, e))):
        create_model(client, name)
        dataset = upload(client, name, scores, labels)
        version = fit(client, name, dataset["id"], method="temperature")
        assert version["status"] == "succeeded", version
        betas.append(version["params"]["weight"])
    assert math.ldexp(betas[1], e) == pytest.approx(betas[0], rel=1e-12)


def test_temperature_on_logits_float64_cannot_serve_fails_with_the_reason(client):
    # Labels below their rows' mean: beta -> 0, below float64's normal range here.
    logits = np.array([[1.5e308, -1.5e308, 0.0], [0.0, 1.0e308, -1.0e308]] * 10)
    create_model(client, "m", k=3)
    dataset = upload(client, "m", logits, [1, 2] * 10)
    version = fit(client, "m", dataset["id"], method="temperature")
    assert version["status"] == "failed", version
    assert "float64's normal range" in str(version), version
