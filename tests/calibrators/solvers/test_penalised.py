"""The ODIR objective and its solvers (calibrators/solvers/, calibrators/methods/_linear.py).

The objective's gradient against finite differences, the canonical projection
against its definition (NLL unchanged, penalty not increased, a projection,
its transpose), the curvature blocks against the exact per-class Hessian, and
both solvers against a plain L-BFGS on the untransformed objective.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax

from calibrators.methods import _linear
from calibrators.methods.matrix import MatrixScaler
from calibrators.solvers import crossval, penalised


def problem(structure: str, feature: str, lam: float, mu: float, n=400, k=5, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    z = rng.normal(size=(n, k)) * 3.0
    z[np.arange(n), y] += 2.5
    x = log_softmax(z, axis=1) if feature == "log_softmax" else z
    return _linear._Problem(x, y, structure, lam, mu)


def random_theta(prob, seed=1):
    rng = np.random.default_rng(seed)
    return prob.initial() + 0.3 * rng.normal(size=prob.initial().size)


def data_nll(prob, theta):
    return prob.nll(theta, prob.x, prob.y)


@pytest.mark.parametrize("structure", ["full", "diagonal"])
@pytest.mark.parametrize("feature", ["logits", "log_softmax"])
def test_gradient_matches_central_differences(structure, feature):
    prob = problem(structure, feature, lam=3.0, mu=2.0)
    theta = random_theta(prob)
    _, grad = prob(theta)
    eps = 1e-6
    numeric = np.array(
        [
            (prob(theta + eps * e)[0] - prob(theta - eps * e)[0]) / (2 * eps)
            for e in np.eye(theta.size)
        ]
    )
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_canonical_keeps_the_nll_lowers_the_penalty_and_is_a_projection():
    prob = problem("full", "log_softmax", lam=50.0, mu=7.0)
    rng = np.random.default_rng(2)
    for _ in range(5):
        theta = random_theta(prob, int(rng.integers(1 << 30)))
        canon = prob.canonical(theta)
        assert data_nll(prob, canon) == pytest.approx(data_nll(prob, theta), rel=1e-12)
        penalty = prob(theta)[0] - data_nll(prob, theta)
        canon_penalty = prob(canon)[0] - data_nll(prob, canon)
        assert canon_penalty <= penalty + 1e-12
        np.testing.assert_allclose(prob.canonical(canon), canon, atol=1e-12)
        # The canonical point is where the penalty is least along the invisible
        # directions: its gradient there has no component along them.
        k = prob.k
        gw, gb = prob(canon)[1][: k * k].reshape(k, k), prob(canon)[1][k * k :]
        np.testing.assert_allclose(gw.sum(axis=0), 0.0, atol=1e-12)
        assert abs(gb.sum()) < 1e-12
        # canonical_gradient is the transpose of the (linear) projection.
        g, d = rng.normal(size=theta.size), rng.normal(size=theta.size)
        zero = np.zeros(theta.size)
        projected = prob.canonical(d) - prob.canonical(zero)
        assert g @ projected == pytest.approx(prob.canonical_gradient(g) @ d, rel=1e-12)


@pytest.mark.parametrize("feature", ["logits", "log_softmax"])
def test_curvature_blocks_are_the_exact_per_class_hessian(feature, monkeypatch):
    """With no damping and every row used, block i is the Hessian of the loss in
    (W[i], b[i]) with the other classes held fixed (finite differences of the
    analytic gradient)."""
    monkeypatch.setattr(penalised, "DAMPING", 0.0)
    prob = problem("full", feature, lam=20.0, mu=4.0, n=300, k=4)
    theta = random_theta(prob)
    blocks = prob.curvature_blocks(theta)
    k, eps = prob.k, 1e-5
    for i in range(k):
        index = [i * k + j for j in range(k)] + [k * k + i]
        exact = np.empty((k + 1, k + 1))
        for col, t in enumerate(index):
            e = np.zeros(theta.size)
            e[t] = eps
            diff = (prob(theta + e)[1] - prob(theta - e)[1]) / (2 * eps)
            exact[:, col] = diff[index]
        np.testing.assert_allclose(blocks[i], exact, rtol=1e-5, atol=1e-7)


def reference_minimum(prob):
    """Plain L-BFGS on the untransformed objective, run to the end."""
    res = minimize(
        prob,
        prob.initial(),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-11, "maxcor": 30},
    )
    return res.x, res.fun


@pytest.mark.parametrize("feature", ["logits", "log_softmax"])
@pytest.mark.parametrize(("lam", "mu"), [(1e4, 1e4), (30.0, 5.0), (0.05, 0.05)])
def test_block_and_scaled_solvers_reach_the_plain_optimum(feature, lam, mu):
    prob = problem("full", feature, lam, mu)
    theta_ref, loss_ref = reference_minimum(prob)
    for solve in (prob._solve_blocks, prob._solve_rank_one, prob._solve_scaled):
        res = solve(prob.initial(), max_iter=5000, tol=1e-13)
        loss = prob(res.x)[0]
        assert loss <= loss_ref + 1e-11 * max(1.0, abs(loss_ref)), solve.__name__
        assert abs(loss - loss_ref) < 1e-9, solve.__name__
        np.testing.assert_allclose(res.x, theta_ref, atol=2e-4, err_msg=solve.__name__)
        # The reported gradient is the objective's, in the original parameters.
        assert np.max(np.abs(res.jac)) < 1e-4


@pytest.mark.parametrize("feature", ["logits", "log_softmax"])
@pytest.mark.parametrize(("lam", "mu"), [(30.0, 5.0), (0.05, 0.05)])
def test_block_newton_steps_converge_to_the_plain_optimum(feature, lam, mu):
    """Many steps of the search's approximate solver reach the optimum's loss and
    predictions (so its steps descend the objective to its minimum), and every
    evaluated step lowers the loss. (Along the one direction softmax cannot see, the
    same shift of every bias, only the weak bias penalty pulls, and the blocks, each
    class on its own, converge there slowly: the parameters at the weak penalty are
    compared without that shift.)"""
    prob = problem("diagonal", feature, lam, mu)
    theta_ref, loss_ref = reference_minimum(prob)
    res = prob.solve(prob.initial(), max_iter=1000, tol=1e-9, newton_steps=200)  # (until
    # no step lowers the loss in float64)
    assert prob(res.restart)[0] == pytest.approx(loss_ref, abs=1e-11)
    k = prob.k
    w, b = res.x[:k], res.x[k:]
    np.testing.assert_allclose(w, theta_ref[:k], atol=1e-6)
    np.testing.assert_allclose(b - b.mean(), theta_ref[k:] - theta_ref[k:].mean(), atol=1e-6)
    losses = [prob(prob.initial())[0]] + [
        prob.solve(prob.initial(), max_iter=1000, tol=1e-9, newton_steps=s).fun
        for s in range(2, 6)]
    assert all(b < a for a, b in pairwise(losses)), losses


def test_block_newton_evaluates_all_but_its_last_step():
    """``restart`` is the last point evaluated (``fun`` and ``jac`` are there), ``x`` one
    more step from it: two steps cost the start's evaluation and one more."""
    prob = problem("diagonal", "log_softmax", 3.0, 2.0)
    start = random_theta(prob)
    before = prob.evaluations
    res = prob.solve(start, max_iter=1000, tol=1e-9, newton_steps=2)
    assert prob.evaluations - before == 2
    loss, grad = prob(res.restart)
    assert (res.fun, res.jac.tolist()) == (loss, grad.tolist())
    k = prob.k
    blocks = prob.diagonal_blocks(res.restart)
    step = np.linalg.solve(blocks, -np.stack([grad[:k], grad[k:]], axis=1)[..., None])[..., 0]
    np.testing.assert_allclose(res.x - res.restart, np.concatenate([step[:, 0], step[:, 1]]),
                               rtol=1e-10, atol=1e-14)
    assert prob(res.x)[0] < loss  # the unevaluated last step goes down too


