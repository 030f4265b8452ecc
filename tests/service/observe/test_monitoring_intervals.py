"""The calibration errors with intervals in the service: the live window's debiased ECE
from its per-bin sums, the hold-out figures of a fitted version, and their gauges."""

from __future__ import annotations

import numpy as np
import pytest

from calibrators.evaluation import metrics
from service.observe import monitoring
from service.vocabulary import DEFAULT_NAMESPACE
from tests.service.helpers import create_model, families, logits_data, promote, upload

BOUNDS = ("", "_lower", "_upper")


def test_live_debiased_ece_from_sums_equals_the_rows():
    """Two batches' per-bin sums added: the debiased ECE and its interval equal the
    library's on all the rows; the smooth ECE (needs rows) is None and listed."""
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(900, 5))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = rng.integers(0, 5, 900)
    first = monitoring.feedback_statistics(probs[:400], labels[:400])
    second = monitoring.feedback_statistics(probs[400:], labels[400:])
    summed = {name: first[name] + second[name] for name in first}
    live = monitoring.live_report(summed, 5)
    expected = metrics.debiased_calibration_error(probs, labels)
    for key, part in monitoring.DEBIASED_KEYS.items():
        assert live[key] == pytest.approx(expected[part], rel=1e-12, abs=1e-15), key
    assert live["ece_debiased_lower"] <= live["ece_debiased"] <= live["ece_debiased_upper"]
    assert set(live) - {"not_from_aggregates"} == set(metrics.report(probs, labels))
    for key in ("smooth_ece", "smooth_ece_lower", "smooth_ece_upper"):
        assert live[key] is None and key in live["not_from_aggregates"]
    empty = monitoring.live_report(monitoring.empty_statistics(), 5)
    assert all(empty[key] is None for key in monitoring.DEBIASED_KEYS)


def test_gauges_export_estimate_and_bounds(client):
    logits, labels = logits_data(400, k=4)
    create_model(client, "band")
    version = promote(client, "band", upload(client, "band", logits, labels)["id"])
    after = version["metrics"]["after"]
    assert after["smooth_ece_lower"] <= after["smooth_ece"] <= after["smooth_ece_upper"]
    body = {"logits": logits[:300].tolist(), "labels": labels[:300].tolist()}
    assert client.post("/v1/models/band/feedback", json=body).status_code == 200
    live = client.get("/v1/models/band/monitoring", params={"window": "1h"}).json()["live"]
    gauges = families(client.get("/metrics").text)

    model = {"namespace": DEFAULT_NAMESPACE, "model": "band", "version": str(version["version"])}
    key = tuple(sorted(model.items()))
    hold = tuple(sorted({**model, "alias": "production"}.items()))
    for bound in BOUNDS:
        name = f"welltempered_live_ece_debiased{bound}_ratio"
        assert gauges[name][key] == pytest.approx(live[f"ece_debiased{bound}"], rel=1e-12)
        for figure in ("ece_debiased", "smooth_ece"):
            name = f"welltempered_holdout_{figure}{bound}_ratio"
            assert gauges[name][hold] == after[f"{figure}{bound}"]
