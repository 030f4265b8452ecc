"""Methods that fit the same map are fitted once (``calibrators.fit_groups``) and
reported under every name (``calibrators.as_method``). No two current methods do
(matrix and Dirichlet scaling did on probabilities before matrix scaling moved to the
centred log-ratio); a registered alias of matrix scaling stands in for a group."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import softmax

import calibrators
from calibrators import linear


def scaled_classes(n, k, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 2.0
    p = softmax(z * np.linspace(0.3, 2.5, k) + np.linspace(-1.5, 1.5, k), axis=1)
    return z, np.array([rng.choice(k, p=row) for row in p])


@pytest.fixture
def alias(monkeypatch):
    """``matrix2``: matrix scaling under another name, in the registry (the same
    fit_key, so one group with ``matrix``)."""
    cls = type("Matrix2", (linear.MatrixScaler,), {"method": "matrix2"})
    monkeypatch.setitem(calibrators.CALIBRATORS, "matrix2", cls)
    return "matrix2"


def test_no_two_methods_share_a_fit_and_equal_keys_do(alias):
    for kind in ("probabilities", "logits"):
        groups = calibrators.fit_groups(calibrators.METHODS, kind)
        assert groups == [(m,) for m in calibrators.METHODS]
    assert calibrators.fit_groups(["matrix", "dirichlet", alias], "probabilities") == [
        ("matrix", alias), ("dirichlet",)]
    # other options: other fits
    assert calibrators.fit_groups(["matrix", alias], "logits", {"matrix": {"n_folds": 4}}) == [
        ("matrix",), (alias,)]


@pytest.mark.parametrize("kind", ["probabilities", "logits"])
def test_matrix_and_dirichlet_are_two_maps_on_either_kind(kind):
    """Why they are not one group: on the centred log-ratio matrix scaling is not
    Dirichlet scaling, even on probabilities (where both once saw log p)."""
    z, y = scaled_classes(n=600, k=4, seed=2)
    x = softmax(z, axis=1) if kind == "probabilities" else z
    a, b = (calibrators.create(m, grid=[10.0, 1.0]).fit(x, y, kind=kind).predict_proba(
        x, kind=kind) for m in ("matrix", "dirichlet"))
    assert np.max(np.abs(a - b)) > 1e-3


def test_as_method_predicts_what_a_fit_of_the_other_name_does(alias):
    z, y = scaled_classes(n=600, k=4, seed=2)
    fitted = calibrators.create("matrix", grid=[10.0, 1.0]).fit(z, y)
    apart = calibrators.create(alias, grid=[10.0, 1.0]).fit(z, y)
    named = calibrators.as_method(fitted, alias)
    assert named.method == alias and named.fit_info_["fitted_as"] == "matrix"
    np.testing.assert_allclose(named.predict_proba(z), apart.predict_proba(z), atol=1e-9)


def test_compare_fits_a_group_once_and_reports_it_under_each_name(alias, monkeypatch):
    from calibrators import offline

    fitted = []
    original = linear._LinearScaler._fit

    def spy(self, *args, **kwargs):
        fitted.append(self.method)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(linear._LinearScaler, "_fit", spy)
    z, y = scaled_classes(n=400, k=3, seed=3)
    out = offline.compare(z, y, methods=("matrix", alias))
    assert fitted == ["matrix"]
    first, second = out["methods"]["matrix"], out["methods"][alias]
    assert second["same_fit_as"] == "matrix" and "same_fit_as" not in first
    assert second["params"]["method"] == alias
    assert second["report"]["nll"] == first["report"]["nll"]
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
