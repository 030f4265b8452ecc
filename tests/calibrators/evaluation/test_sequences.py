"""Rows that are tokens of texts: calibrators.evaluation.holdout's split by sequence and
calibrators.evaluation.metrics.sequence_nll_summary."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrators import CalibrationInputError
from calibrators.evaluation.holdout import split_indices
from calibrators.evaluation.metrics import (
    log_loss_summary,
    report,
    scores_report,
    sequence_nll_summary,
)
from tests.oracles import softmax


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=2, max_size=60),
    holdout=st.floats(0.05, 0.95),
    seed=st.integers(0, 2**32),
    shuffle=st.integers(0, 2**32),
)
def test_no_sequence_is_on_both_sides(sizes, holdout, seed, shuffle):
    groups = np.repeat(np.arange(len(sizes)) * 7 + 3, sizes)  # ids need not be 0..G-1
    groups = groups[np.random.default_rng(shuffle).permutation(len(groups))]  # interleaved
    n = len(groups)
    try:
        fit, held = split_indices(n, holdout, seed, groups=groups)
    except CalibrationInputError as exc:
        assert "sequence" in str(exc)
        return
    assert sorted(np.concatenate([fit, held]).tolist()) == list(range(n))
    assert not set(groups[fit]) & set(groups[held])
    assert len(held) >= 1 and len(fit) >= 2
    # Nearest the row share whole sequences allow: within one sequence of it.
    assert abs(len(held) - round(n * holdout)) <= max(sizes)
    again = split_indices(n, holdout, seed, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip((fit, held), again, strict=True))


def test_string_ids_and_the_same_split_for_the_same_sequences():
    names = np.array(["doc-b", "doc-a", "doc-b", "doc-c", "doc-a", "doc-c", "doc-d"])
    codes = np.array([1, 0, 1, 2, 0, 2, 3])
    by_name = split_indices(7, 0.3, 5, groups=names)
    by_code = split_indices(7, 0.3, 5, groups=codes)
    assert all(np.array_equal(a, b) for a, b in zip(by_name, by_code, strict=True))


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        (np.zeros(5), "integers or all strings"),
        (np.array([1, "a", 2, 3, 4], dtype=object), "integers or all strings"),
        (np.array([True, False, True, False, True]), "integers or all strings"),
        (np.arange(4), r"shape \(5,\)"),
        (np.zeros(5, dtype=int), "both parts need a sequence"),
    ],
)
def test_bad_sequence_ids_are_refused(groups, match):
    with pytest.raises(CalibrationInputError, match=match):
        split_indices(5, 0.4, 0, groups=groups)


def test_the_sequence_summary_against_a_loop():
    rng = np.random.default_rng(2)
    groups = np.repeat(["x", "y", "z", "w"], [1, 5, 9, 3])
    n = len(groups)
    probs = softmax(rng.normal(size=(n, 6)) * 2)
    labels = rng.integers(0, 6, n)
    out = sequence_nll_summary(probs, labels, groups)
    nll = -np.log(probs[np.arange(n), labels])
    per = [nll[groups == g].mean() for g in sorted(set(groups))]
    assert out["sequences"]["count"] == 4 and out["tokens"]["count"] == n
    np.testing.assert_allclose(out["sequences"]["median"], np.median(per), rtol=1e-12)
    np.testing.assert_allclose(out["sequences"]["p95"], np.percentile(per, 95), rtol=1e-12)
    np.testing.assert_allclose(out["sequences"]["mean"], np.mean(per), rtol=1e-12)
    tokens = {k: v for k, v in out["tokens"].items() if k != "count"}
    assert tokens == log_loss_summary(probs, labels)
    # A long sequence weighs as one: the sequences' mean differs from the tokens' here.
    assert abs(out["sequences"]["mean"] - out["tokens"]["mean"]) > 1e-3


def test_reports_add_the_sequence_summary_of_their_rows():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(40, 5)) * 3
    labels = rng.integers(0, 5, 40)
    groups = rng.integers(0, 7, 40).astype(str)
    expected = sequence_nll_summary(softmax(logits), labels, groups)
    by_probs = report(softmax(logits), labels, sequences=groups)["sequences"]
    by_scores = scores_report(logits, labels, "logits", sequences=groups)["sequences"]
    assert by_probs == expected
    for key in ("tokens", "sequences"):
        assert by_scores[key]["count"] == expected[key]["count"]
        for stat in ("mean", "median", "p95"):
            assert by_scores[key][stat] == pytest.approx(expected[key][stat], rel=1e-12)
    assert "sequences" not in report(softmax(logits), labels)
