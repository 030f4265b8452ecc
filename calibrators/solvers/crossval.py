"""Cross-validated walks along a penalty path, strongest penalty first.

The penalty searches of vector, matrix and Dirichlet scaling, SVS, SMS and IOP
walk their candidates from temperature scaling (the strongest end) towards weaker
penalties, fold by fold, warm-starting each fold's fit from its previous solution,
and stop once ``PATIENCE`` candidates were worse than the best by more than
``NOISE`` standard errors of their paired per-row difference.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from calibrators.numerics import n_threads

#: Stop walking the grid after this many candidates worse than the best ...
PATIENCE = 2
#: ... each by more than this many standard errors of its paired per-row difference
#: from the best (:func:`cross_validate_path`'s ``noise``): on a flat stretch of the
#: path the differences are noise, and the walk goes on (issue 21: a rule that stopped
#: at any rise stopped at 1e5 on some splits, where 1e-3 was far better).
NOISE = 1.0

def fold_assignment(n: int, n_folds: int, seed: int) -> np.ndarray:
    """The fold (0 .. n_folds - 1) of each of ``n`` rows: a seeded permutation, dealt
    round-robin (fold sizes differ by at most one)."""
    fold_of = np.empty(n, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(n)
    fold_of[perm] = np.arange(n) % n_folds
    return fold_of


def cross_validate_path(make_problem, feats, y, fold_of, candidates, warm, progress, *,
                        max_iter: int, tol: float, patience: int = PATIENCE,
                        solve_options: dict | None = None, tie: float = 0.0,
                        noise: float | None = None, retarget=None):
    """Mean held-out NLL of penalty candidates along a path, over the folds.

    The candidates are walked in order (strongest penalty first); each
    fold's fit is warm-started from that fold's previous solution (or, when the
    solver's result has a ``restart``, from there: see
    :meth:`calibrators.solvers.penalised.PenalisedSoftmax._solve_block_newton`), and the
    folds of one candidate run on parallel threads (numpy and scipy
    release the GIL in the products). The walk stops early once the CV
    NLL has risen ``patience`` times past the best candidate (a candidate
    within ``tie`` times the best CV NLL of it is not a rise; with ``noise``, one
    within ``noise`` standard errors of it is not either): the weakly penalised
    fits at the end of the path are the slow ones.

    Parameters
    ----------
    make_problem : callable
        ``make_problem(x, y, candidate)`` -> :class:`PenalisedSoftmax` on a
        fold's training rows.
    feats : ndarray of shape (n_samples, n_classes)
    y : ndarray of shape (n_samples,)
    fold_of : ndarray of shape (n_samples,)
        Fold of each row (:func:`fold_assignment`).
    candidates : sequence
        Penalty candidates, passed to ``make_problem``.
    warm : list
        Per fold, a start (parameter vector) or None (the identity).
    progress : callable
        Called with the number of fits done, after each candidate.
    max_iter, tol : int, float
        As :meth:`PenalisedSoftmax.solve`.
    solve_options : dict, optional
        Further keywords of :meth:`PenalisedSoftmax.solve`.
    patience : int, default PATIENCE
    tie : float, default 0.0
        Relative tolerance of a rise (0: any candidate after the best is one).
    noise : float, optional
        A candidate is a rise only when its CV NLL exceeds the best's by more than
        this many standard errors of their paired difference: the mean over the
        rows (each held out once) of the per-row difference of held-out NLLs
        (``problem.row_nll``). Differences the folds' rows cannot tell from zero
        do not stop the walk.
    retarget : callable, optional
        ``retarget(problem, candidate)`` -> the fold's problem at the next
        candidate, on the same rows (no copy): each fold's rows are then copied
        once, not once per candidate, and the problem may carry over what it
        knows (:class:`calibrators.methods._structured._Problem`). Default: a new
        ``make_problem`` per candidate.

    Returns
    -------
    scores : list of float
        CV NLL per candidate tried.
    solutions : list of list of ndarray
        Per candidate tried, the folds' solutions.
    evaluations : int
    """
    n_folds = len(warm)
    splits = [(fold_of != f, fold_of == f) for f in range(n_folds)]
    thetas = list(warm)
    scores, solutions, evaluations, losses = [], [], 0, []

    problems, held = [None] * n_folds, [None] * n_folds

    def fit_fold(args):
        fold, cand = args
        train, test = splits[fold]
        if problems[fold] is None:
            prob = make_problem(feats[train], y[train], cand)
            rows = feats[test], y[test]
        else:
            prob, rows = retarget(problems[fold], cand), held[fold]
        if retarget is not None:
            problems[fold], held[fold] = prob, rows
        start = prob.initial() if thetas[fold] is None else thetas[fold]
        res = prob.solve(start, max_iter=max_iter, tol=tol, **(solve_options or {}))
        restart = getattr(res, "restart", res.x)
        if noise is None:
            return res.x, prob.nll(res.x, *rows), prob.evaluations, None, restart
        per_row = prob.row_nll(res.x, *rows)
        return res.x, float(np.mean(per_row)), prob.evaluations, per_row, restart

    def rises(best: int) -> int:
        later = range(best + 1, len(scores))
        if noise is not None:
            return sum(scores[i] - scores[best] > noise * _paired_error(losses[i], losses[best])
                       for i in later)
        if tie:
            return sum(scores[i] > scores[best] * (1.0 + tie) for i in later)
        return len(later)

    with ThreadPoolExecutor(max_workers=min(n_folds, n_threads())) as pool:
        for cand in candidates:
            results = list(pool.map(fit_fold, [(f, cand) for f in range(n_folds)]))
            # the next candidate starts where each fold's solver last evaluated (its
            # solution, or for an approximate solver the point before its last step)
            thetas = [r[4] for r in results]
            # the mean over the folds (of the folds' means), as without ``noise``
            scores.append(float(np.mean([r[1] for r in results])))
            solutions.append([r[0] for r in results])
            evaluations += sum(r[2] for r in results)
            if noise is not None:
                losses.append([r[3] for r in results])
            progress(n_folds)
            if rises(int(np.argmin(scores))) >= patience:
                break
    return scores, solutions, evaluations


def _paired_error(a: list, b: list) -> float:
    """Standard error of the mean of the per-row differences ``a - b`` (lists of the
    folds' per-row arrays, the same rows in the same order)."""
    d = np.concatenate([x - y for x, y in zip(a, b, strict=True)])
    return float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
