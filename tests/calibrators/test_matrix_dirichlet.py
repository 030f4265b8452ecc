"""Matrix and Dirichlet scaling are two maps, on either kind of scores, so ``auto`` and
``--method all`` fit both. (On probabilities they were one fit while matrix scaling
acted on ``log p``; on the centred log-ratio Dirichlet has the row's log-sum-exp as one
more feature.) And the CLI summary of a structured search that keeps the identity."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import softmax

import calibrators


def scaled_classes(n, k, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 2.0
    p = softmax(z * np.linspace(0.3, 2.5, k) + np.linspace(-1.5, 1.5, k), axis=1)
    return z, np.array([rng.choice(k, p=row) for row in p])


@pytest.mark.parametrize("kind", ["probabilities", "logits"])
def test_matrix_and_dirichlet_are_two_maps_on_either_kind(kind):
    """On the centred log-ratio matrix scaling is not Dirichlet scaling, even on
    probabilities (where both once saw log p): fitting both is not redundant."""
    z, y = scaled_classes(n=600, k=4, seed=2)
    x = softmax(z, axis=1) if kind == "probabilities" else z
    a, b = (calibrators.create(m, grid=[10.0, 1.0]).fit(x, y, kind=kind).predict_proba(
        x, kind=kind) for m in ("matrix", "dirichlet"))
    assert np.max(np.abs(a - b)) > 1e-3


def test_the_summary_says_inf_when_a_structured_search_keeps_the_identity():
    """Scores that say nothing about the labels: svs keeps its centre (infinite
    multipliers, stored as None), and the CLI's summary says so rather than failing."""
    from service import offline

    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(300, 4)) * 3.0, rng.integers(0, 4, 300)
    out = offline.compare(z, y, methods=("svs",), holdout=0.25)
    assert set(out["methods"]["svs"]["params"]["fit_info"]["multipliers"].values()) == {None}
    assert "reg_diagonal = inf" in offline.format_report(out)
