"""Methods that fit the same map are fitted once (``calibrators.fit_groups``) and
reported under every name (``calibrators.as_method``): on probabilities matrix and
Dirichlet scaling, whose features are then both ``log p``."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import softmax

import calibrators
from calibrators import linear

LINEAR = ("vector", "matrix", "dirichlet")


def scaled_classes(n, k, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 2.0
    p = softmax(z * np.linspace(0.3, 2.5, k) + np.linspace(-1.5, 1.5, k), axis=1)
    return z, np.array([rng.choice(k, p=row) for row in p])


def test_matrix_and_dirichlet_are_one_fit_on_probabilities_only():
    groups = calibrators.fit_groups(calibrators.METHODS, "probabilities")
    assert ("matrix", "dirichlet") in groups
    assert sorted(m for g in groups for m in g) == sorted(calibrators.METHODS)
    assert all(len(g) == 1 for g in calibrators.fit_groups(calibrators.METHODS, "logits"))
    # other options: other fits
    assert calibrators.fit_groups(["matrix", "dirichlet"], "probabilities",
                                  {"matrix": {"n_folds": 4}}) == [("matrix",), ("dirichlet",)]


@pytest.mark.parametrize("kind", ["probabilities", "logits"])
def test_every_group_is_one_map(kind):
    """What fit_groups puts together, fitted apart, predicts the same (it is the check
    that a change to a method's features keeps its ``fit_key`` true)."""
    z, y = scaled_classes(n=600, k=4, seed=2)
    x = softmax(z, axis=1) if kind == "probabilities" else z
    for group in calibrators.fit_groups(LINEAR, kind):
        fits = [calibrators.create(m, grid=[10.0, 1.0]).fit(x, y, kind=kind) for m in group]
        first = fits[0].predict_proba(x, kind=kind)
        for m, fit in zip(group[1:], fits[1:], strict=True):
            np.testing.assert_allclose(fit.predict_proba(x, kind=kind), first, atol=1e-6)
            alias = calibrators.as_method(fits[0], m)
            assert alias.method == m and alias.fit_info_["fitted_as"] == group[0]
            np.testing.assert_allclose(alias.predict_proba(x, kind=kind), first, atol=1e-6)


def test_compare_fits_matrix_once_and_reports_it_as_dirichlet_too(monkeypatch):
    from calibrators import offline

    fitted = []
    original = linear._LinearScaler._fit

    def spy(self, *args, **kwargs):
        fitted.append(self.method)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(linear._LinearScaler, "_fit", spy)
    z, y = scaled_classes(n=400, k=3, seed=3)
    out = offline.compare(softmax(z, axis=1), y, kind="probabilities",
                          methods=("matrix", "dirichlet"))
    assert fitted == ["matrix"]
    matrix, dirichlet = out["methods"]["matrix"], out["methods"]["dirichlet"]
    assert dirichlet["same_fit_as"] == "matrix" and "same_fit_as" not in matrix
    assert dirichlet["params"]["method"] == "dirichlet"
    assert dirichlet["report"]["nll"] == pytest.approx(matrix["report"]["nll"], abs=1e-9)
    assert "= matrix" in offline.format_report(out)


def test_the_summary_says_inf_when_a_structured_search_keeps_the_identity():
    """Scores that say nothing about the labels: svs keeps its centre (infinite
    multipliers, stored as None), and the CLI's summary says so rather than failing."""
    from calibrators import offline

    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(300, 4)) * 3.0, rng.integers(0, 4, 300)
    out = offline.compare(z, y, methods=("svs",), holdout=0.25)
    assert set(out["methods"]["svs"]["params"]["fit_info"]["multipliers"].values()) == {None}
    assert "reg_diagonal = inf" in offline.format_report(out)
