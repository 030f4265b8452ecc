"""service.observe: the served sums behind the label-free expected accuracy (the
confidence and squared-confidence counters per version) and the hold-out's mean
confidence, against calibrators.evaluation.shift on the same rows."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calibrators.evaluation import metrics, shift
from service.observe import metrics as obs
from service.observe import monitoring
from tests.oracles import softmax


def samples(metrics_: obs.ServiceMetrics) -> dict[tuple[str, str], float]:
    body, _ = metrics_.render()
    return {
        (s.name, s.labels.get("version", "")): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def test_served_sums_give_the_libraries_expected_accuracy():
    rng = np.random.default_rng(0)
    probs = softmax(rng.normal(scale=2.0, size=(300, 5)))
    confidence = probs.max(axis=1)
    entropy = -(probs * np.log(probs)).sum(axis=1)
    m = obs.ServiceMetrics()
    for rows in np.array_split(np.arange(300), [1, 10, 100]):  # small and large batches
        m.observe_predictions("ns", "m", 3, entropy[rows], confidence[rows])
    m.observe_predictions("ns", "m", 4, entropy[:5], confidence[:5])
    got = samples(m)
    n = got[("welltempered_predictions_total", "3")]
    s1 = got[("welltempered_prediction_confidence_total", "3")]
    s2 = got[("welltempered_prediction_confidence_squared_total", "3")]
    assert (n, s1, s2) == pytest.approx(shift.confidence_sums(probs))
    out = shift.expected_accuracy_from_sums(int(n), s1, s2)
    assert out["estimate"] == pytest.approx(shift.expected_accuracy(probs)["estimate"])
    assert got[("welltempered_prediction_confidence_total", "4")] == pytest.approx(
        confidence[:5].sum()
    )


def test_holdout_confidence_is_the_mean_top_label_confidence_of_the_report():
    rng = np.random.default_rng(1)
    probs = softmax(rng.normal(scale=2.0, size=(500, 4)))
    labels = rng.integers(0, 4, 500)
    report = metrics.report(probs, labels)
    assert monitoring.holdout_confidence(report) == pytest.approx(probs.max(axis=1).mean())
    assert monitoring.holdout_confidence({"bins": None}) is None