def test_solve_uses_the_blocks_up_to_max_block_classes(monkeypatch):
    prob = problem("full", "log_softmax", 10.0, 10.0, k=5)
    vector = problem("diagonal", "logits", 10.0, 10.0, k=5)
    calls = []
    for p in (prob, vector):
        for name in ("_solve_blocks", "_solve_rank_one", "_solve_scaled"):
            monkeypatch.setattr(p, name, lambda *a, name=name, **kw: calls.append(name))
    prob.solve(prob.initial(), max_iter=10, tol=1e-6)
    vector.solve(vector.initial(), max_iter=10, tol=1e-6)
    monkeypatch.setattr(penalised, "MAX_BLOCK_CLASSES", 4)
    prob.solve(prob.initial(), max_iter=10, tol=1e-6)
    assert calls == ["_solve_blocks", "_solve_scaled", "_solve_rank_one"]


def test_whitening_factors_are_consistent_and_whiten():
    """A (apply), A^T (transpose), A^-1 (inverse) and A^-T (inverse_transpose) agree
    with the explicit matrices; the rank-1 whitening maps D + s s^T / w to I, the
    block whitening maps the block to I."""
    rng = np.random.default_rng(3)
    k = 6
    diag = rng.uniform(0.1, 5.0, (k, k + 1))
    mean = rng.normal(size=(k, k + 1)) * 3.0
    weight = rng.uniform(0.05, 0.3, k)
    blocks = np.stack([np.diag(diag[i]) + np.outer(mean[i], mean[i]) / weight[i] for i in range(k)])
    v = rng.normal(size=(k, k + 1))
    for a in (penalised._RankOne(diag, mean, weight), penalised._Blocks(blocks)):
        for i in range(k):
            A = np.stack([a.apply(np.eye(k + 1)[None, j].repeat(k, 0))[i] for j in range(k + 1)], 1)
            np.testing.assert_allclose(A.T @ blocks[i] @ A, np.eye(k + 1), atol=1e-9)
            np.testing.assert_allclose(a.transpose(v)[i], A.T @ v[i], atol=1e-12)
            np.testing.assert_allclose(a.inverse(a.apply(v)), v, atol=1e-9)
            np.testing.assert_allclose(a.inverse_transpose(a.transpose(v)), v, atol=1e-9)


