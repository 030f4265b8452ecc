"""calibrators.evaluation.metrics: hand-computed examples, a loop-over-bins oracle on
hypothesis inputs, parity with netcal and scikit-learn on the shared CIFAR
outputs, and the sufficient statistics the service accumulates."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.special import entr

from calibrators import numerics
from calibrators.evaluation import metrics
from calibrators.evaluation.metrics import (
    accuracy_score,
    bin_edges,
    bin_statistics,
    brier_loss,
    classwise_calibration_error,
    ece_from_bin_statistics,
    expected_calibration_error,
    log_loss_summary,
    maximum_calibration_error,
    mean_entropy,
    nll_loss,
    reliability_bins,
    report,
    scores_report,
)
from calibrators.numerics import softmax
from calibrators.validation import PROBABILITY_FLOOR, CalibrationInputError
from tests.oracles import traced_peak
from tests.strategies import logits_and_labels, tied_extreme_logits

# N = 4 rows, K = 3 classes. Confidences 0.7, 0.6, 0.5, 0.8; predictions 0, 0, 1, 2,
# so rows 0, 2, 3 are correct.
PROBS = np.array(
    [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
)
LABELS = np.array([0, 1, 1, 2])

LABELLED_FUNCTIONS = [
    expected_calibration_error,
    maximum_calibration_error,
    reliability_bins,
    classwise_calibration_error,
    log_loss_summary,
    nll_loss,
    brier_loss,
    accuracy_score,
    mean_entropy,
    report,
]
REPORT_KEYS = {
    "n", "n_classes", "accuracy", "nll", "nll_median", "nll_p95", "brier", "entropy",
    "ece", "ece_quantile", "mce", "classwise_ece", "n_bins", "bins",
}


# ---------------------------------------------------------------------------
# hand-computed examples


def test_top_label_ece_and_mce_by_hand():
    # 4 bins, edges 0, .25, .5, .75, 1: 0.5 sits on an edge and goes up, so bin 2
    # holds rows 0, 1, 2 (conf 0.6, acc 2/3) and bin 3 holds row 3 (conf 0.8, acc 1).
    ece = 3 / 4 * abs(2 / 3 - 0.6) + 1 / 4 * abs(1.0 - 0.8)
    assert ece == pytest.approx(0.1, abs=1e-15)
    assert expected_calibration_error(PROBS, LABELS, n_bins=4) == pytest.approx(ece, abs=1e-15)
    assert maximum_calibration_error(PROBS, LABELS, n_bins=4) == pytest.approx(0.2, abs=1e-15)
    # 2 bins: everything in the upper one, |0.75 - 0.65|.
    assert expected_calibration_error(PROBS, LABELS, n_bins=2) == pytest.approx(0.1, abs=1e-15)
    assert maximum_calibration_error(PROBS, LABELS, n_bins=2) == pytest.approx(0.1, abs=1e-15)


def test_quantile_ece_by_hand():
    # 2 equal-mass bins split at the median confidence 0.65: {0.5 (right), 0.6 (wrong)}
    # and {0.7 (right), 0.8 (right)}.
    expected = 0.5 * abs(0.5 - 0.55) + 0.5 * abs(1.0 - 0.75)
    got = expected_calibration_error(PROBS, LABELS, n_bins=2, strategy="quantile")
    assert got == pytest.approx(expected, abs=1e-15)
    edges = bin_edges(2, strategy="quantile", confidence=PROBS.max(axis=1))
    assert edges == pytest.approx([0.0, 0.65, 1.0])


def test_reliability_bins_by_hand():
    bins = reliability_bins(PROBS, LABELS, n_bins=4)
    assert bins["edges"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert bins["count"] == [0, 0, 3, 1]
    assert bins["mean_confidence"][:2] == [None, None]
    assert bins["mean_confidence"][2:] == pytest.approx([0.6, 0.8])
    assert bins["accuracy"] == [None, None, pytest.approx(2 / 3), 1.0]


def test_classwise_ece_by_hand():
    # Per class, bins of width 0.25 of that column against labels == k:
    # class 0: p (.7,.6,.2,.1), y (1,0,0,0): bin 0 |0-.3|, bin 2 |1-1.3|      -> 0.6 / 4
    # class 1: p (.2,.3,.5,.1), y (0,1,1,0): bin 0 |0-.3|, bin 1 |1-.3|, bin 2 |1-.5| -> 1.5/4
    # class 2: p (.1,.1,.3,.8), y (0,0,0,1): bin 0 |0-.2|, bin 1 |0-.3|, bin 3 |1-.8| -> 0.7/4
    expected = (0.6 / 4 + 1.5 / 4 + 0.7 / 4) / 3
    got = classwise_calibration_error(PROBS, LABELS, n_bins=4)
    assert got == pytest.approx(expected, abs=1e-15)


def test_proper_scores_accuracy_and_entropy_by_hand():
    nll = sorted(-math.log(p) for p in (0.7, 0.3, 0.5, 0.8))
    summary = log_loss_summary(PROBS, LABELS)
    assert summary["mean"] == pytest.approx(sum(nll) / 4, abs=1e-15)
    assert summary["median"] == pytest.approx((nll[1] + nll[2]) / 2, abs=1e-15)
    # linear interpolation at position 0.95 * (4 - 1) = 2.85
    assert summary["p95"] == pytest.approx(nll[2] + 0.85 * (nll[3] - nll[2]), abs=1e-15)
    assert nll_loss(PROBS, LABELS) == summary["mean"]
    # squared distances to the one-hot label: .14, .86, .38, .06
    assert brier_loss(PROBS, LABELS) == pytest.approx(1.44 / 4, abs=1e-15)
    assert accuracy_score(PROBS, LABELS) == 0.75
    entropies = [-sum(p * math.log(p) for p in row) for row in PROBS.tolist()]
    assert mean_entropy(PROBS) == pytest.approx(sum(entropies) / 4, abs=1e-15)
    assert mean_entropy(PROBS, LABELS) == mean_entropy(PROBS)


def test_zero_probabilities_stay_finite():
    probs = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    labels = np.array([1, 1, 0, 2])
    nll = log_loss_summary(probs, labels)
    floor_cost = -math.log(PROBABILITY_FLOOR)
    assert floor_cost == pytest.approx(103.2789, abs=1e-4)
    assert nll["mean"] == pytest.approx((floor_cost + 0 + math.log(2) + 0) / 4, abs=1e-12)
    assert mean_entropy(probs) == pytest.approx(math.log(2) / 4, abs=1e-15)
    out = report(probs, labels)
    assert all(math.isfinite(v) for v in out.values() if isinstance(v, float))


def test_ties_predict_the_first_maximum():
    probs = np.array([[0.4, 0.4, 0.2], [0.3, 0.3, 0.4], [0.25, 0.5, 0.25], [0.5, 0.0, 0.5]])
    assert accuracy_score(probs, [1, 2, 1, 0]) == 0.75
    assert accuracy_score(probs, [0, 2, 1, 2]) == 0.75


# ---------------------------------------------------------------------------
# bin-edge conventions


def test_confidence_on_an_edge_goes_in_the_bin_above_and_one_in_the_last():
    stats = bin_statistics([0.0, 0.25, 0.5, 0.75, 1.0], np.ones(5, dtype=bool), 4)
    assert stats["count"].tolist() == [1, 1, 1, 2]
    # A row of thirds has confidence exactly 1/3 = the first interior edge of 3 bins;
    # a one-hot row has confidence 1.0.
    probs = np.array([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])
    assert reliability_bins(probs, [0, 0, 2, 2], n_bins=3)["count"] == [0, 2, 2]


def test_edges_are_the_float_linspace():
    # linspace(0, 1, 6)[3] is 0.6000000000000001, so 0.6 is below it: bin 2, not 3.
    assert bin_edges(5)[3] == 0.6000000000000001
    assert bin_statistics([0.6], [True], 5)["count"].tolist() == [0, 0, 1, 0, 0]


def test_confidence_above_one_within_tolerance_goes_in_the_last_bin():
    probs = np.array([[1.0005, 0.0, 0.0], [0.1, 0.2, 0.7]])
    assert reliability_bins(probs, [0, 2], n_bins=10)["count"][-1] == 1
    assert bin_statistics([1.0005], [1], 4, strategy="quantile")["count"].tolist() == [0, 0, 0, 1]


# ---------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("function", LABELLED_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("probs", "labels"),
    [
        pytest.param([[0.5, 0.6, 0.1], [0.2, 0.3, 0.5]], [0, 1], id="row-sum"),
        pytest.param([[np.nan, 0.5, 0.5], [0.2, 0.3, 0.5]], [0, 1], id="nan"),
        pytest.param([[-0.1, 0.6, 0.5], [0.2, 0.3, 0.5]], [0, 1], id="negative"),
        pytest.param([0.2, 0.3, 0.5], [0], id="1-d"),
        pytest.param([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [0, 3], id="label-range"),
        pytest.param([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [0], id="label-length"),
        pytest.param([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [0.5, 1], id="label-float"),
    ],
)
def test_bad_input_raises_the_shared_error(function, probs, labels):
    with pytest.raises(CalibrationInputError):
        function(probs, labels)


@pytest.mark.parametrize("n_bins", [0, -3, 1.5, True, "15", None, 10_001])
def test_bad_n_bins_raises(n_bins):
    for function in (expected_calibration_error, classwise_calibration_error, report):
        with pytest.raises(CalibrationInputError, match="n_bins must be an integer >= 1") as info:
            function(PROBS, LABELS, n_bins=n_bins)
        assert str(info.value).endswith(f"Got {n_bins!r}.")


def test_bad_strategy_raises():
    with pytest.raises(CalibrationInputError, match=r"strategy must be .* Got 'equal'\."):
        expected_calibration_error(PROBS, LABELS, strategy="equal")


def test_bin_statistics_validation():
    with pytest.raises(CalibrationInputError, match="same length"):
        bin_statistics([0.5, 0.6], [True], 4)
    with pytest.raises(CalibrationInputError, match="finite"):
        bin_statistics([0.5, np.inf], [True, False], 4)
    with pytest.raises(CalibrationInputError, match="booleans"):
        bin_statistics([0.5, 0.6], [2, 0], 4)
    with pytest.raises(CalibrationInputError, match="at least one"):
        bin_statistics([], [], 4)
    with pytest.raises(CalibrationInputError, match="1-D"):
        bin_statistics([[0.5]], [[True]], 4)


def test_quantile_edges_need_confidences():
    with pytest.raises(CalibrationInputError, match="needs the confidences"):
        bin_edges(4, strategy="quantile")


def test_ece_from_bin_statistics_validation():
    with pytest.raises(CalibrationInputError, match="same positive length"):
        ece_from_bin_statistics([1, 2], [0.5], [1, 1])
    with pytest.raises(CalibrationInputError, match="at least one row"):
        ece_from_bin_statistics([0, 0], [0.0, 0.0], [0, 0])
    with pytest.raises(CalibrationInputError, match="correct_count <= count"):
        ece_from_bin_statistics([1, 2], [0.5, 1.5], [2, 1])
    with pytest.raises(CalibrationInputError, match="n_bins \\+ 1"):
        ece_from_bin_statistics([1, 2], [0.5, 1.5], [1, 1], edges=[0.0, 1.0])


# ---------------------------------------------------------------------------
# report


def _assert_plain_json(value):
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            _assert_plain_json(item)
    elif isinstance(value, list):
        for item in value:
            _assert_plain_json(item)
    else:
        assert value is None or type(value) in (int, float), (value, type(value))


def test_report_is_plain_json_and_matches_the_individual_functions(cifar10):
    probs, labels = cifar10.test
    out = report(probs, labels, n_bins=12)
    assert REPORT_KEYS <= out.keys()
    _assert_plain_json(out)
    assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert out["n"] == 5000 and out["n_classes"] == 10 and out["n_bins"] == 12
    assert out["accuracy"] == accuracy_score(probs, labels)
    summary = log_loss_summary(probs, labels)
    assert (out["nll"], out["nll_median"], out["nll_p95"]) == (
        summary["mean"], summary["median"], summary["p95"]
    )
    assert out["brier"] == brier_loss(probs, labels)
    assert out["entropy"] == mean_entropy(probs)
    assert out["ece"] == expected_calibration_error(probs, labels, n_bins=12)
    assert out["ece_quantile"] == expected_calibration_error(
        probs, labels, n_bins=12, strategy="quantile"
    )
    assert out["mce"] == maximum_calibration_error(probs, labels, n_bins=12)
    assert out["classwise_ece"] == classwise_calibration_error(probs, labels, n_bins=12)
    assert out["bins"] == reliability_bins(probs, labels, n_bins=12)
    assert sum(out["bins"]["count"]) == out["n"]
    assert len(out["bins"]["edges"]) == 13
    # the typical row does much better than the mean says
    assert out["nll_median"] < out["nll"] < out["nll_p95"]


def test_report_default_bins_and_list_input():
    out = report(PROBS.tolist(), LABELS.tolist())
    assert out["n_bins"] == 15 and len(out["bins"]["count"]) == 15
    # 15 bins put each row alone in its bin: ECE = mean |correct - confidence|
    assert out["bins"]["count"].count(1) == 4
    assert out["ece"] == pytest.approx((0.3 + 0.6 + 0.5 + 0.2) / 4, abs=1e-15)


def test_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.full(7, 0.3), size=53)
    labels = rng.integers(0, 7, size=53)
    whole = report(probs, labels, n_bins=6)
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 20)  # 2 rows per chunk, last one short
    chunked = report(probs, labels, n_bins=6)
    for key, value in whole.items():
        if isinstance(value, float):
            assert chunked[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        else:
            assert chunked[key] == value, key


def test_large_float32_input_needs_no_full_size_float64_temporary():
    n, k = 10_000, 1_000
    rng = np.random.default_rng(0)
    probs = rng.random((n, k), dtype=np.float32)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = rng.integers(0, k, size=n)
    _, peak = traced_peak(report, probs, labels)
    # the input is 40 MB; one float64 copy of it would be 80 MB
    assert peak < probs.nbytes, f"peak {peak / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------
# sufficient statistics


def test_statistics_of_batches_add_up_to_the_rows(shared):
    probs, labels = shared.probs, shared.labels
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == labels
    whole = bin_statistics(confidence, correct)
    cuts = [0, 1, 137, 2048, 2049, 6000, 9999, labels.shape[0]]
    parts = [bin_statistics(confidence[a:b], correct[a:b]) for a, b in itertools.pairwise(cuts)]
    summed = {
        key: sum(part[key] for part in parts)
        for key in ("count", "confidence_sum", "correct_count")
    }
    assert summed["count"].tolist() == whole["count"].tolist()
    assert summed["correct_count"].tolist() == whole["correct_count"].tolist()
    np.testing.assert_allclose(summed["confidence_sum"], whole["confidence_sum"], rtol=1e-12)
    live = ece_from_bin_statistics(**summed)  # default edges: equal width
    from_rows = report(probs, labels)
    assert abs(live["ece"] - from_rows["ece"]) < 1e-12
    assert abs(live["mce"] - from_rows["mce"]) < 1e-12
    assert live["bins"]["count"] == from_rows["bins"]["count"]
    assert live["n"] == from_rows["n"]


def test_quantile_bins_have_equal_mass_on_distinct_confidences(shared):
    probs, labels = shared.probs, shared.labels
    counts = reliability_bins(probs, labels, strategy="quantile")["count"]
    n = labels.shape[0]
    assert min(counts) >= n // 15 - 1 and max(counts) <= n // 15 + 2


# ---------------------------------------------------------------------------
# independent oracle: a loop over bins on hypothesis inputs


@st.composite
def labelled_probabilities(draw):
    n = draw(st.integers(1, 40))
    k = draw(st.integers(3, 6))
    # small integer weights make ties and confidences on bin edges (1/2, 1/3, 2/3, ...)
    weight = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 1.0))
    weights = draw(arrays(np.float64, (n, k), elements=weight))
    weights[weights.sum(axis=1) == 0] = 1.0
    probs = weights / weights.sum(axis=1, keepdims=True)
    labels = draw(arrays(np.int64, n, elements=st.integers(0, k - 1)))
    n_bins = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 10, 12, 15]))
    return probs, labels, n_bins


def _members(values, edges, b):
    """Indices of the values in bin b, by the documented rule, one value at a time."""
    last = len(edges) - 2
    return [
        i for i, v in enumerate(values)
        if edges[b] <= v and (b == last or v < edges[b + 1])
    ]


def _reference_top_label(probs, labels, edges):
    rows = probs.tolist()
    confidence = [max(row) for row in rows]
    correct = [row.index(max(row)) == int(y) for row, y in zip(rows, labels, strict=True)]
    ece, mce, counts = 0.0, 0.0, []
    for b in range(len(edges) - 1):
        members = _members(confidence, edges, b)
        counts.append(len(members))
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            conf = sum(confidence[i] for i in members) / len(members)
            ece += len(members) / len(rows) * abs(acc - conf)
            mce = max(mce, abs(acc - conf))
    return ece, mce, counts


def _reference_classwise(probs, labels, n_bins):
    edges = np.linspace(0.0, 1.0, n_bins + 1).tolist()
    n, k = probs.shape
    total = 0.0
    for c in range(k):
        column = probs[:, c].tolist()
        for b in range(n_bins):
            members = _members(column, edges, b)
            if members:
                freq = sum(int(labels[i]) == c for i in members) / len(members)
                conf = sum(column[i] for i in members) / len(members)
                total += len(members) / n * abs(freq - conf)
    return total / k


@given(labelled_probabilities())
def test_top_label_metrics_match_a_loop_over_bins(case):
    probs, labels, n_bins = case
    edges = np.linspace(0.0, 1.0, n_bins + 1).tolist()
    ece, mce, counts = _reference_top_label(probs, labels, edges)
    assert expected_calibration_error(probs, labels, n_bins=n_bins) == pytest.approx(
        ece, abs=1e-12
    )
    assert maximum_calibration_error(probs, labels, n_bins=n_bins) == pytest.approx(
        mce, abs=1e-12
    )
    bins = reliability_bins(probs, labels, n_bins=n_bins)
    assert bins["count"] == counts
    assert bins["edges"] == edges


@given(labelled_probabilities())
def test_quantile_ece_matches_a_loop_over_bins(case):
    probs, labels, n_bins = case
    confidence = probs.max(axis=1)
    edges = np.quantile(confidence, np.linspace(0.0, 1.0, n_bins + 1))
    edges[0], edges[-1] = 0.0, 1.0
    ece, _, counts = _reference_top_label(probs, labels, edges.tolist())
    got = expected_calibration_error(probs, labels, n_bins=n_bins, strategy="quantile")
    assert got == pytest.approx(ece, abs=1e-12)
    assert reliability_bins(probs, labels, n_bins=n_bins, strategy="quantile")["count"] == counts


@given(labelled_probabilities())
def test_classwise_ece_matches_a_loop_over_bins(case):
    probs, labels, n_bins = case
    expected = _reference_classwise(probs, labels, n_bins)
    got = classwise_calibration_error(probs, labels, n_bins=n_bins)
    assert got == pytest.approx(expected, abs=1e-12)


@given(labelled_probabilities())
def test_statistics_path_equals_the_row_path(case):
    probs, labels, n_bins = case
    stats = bin_statistics(probs.max(axis=1), probs.argmax(axis=1) == labels, n_bins)
    live = ece_from_bin_statistics(stats["count"], stats["confidence_sum"], stats["correct_count"])
    assert live["ece"] == pytest.approx(
        expected_calibration_error(probs, labels, n_bins=n_bins), abs=1e-12
    )
    assert live["bins"] == reliability_bins(probs, labels, n_bins=n_bins)


@given(labelled_probabilities())
def test_scores_stay_in_their_ranges(case):
    probs, labels, n_bins = case
    out = report(probs, labels, n_bins=n_bins)
    k = probs.shape[1]
    assert 0.0 <= out["ece"] <= out["mce"] + 1e-15 <= 1.0 + 1e-15
    assert 0.0 <= out["ece_quantile"] <= 1.0
    assert 0.0 <= out["classwise_ece"] <= 1.0
    assert 0.0 <= out["brier"] <= 2.0 + 1e-12
    assert -1e-15 <= out["entropy"] <= math.log(k) + 1e-12
    assert 0.0 <= out["nll_median"] <= out["nll_p95"] <= -math.log(PROBABILITY_FLOOR)


# ---------------------------------------------------------------------------
# parity with netcal and scikit-learn on the shared CIFAR outputs


@pytest.fixture
def netcal_metrics():
    netcal = pytest.importorskip("netcal.metrics", reason="netcal (dev dependency) missing")
    return netcal


def _netcal(metric, probs, labels):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return metric.measure(probs, labels)


def test_ece_and_mce_match_netcal(shared, netcal_metrics):
    probs, labels = shared.probs, shared.labels  # float32, as published
    out = report(probs, labels)
    assert abs(out["ece"] - _netcal(netcal_metrics.ECE(15), probs, labels)) < 1e-6
    assert abs(out["mce"] - _netcal(netcal_metrics.MCE(15), probs, labels)) < 1e-6
    for n_bins in (10, 20):
        ece = expected_calibration_error(probs, labels, n_bins=n_bins)
        assert abs(ece - _netcal(netcal_metrics.ECE(n_bins), probs, labels)) < 1e-6


def test_quantile_ece_matches_netcal_equal_mass_ece(shared, netcal_metrics):
    # float64: on float32 input netcal bins counts and means against differently
    # rounded edges (see the metrics module docstring), 2.7e-6 off on CIFAR-100.
    probs, labels = shared.probs.astype(np.float64), shared.labels
    ours = expected_calibration_error(probs, labels, strategy="quantile")
    theirs = _netcal(netcal_metrics.ECE(15, equal_intervals=False), probs, labels)
    assert abs(ours - theirs) < 1e-6


def test_netcal_ace_is_the_unweighted_mean_of_our_bin_gaps(shared, netcal_metrics):
    probs, labels = shared.probs.astype(np.float64), shared.labels
    for equal_intervals, strategy in ((True, "uniform"), (False, "quantile")):
        bins = reliability_bins(probs, labels, strategy=strategy)
        gaps = [
            abs(acc - conf)
            for acc, conf in zip(bins["accuracy"], bins["mean_confidence"], strict=True)
            if acc is not None
        ]
        theirs = _netcal(netcal_metrics.ACE(15, equal_intervals=equal_intervals), probs, labels)
        assert abs(sum(gaps) / len(gaps) - theirs) < 1e-6


def test_classwise_ece_is_the_mean_of_netcal_binary_eces(shared, netcal_metrics):
    probs, labels = shared.probs, shared.labels
    ece = netcal_metrics.ECE(15)
    per_class = [
        _netcal(ece, probs[:, k], (labels == k).astype(np.int64)) for k in range(probs.shape[1])
    ]
    assert abs(classwise_calibration_error(probs, labels) - np.mean(per_class)) < 1e-6


def test_nll_and_brier_match_scikit_learn(shared):
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    probs = shared.probs.astype(np.float64)
    probs /= probs.sum(axis=1, keepdims=True)  # scikit-learn renormalises; do it first
    labels = shared.labels
    classes = np.arange(probs.shape[1])
    assert nll_loss(probs, labels) == pytest.approx(
        sklearn_metrics.log_loss(labels, probs, labels=classes), abs=1e-10
    )
    assert brier_loss(probs, labels) == pytest.approx(
        sklearn_metrics.brier_score_loss(labels, probs, labels=classes, scale_by_half=False),
        abs=1e-10,
    )
    assert accuracy_score(probs, labels) == sklearn_metrics.accuracy_score(
        labels, probs.argmax(axis=1)
    )


@pytest.mark.parametrize("kind", ["logits", "probabilities"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_report_is_the_report_of_the_probabilities_without_holding_them(kind, dtype):
    from calibrators.numerics import CHUNK_ELEMENTS
    from calibrators.validation import to_probabilities

    rng = np.random.default_rng(7)
    n, k = 3 * CHUNK_ELEMENTS // 50 + 17, 50  # several row chunks, the last one short
    z = rng.normal(size=(n, k)) * 3
    scores = (z if kind == "logits" else to_probabilities(z, "logits")).astype(dtype)
    y = rng.integers(0, k, n)
    got = scores_report(scores, y, kind)
    want = report(to_probabilities(scores, kind), y)
    # Every figure to the bit, but the entropy of logits: log S - sum p d (one log per
    # row), not -sum p log p (one per entry), equal to rounding.
    assert got.pop("entropy") == pytest.approx(want.pop("entropy"), rel=1e-12)
    assert got == want


# ---------------------------------------------------------------------------
# the metrics of an upload (scores_report) at language-model K: a straightforward
# reference on hypothesis inputs, the classwise binning to the bit, memory


def _reference_report(probs, labels, n_bins):
    """Every figure of ``report`` the straightforward way: the whole float64 matrix,
    every entry binned, one log per entry."""
    n, k = probs.shape
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    true_p = probs[np.arange(n), labels]
    nll = -np.log(np.maximum(true_p, PROBABILITY_FLOOR))
    onehot = np.eye(k, dtype=bool)[labels]
    ece, mce, counts = _reference_top_label(probs, labels, edges.tolist())
    confidence = probs.max(axis=1)
    quantile = np.quantile(confidence, np.linspace(0.0, 1.0, n_bins + 1))
    quantile[0], quantile[-1] = 0.0, 1.0
    ece_quantile, _, _ = _reference_top_label(probs, labels, quantile.tolist())
    index = np.searchsorted(edges[1:-1], probs, side="right")  # every entry's bin
    classwise = 0.0
    for b in range(n_bins):
        member = index == b
        positives = (member & onehot).sum(axis=0)
        classwise += np.abs(positives - np.where(member, probs, 0.0).sum(axis=0)).sum()
    return {
        "n": n,
        "n_classes": k,
        "accuracy": float((probs.argmax(axis=1) == labels).mean()),
        "nll": float(nll.mean()),
        "nll_median": float(np.median(nll)),
        "nll_p95": float(np.percentile(nll, 95.0)),
        "brier": float(((probs - onehot) ** 2).sum(axis=1).mean()),
        "entropy": float(entr(probs).sum(axis=1).mean()),
        "ece": ece,
        "ece_quantile": ece_quantile,
        "mce": mce,
        "classwise_ece": classwise / (n * k),
        "n_bins": n_bins,
        "counts": counts,
    }


def _assert_matches_reference(got, want):
    """Counts exactly; every float within 1e-12 (relative for the entropy, up to log K)."""
    assert got["bins"]["count"] == want.pop("counts")
    assert got.pop("entropy") == pytest.approx(want.pop("entropy"), rel=1e-12, abs=1e-12)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=0, abs=1e-12), key


@st.composite
def labelled_logits(draw):
    """Logits with labels: random (float32 or float64, K = 2 often), or tied and
    extreme (+-1e4, a constant row); the bins; a chunk size of a few rows."""
    kind = draw(st.sampled_from(["random", "two", "tied"]))
    if kind == "tied":
        z = draw(tied_extreme_logits())
        y = draw(arrays(np.int64, z.shape[0], elements=st.integers(0, z.shape[1] - 1)))
    else:
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        z, y = draw(logits_and_labels(max_classes=2 if kind == "two" else 12, dtype=dtype))
    n_bins = draw(st.sampled_from([1, 2, 3, 5, 10, 15]))
    chunk = draw(st.integers(1, 4)) * z.shape[1]
    return z, y, n_bins, chunk


@given(labelled_logits())
def test_scores_report_equals_a_straightforward_reference(case):
    z, y, n_bins, chunk = case
    with mock.patch.object(numerics, "CHUNK_ELEMENTS", chunk):
        got = scores_report(z, y, n_bins=n_bins)
    _assert_matches_reference(got, _reference_report(softmax(z.astype(np.float64)), y, n_bins))


@given(labelled_probabilities(), st.integers(1, 4))
def test_report_equals_a_straightforward_reference(case, rows_per_chunk):
    probs, labels, n_bins = case
    with mock.patch.object(numerics, "CHUNK_ELEMENTS", rows_per_chunk * probs.shape[1]):
        got = report(probs, labels, n_bins=n_bins)
    _assert_matches_reference(got, _reference_report(probs, labels, n_bins))


def _binned_errors(probs, labels, n_bins, chunk_rows):
    """The per-class ECE as it was computed before: every entry binned (searchsorted
    + bincount), the row chunks' sums added in order, the whole (K, n_bins) table."""
    n, k = probs.shape
    inner = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    sums = np.zeros(k * n_bins)
    for start in range(0, n, chunk_rows):
        chunk = probs[start : start + chunk_rows]
        index = np.searchsorted(inner, chunk, side="right") + np.arange(k) * n_bins
        sums += np.bincount(index.ravel(), weights=chunk.ravel(), minlength=k * n_bins)
    true_bin = np.searchsorted(inner, probs[np.arange(n), labels], side="right")
    positives = np.bincount(labels * n_bins + true_bin, minlength=k * n_bins)
    return np.abs(positives - sums).reshape(k, n_bins).sum(axis=1) / n


