"""calibrators.evaluation.checks.argmax_report: crafted ranks, ties, an identity, a loop
oracle on hypothesis inputs, and column permutations of the shared CIFAR outputs.
calibrators.evaluation.checks.nll_report: the metrics' NLL on both sides, a per-row oracle,
chunking, and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import calibrators
from calibrators import numerics
from calibrators.evaluation import metrics
from calibrators.evaluation.checks import RANK_BUCKETS, argmax_report, nll_report
from calibrators.validation import CalibrationInputError
from tests.oracles import softmax, traced_peak


def _bucket(rank: int) -> str:
    if rank == 1:
        return "1"
    if rank == 2:
        return "2"
    return "3-10" if rank <= 10 else ">10"


def _reference(before, after):
    """Python loops over rows and classes, the documented definitions."""
    before, after = np.asarray(before).tolist(), np.asarray(after).tolist()
    counts = dict.fromkeys(RANK_BUCKETS, 0)
    changed = 0
    for old, new in zip(before, after, strict=True):
        top_old, top_new = old.index(max(old)), new.index(max(new))
        if top_old != top_new:
            changed += 1
            counts[_bucket(1 + sum(v > old[top_new] for v in old))] += 1
    n = len(before)
    return {"n": n, "agreement": (n - changed) / n, "changed": changed, "changed_from_rank": counts}


def test_crafted_changes_from_known_ranks():
    # K = 100, N = 5: in each row the class of original rank r gets most of the
    # calibrated mass; ranks 2, 5, 50 and 100 change the argmax, rank 1 does not.
    k, ranks = 100, [2, 5, 1, 50, 100]
    rng = np.random.default_rng(7)
    before = np.empty((len(ranks), k))
    after = np.full((len(ranks), k), 0.5 / (k - 1))
    for i, rank in enumerate(ranks):
        order = rng.permutation(k)  # order[j] is the class of rank j + 1
        before[i, order] = np.linspace(5.0, -5.0, k)
        after[i, order[rank - 1]] = 0.5
    out = argmax_report(before, after)
    assert out == {
        "n": 5,
        "agreement": 0.2,
        "changed": 4,
        "changed_from_rank": {"1": 0, "2": 1, "3-10": 1, ">10": 2},
    }
    assert out == _reference(before, after)
    # the same scores given as probabilities rank the same way
    assert argmax_report(softmax(before), after, kind="probabilities") == out


def test_identity_keeps_every_argmax(shared):
    logits = np.log(shared.probs)
    out = argmax_report(logits, shared.probs)
    assert out["agreement"] == 1.0 and out["changed"] == 0
    assert out["changed_from_rank"] == dict.fromkeys(RANK_BUCKETS, 0)
    assert argmax_report(shared.probs, shared.probs, kind="probabilities") == out


def test_ties_use_the_first_maximum_and_can_give_rank_one():
    before = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 0.0]])
    after = np.array([[0.2, 0.6, 0.1, 0.1], [0.1, 0.4, 0.4, 0.1], [0.3, 0.3, 0.3, 0.1]])
    # row 0: 0 -> 1, class 1 was tied first (rank 1); row 1: 1 -> 1 (first maximum on
    # both sides), unchanged; row 2: 0 -> 0, unchanged.
    out = argmax_report(before, after)
    assert out["changed"] == 1
    assert out["changed_from_rank"] == {"1": 1, "2": 0, "3-10": 0, ">10": 0}


def test_permuted_columns_of_real_outputs(shared):
    probs = shared.probs
    n, k = probs.shape
    perm = np.random.default_rng(1).permutation(k)
    after = probs[:, perm]  # column j of `after` is column perm[j] of `probs`
    # Independent count: the new top class is the column that holds the old top
    # probability, inverse_perm[old top]; its rank comes from a full sort.
    old_top = probs.argmax(axis=1)
    new_top = np.argsort(perm)[old_top]
    changed = new_top != old_top
    sorted_rows = np.sort(probs, axis=1)
    new_value = probs[np.arange(n), new_top]
    ranks = 1 + k - np.array(
        [
            np.searchsorted(row, v, side="right")
            for row, v in zip(sorted_rows, new_value, strict=True)
        ]
    )
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for rank in ranks[changed]:
        expected[_bucket(int(rank))] += 1

    out = argmax_report(np.log(probs), after)
    assert out["n"] == n
    assert out["changed"] == int(changed.sum())
    assert out["agreement"] == pytest.approx(1 - changed.mean(), abs=1e-15)
    assert out["changed_from_rank"] == expected
    assert sum(out["changed_from_rank"].values()) == out["changed"]
    assert out["changed_from_rank"][">10" if k > 10 else "3-10"] > 0
    assert argmax_report(probs, after, kind="probabilities") == out
    assert json.loads(json.dumps(out)) == out


def test_chunked_ranks_equal_unchunked(monkeypatch, cifar100):
    probs = cifar100.probs[:700]
    after = probs[:, ::-1]
    whole = argmax_report(probs, after, kind="probabilities")
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 350)  # 3 rows of 100 per chunk
    assert argmax_report(probs, after, kind="probabilities") == whole


@pytest.mark.parametrize(
    ("before", "after", "kind", "match"),
    [
        pytest.param([[1.0, 2.0, 3.0]], [[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], "logits",
                     "shape of scores_before", id="rows"),
        pytest.param([[1.0, 2.0, 3.0]], [[0.5, 0.5]], "logits", "shape", id="columns"),
        pytest.param([[1.0, 2.0, 3.0]], [[0.2, 0.3, 0.6]], "logits", "sum to 1", id="after-sum"),
        pytest.param([[1.0, 2.0, 3.0]], [[0.2, 0.3, 0.5]], "probabilities", "sum to 1",
                     id="before-sum"),
        pytest.param([[1.0, np.nan, 3.0]], [[0.2, 0.3, 0.5]], "logits", "finite", id="nan"),
        pytest.param([[1.0, 2.0, 3.0]], [[0.2, 0.3, 0.5]], "probs", "kind", id="kind"),
    ],
)
def test_bad_input_raises(before, after, kind, match):
    with pytest.raises(CalibrationInputError, match=match):
        argmax_report(before, after, kind=kind)


@st.composite
def before_and_after(draw):
    n = draw(st.integers(1, 30))
    k = draw(st.integers(3, 15))
    # small integers: plenty of ties on both sides
    before = draw(arrays(np.float64, (n, k), elements=st.integers(-3, 3).map(float)))
    weights = draw(arrays(np.float64, (n, k), elements=st.integers(0, 3).map(float)))
    weights[weights.sum(axis=1) == 0] = 1.0
    return before, weights / weights.sum(axis=1, keepdims=True)


@given(before_and_after())
def test_matches_a_loop_over_rows(case):
    before, after = case
    out = argmax_report(before, after)
    expected = _reference(before, after)
    assert out["agreement"] == pytest.approx(expected.pop("agreement"), abs=1e-15)
    assert {key: out[key] for key in expected} == expected


def test_thousand_classes_in_bounded_memory():
    n, k = 10_000, 1_000
    rng = np.random.default_rng(0)
    probs = rng.random((n, k), dtype=np.float32)
    probs /= probs.sum(axis=1, keepdims=True)
    # nearly every argmax changes; contiguous, or validation would copy it
    after = np.ascontiguousarray(probs[:, rng.permutation(k)])
    out, peak = traced_peak(argmax_report, probs, after, kind="probabilities")
    assert out["changed"] > 0.99 * n
    # each input is 40 MB; comparing all changed rows at once would gather 40 MB
    # of float32 scores and 10 MB of bools on top of the validation's masks
    assert peak < probs.nbytes, f"peak {peak / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------
# nll_report


def _nll_oracle(before, after, labels, kind):
    """Per-row differences by the documented definition, one row at a time."""
    rows = []
    for b, a, y in zip(np.asarray(before), np.asarray(after), labels, strict=True):
        p = b if kind == "probabilities" else softmax([b])[0]
        rows.append(-np.log(max(a[y], 2.0**-149)) + np.log(max(p[y], 2.0**-149)))
    d = np.array(rows)
    return d.mean(), d.std(ddof=1) / np.sqrt(d.size)


@pytest.mark.parametrize("kind", ["logits", "probabilities"])
def test_nll_report_is_the_metrics_nll_on_both_sides(kind):
    rng = np.random.default_rng(3)
    z = rng.normal(size=(37, 5)) * 3  # K >= 3, N != K
    y = rng.integers(0, 5, 37)
    before = z if kind == "logits" else softmax(z)
    cal = calibrators.create("vector").fit(z, y)
    after = cal.predict_proba(z)
    out = nll_report(before, after, y, kind=kind)
    assert out["n"] == 37
    assert out["before_loss"] == pytest.approx(metrics.scores_report(before, y, kind)["nll"])
    assert out["after_loss"] == pytest.approx(metrics.nll_loss(after, y), rel=1e-12)
    mean, se = _nll_oracle(before, after, y, kind)
    assert out["difference"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
    assert out["standard_error"] == pytest.approx(se, rel=1e-9)
    assert out["difference"] < 0  # fitted on these rows: better on them
    json.dumps(out)


def test_nll_report_of_the_identity_is_zero(cifar100):
    probs, labels = cifar100.test
    out = nll_report(probs, probs.astype(np.float64), labels, kind="probabilities")
    assert out["difference"] == 0.0 and out["standard_error"] == 0.0


def test_nll_report_of_one_hot_probabilities_is_far_worse():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(200, 4))
    y = np.where(rng.random(200) < 0.7, z.argmax(axis=1), rng.integers(0, 4, 200))
    one_hot = np.eye(4)[z.argmax(axis=1)]
    out = nll_report(z, one_hot, y)
    assert out["difference"] > 5 * out["standard_error"] > 0
    assert nll_report(z[:1], one_hot[:1], y[:1])["standard_error"] is None


def test_chunked_nll_report_equals_unchunked(monkeypatch, cifar100):
    probs, labels = cifar100.probs[:700], cifar100.labels[:700]
    after = softmax(np.log(probs) / 1.7)
    whole = nll_report(probs, after, labels, kind="probabilities")
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 350)  # 3 rows of 100 per chunk
    chunked = nll_report(probs, after, labels, kind="probabilities")
    assert chunked == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize(
    ("after", "labels", "match"),
    [
        ([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [0], "shape of scores_before"),
        ([[0.2, 0.3, 0.5]], [3], "labels"),
        ([[0.2, 0.3, 0.5]], [0, 1], "labels"),
        ([[0.2, 0.3, 0.6]], [0], "sum to 1"),
    ],
)
def test_nll_report_refuses_bad_input(after, labels, match):
    with pytest.raises(CalibrationInputError, match=match):
        nll_report([[1.0, 2.0, 3.0]], after, labels)