class _Scripted:
    """A stand-in problem whose held-out NLL is its candidate's scripted score."""

    def __init__(self, score: float):
        self.score, self.evaluations = score, 1

    def initial(self):
        return np.zeros(1)

    def solve(self, start, **_):
        return type("Result", (), {"x": start})()

    def nll(self, theta, x, y):
        return self.score


@pytest.mark.parametrize(("tie", "tried"), [(0.0, 4), (1e-6, 6)])
def test_the_walk_goes_on_across_ties_and_stops_after_real_rises(tie, tried):
    """With ``tie``, candidates within that fraction of the best CV NLL are not rises:
    a flat stretch (the solver's noise) does not end the walk; real rises do."""
    scores = [1.3, 1.2, 1.2 + 1e-8, 1.2 + 5e-8, 1.25, 1.26, 1.27]
    got, _, _ = crossval.cross_validate_path(
        lambda x, y, cand: _Scripted(scores[cand]), np.zeros((6, 2)), np.zeros(6, dtype=int),
        crossval.fold_assignment(6, 3, 0), range(len(scores)), [None] * 3, lambda _: None,
        max_iter=1, tol=1e-6, patience=2, tie=tie,
    )
    assert got == scores[:tried]


class _ScriptedRows(_Scripted):
    """A stand-in whose held-out rows each score ``score + noise_n``: the same
    ``noise`` for every candidate, or its own (``spread``), so that the paired
    differences between candidates are exact or noisy."""

    def __init__(self, score: float, spread: float, seed: int):
        super().__init__(score)
        self.spread, self.seed = spread, seed

    def row_nll(self, theta, x, y):
        rng = np.random.default_rng(self.seed)
        return self.score + self.spread * rng.normal(size=len(y))


@pytest.mark.parametrize(("spread", "tried"), [(0.0, 4), (0.5, 7)])
def test_the_walk_goes_on_across_rises_the_rows_cannot_tell_from_noise(spread, tried):
    """With ``noise``, a rise counts only beyond that many standard errors of the paired
    per-row difference: exact rises of 0.01 end the walk after two; the same rises
    among per-row differences of spread 0.5 on 60 rows (SE about 0.09) do not, and
    the walk reaches the weakest candidate, here the best."""
    scores = [1.30, 1.20, 1.21, 1.22, 1.21, 1.20, 1.10]
    got, _, _ = crossval.cross_validate_path(
        lambda x, y, cand: _ScriptedRows(scores[cand], spread, cand),
        np.zeros((60, 2)), np.zeros(60, dtype=int), crossval.fold_assignment(60, 3, 0),
        range(len(scores)), [None] * 3, lambda _: None, max_iter=1, tol=1e-6,
        patience=2, noise=1.0,
    )
    assert len(got) == tried
    assert np.allclose(got, scores[:tried], atol=0.5)


def test_odir_searches_with_the_noise_rule(monkeypatch):
    seen = []
    original = crossval.cross_validate_path

    def spy(*args, **kwargs):
        seen.append(kwargs.get("noise"))
        return original(*args, **kwargs)

    monkeypatch.setattr(_linear, "cross_validate_path", spy)
    prob = problem("full", "identity", 1.0, 1.0, n=120, k=3)
    MatrixScaler(grid=[10.0, 1.0]).fit(prob.x, prob.y)
    assert seen and set(seen) == {crossval.NOISE}