def _classwise_errors(probs, labels, n_bins, chunk_rows):
    sums = metrics._ClasswiseSums(probs.shape[1], n_bins)
    for start in range(0, probs.shape[0], chunk_rows):
        chunk = probs[start : start + chunk_rows].copy()
        sums.add(metrics._classwise_chunk(chunk, bin_edges(n_bins)[1:-1]))
    return sums.errors(probs[np.arange(probs.shape[0]), labels], labels)


@given(labelled_probabilities(), st.integers(1, 5), st.booleans())
def test_classwise_errors_equal_binning_every_entry_to_the_bit(case, chunk_rows, sparse):
    # sparse: only the (class, bin) slots with entries are kept, as above a chunk's size
    probs, labels, n_bins = case
    with mock.patch.object(numerics, "CHUNK_ELEMENTS", 1 if sparse else 1 << 18):
        got = _classwise_errors(probs, labels, n_bins, chunk_rows)
    assert np.array_equal(got, _binned_errors(probs, labels, n_bins, chunk_rows))


def test_classwise_errors_to_the_bit_at_language_model_k():
    # K = 10 keeps a dense (K, n_bins) array; K = 50,000 only the slots with entries.
    rng = np.random.default_rng(11)
    for k in (10, 50_000):
        probs = softmax(rng.standard_t(3, size=(40, k)) * 3)
        labels = np.where(rng.random(40) < 0.5, probs.argmax(axis=1), rng.integers(0, k, 40))
        got = _classwise_errors(probs, labels, 15, 7)
        assert np.array_equal(got, _binned_errors(probs, labels, 15, 7))


