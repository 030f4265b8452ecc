"""How ``auto`` chooses: the race over folds (service/jobs/selection.py) and its use in
the fit job (service/jobs/fitting.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import calibrators
from calibrators.evaluation.holdout import fold_indices
from service.jobs import selection
from service.jobs.fitting import fit_job, resolve_refit
from tests.service.helpers import create_model, fit, logits_data, upload

ROWS = 1000


def hard_rows(seed: int = 0) -> np.ndarray:
    """Per-row NLLs shared by every candidate: how hard each row is."""
    return np.random.default_rng(seed).exponential(size=ROWS)


def test_a_candidate_clearly_worse_on_the_first_fold_costs_no_more_fits():
    rng = np.random.default_rng(1)
    base = hard_rows()
    first = {"worse": base + 0.2, "good": base + rng.normal(0, 0.01, ROWS)}
    calls = []
    chosen, info = selection.race(first, lambda m, f: calls.append((m, f)), 5)
    assert chosen == "good" and calls == []
    assert info["worse"]["dropped"] and info["worse"]["folds"] == 1
    assert info["worse"]["difference"] > 2 * info["worse"]["standard_error"] > 0
    assert info["good"] == {"folds": 1, "nll": pytest.approx(first["good"].mean()),
                            "difference": 0.0, "standard_error": 0.0, "dropped": False}


def test_close_candidates_go_on_to_the_next_folds_and_the_better_one_wins():
    """On the first fold "b" leads by noise; over five folds "a" is better (its rows'
    mean is lower by 0.01 per row in the folds after), and a one-fold choice is wrong."""
    rng = np.random.default_rng(2)
    base = hard_rows()
    first = {"a": base + 0.004 + rng.normal(0, 0.05, ROWS), "b": base}
    assert first["a"].mean() > first["b"].mean()

    def score(m: str, fold: int) -> np.ndarray:
        other = hard_rows(fold)
        return other + (0.0 if m == "a" else 0.01) + rng.normal(0, 0.05, ROWS)

    chosen, info = selection.race(first, score, 5)
    assert chosen == "a"
    assert info["b"]["folds"] >= 2 and info["a"]["difference"] == 0.0


def test_the_first_of_equals_and_the_folds_running_out():
    base = hard_rows()
    scored = []

    def score(m, fold):
        scored.append(fold)
        return hard_rows(fold)

    chosen, info = selection.race({"x": base, "y": base.copy()}, score, 3)
    assert chosen == "x"
    assert sorted(set(scored)) == [1, 2] and info["y"]["folds"] == 3
    assert not info["y"]["dropped"]


def test_paired_difference():
    d, se = selection.paired_difference(np.array([1.0, 2.0, 4.0]), np.array([1.0, 1.0, 1.0]))
    assert d == pytest.approx(4 / 3)
    assert se == pytest.approx(np.std([0, 1, 3], ddof=1) / np.sqrt(3))
    assert selection.paired_difference(np.array([2.0]), np.array([1.0])) == (1.0, 0.0)


def test_refit_by_default_for_auto_only():
    assert resolve_refit("auto", None) is True
    assert resolve_refit("vector", None) is False
    assert resolve_refit("auto", False) is False
    assert resolve_refit("vector", True) is True


def test_the_fit_job_races_the_allowed_candidates_and_reports_it():
    logits, labels = logits_data(n=600, k=4, seed=7)
    job = fit_job(logits, labels, kind="logits", method="auto", holdout=0.2, seed=1,
                  options={}, argmax_policy="off", refit=False)
    raced = {m: c["selection"] for m, c in job["candidates"].items() if "selection" in c}
    assert set(raced) == {m for m, c in job["candidates"].items() if c["allowed"]}
    assert len(raced) > 1
    chosen = job["chosen_method"]
    assert raced[chosen]["difference"] == 0.0 and not raced[chosen]["dropped"]
    folds = len(fold_indices(600, 0.2, 1))
    assert max(r["folds"] for r in raced.values()) <= folds
    # After one fold, a candidate's figure is its hold-out NLL (the version's metrics).
    for m, r in raced.items():
        if r["folds"] == 1:
            assert r["nll"] == pytest.approx(job["candidates"][m]["metrics"]["nll"])
    # The race's leader has the lowest NLL of those that ran to its last fold.
    last = max(r["folds"] for r in raced.values())
    finalists = {m: r["nll"] for m, r in raced.items() if r["folds"] == last}
    assert chosen == min(finalists, key=finalists.get)


def test_auto_serves_its_choice_fitted_on_every_row_by_default(client):
    create_model(client, k=4, argmax_policy="off")
    logits, labels = logits_data(n=300, k=4, seed=5)
    dataset = upload(client, "m", logits, labels)["id"]
    auto = fit(client, "m", dataset, "auto")
    named = fit(client, "m", dataset, "vector")
    assert (auto["refit"], named["refit"]) == (True, False)
    assert auto["status"] == "succeeded"
    want = calibrators.create(auto["chosen_method"]).fit(logits, labels).to_params()
    for name in calibrators.CALIBRATORS[want["method"]].fitted_arrays:
        if want.get(name) is not None:
            np.testing.assert_array_equal(np.asarray(auto["params"][name]),
                                          np.asarray(want[name]))
    assert "selection" in auto["candidates"][auto["chosen_method"]]


def test_with_sequences_the_race_folds_are_whole_sequences(monkeypatch):
    from service.jobs import fitting

    logits, labels = logits_data(n=600, k=4, seed=8)
    sequences = np.repeat(np.arange(60), 10)
    seen = []

    def recording(*args, **kwargs):
        parts = fold_indices(*args, **kwargs)
        seen.append(parts)
        return parts

    monkeypatch.setattr(fitting, "fold_indices", recording)
    job = fit_job(logits, labels, kind="logits", method="auto", holdout=0.2, seed=1,
                  options={}, argmax_policy="off", sequences=sequences)
    assert job["status"] == "succeeded" and len(seen) == 1
    assert len(seen[0]) > 1
    for part in seen[0]:  # every row of each of its sequences, and no other row
        rows = np.flatnonzero(np.isin(sequences, sequences[part]))
        assert np.array_equal(np.sort(part), rows)


def test_progress_never_goes_back_and_ends_at_one():
    logits, labels = logits_data(n=600, k=4, seed=7)
    seen = []
    job = fit_job(logits, labels, kind="logits", method="auto", holdout=0.2, seed=1,
                  options={}, argmax_policy="off", progress=seen.append)
    assert any(c["selection"]["folds"] > 1 for c in job["candidates"].values()
               if "selection" in c)  # the race ran further folds, and the refit followed
    assert seen and seen[-1] == 1.0 and 0.0 <= min(seen)
    assert all(b >= a for a, b in itertools.pairwise(seen))