def test_the_figures_do_not_depend_on_the_number_of_threads(monkeypatch):
    rng = np.random.default_rng(5)
    z = rng.standard_t(3, size=(300, 2_000)).astype(np.float32) * 4
    y = rng.integers(0, 2_000, 300)
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 7 * 2_000)  # 43 chunks
    out = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("WELLTEMPERED_THREADS", threads)
        out[threads] = scores_report(z, y)
    assert out["1"] == out["2"] == out["3"]


def test_entropy_of_logits_past_float64s_range_stays_finite():
    # u - max(u) = -inf: 0 * -inf in the dot product; those rows take entr instead
    z = np.array([[1e308, -1e308, 0.0], [-1e308, 1e308, 1e308], [0.0, 1.0, 2.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the overflow of u - max(u)
        p, entropy = numerics.softmax_entropy(z.copy())
        out = scores_report(z, [0, 1, 2])
    assert np.isfinite(entropy).all() and math.isfinite(out["entropy"])
    np.testing.assert_allclose(entropy, entr(p).sum(axis=1), rtol=1e-12, atol=0)
    assert entropy[0] == 0.0 and entropy[1] == pytest.approx(math.log(2), rel=1e-15)


def test_scores_report_memory_is_chunks_and_sums_of_k_not_copies():
    n, k = 1_024, 16_384
    rng = np.random.default_rng(0)
    z = rng.standard_normal((n, k), dtype=np.float32) * 3
    y = rng.integers(0, k, n)
    _, peak = traced_peak(scores_report, z, y)
    # The input is 64 MiB; one float64 copy of it would be 128. What may remain: each
    # thread's float64 chunk (2 MiB), its probabilities and a few smaller temporaries,
    # and twice the classwise sums (K x 15 float64, 1.9 MiB).
    chunk, sums = numerics.CHUNK_ELEMENTS * 8, k * 15 * 8
    bound = 3 * numerics.n_threads() * chunk + 3 * sums
    assert peak < bound < z.nbytes / 2, f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f}"
