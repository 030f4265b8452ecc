"""Vector, matrix and Dirichlet scaling, penalised towards temperature scaling.

All three fit ``u = W phi(z) + b`` by minimising the mean NLL plus a ridge
penalty centred on temperature scaling, ``W = beta I, b = 0`` (``beta`` the
temperature-scaling optimum on the same features, fitted first)::

    loss(W, b) = mean_n [logsumexp(u_n) - u_n,y_n]
                 + lam / (K (K - 1)) * sum_{i != j} W_ij**2
                 + lam / K * sum_i (W_ii - beta)**2
                 + mu / K * sum_j b_j**2

The off-diagonal and bias terms are ODIR's (Kull et al., 2019); ODIR leaves the
diagonal free, here ``lam`` pulls it to ``beta`` too (vector scaling has only
this diagonal part). With ``lam = mu = inf`` the model is temperature scaling
itself, so the penalty path runs from temperature scaling (strongest) to the
unpenalised model (weakest), and the search can choose either end. The
gradient is analytic, ``dloss/dW = (P - Y)^T phi(z) / N + penalty'``, and the
problem is solved by scipy's L-BFGS-B from temperature scaling, in variables
whitened per class by the curvature of the loss (``PenalisedSoftmax.solve``):
the log-probability features of Dirichlet scaling make the plain problem badly
conditioned.

When ``reg_lambda`` / ``reg_mu`` are not given they are chosen by k-fold
cross-validation: stage 1 walks ``lam`` with ``mu`` tied to it, starting at
temperature scaling (both infinite; not solved, scored as it is) and then down
the grid, strongest first; stage 2 walks ``mu`` at the chosen ``lam``. Within
each fold each fit is warm-started from its neighbour's solution (so it starts
near its own optimum; ``bench/odir.py`` measures what that saves). A walk stops
after ``PATIENCE`` candidates worse than the best by more than ``NOISE``
standard errors of their paired per-row difference (differences the rows cannot
tell from zero do not stop it); while the weakest candidate is the best it goes
on past the grid, ``EXTEND_FACTOR`` weaker at a time, up to ``EXTEND_STEPS``
times. After each stage a finer second pass tries the chosen penalty times and
divided by ``REFINE_FACTOR`` (``sqrt(10)``, half a step of the grid): the CV NLL
along the grid is not always unimodal. The candidate with the lowest CV NLL of
both stages wins (temperature scaling included: ``fit_info_["temperature_scaling"]``),
and the final model is refitted on all rows at its penalties. The folds share
``beta``, fitted on all rows: temperature scaling has seen every held-out fold, a
small bias towards keeping it. Everything is deterministic for a given ``seed``.
``bench/search_splits.py`` measures every method against temperature scaling on
the 5-split protocol.

References
----------
Kull, Perello-Nieto, Kängsepp, Silva Filho, Song, Flach. "Beyond temperature
scaling: Obtaining well-calibrated multiclass probabilities with Dirichlet
calibration", NeurIPS 2019.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np
from scipy.optimize import OptimizeResult, minimize

from calibrators.base import Integer, Positive, Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes, lbfgs_bytes
from calibrators.linear_softmax import LinearSoftmax
from calibrators.numerics import (
    log_softmax,
    map_rows,
    n_threads,
    single_threaded_blas,
    softmax_terms,
)
from calibrators.temperature import TemperatureScaler
from calibrators.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_FOLDS,
    MAX_ITERATIONS,
    CalibrationInputError,
    check_positive,
    logits64,
)

#: Default penalty grid (both lam and mu), strongest first. The penalties are
#: normalised by the number of entries, so useful values are large.
DEFAULT_GRID = (1e5, 1e4, 1e3, 1e2, 10.0, 1.0)
#: L-BFGS tolerance inside the search (only the ranking of candidates matters).
CV_TOL = 1e-6
#: Stop walking the grid after this many candidates worse than the best ...
PATIENCE = 2
#: ... each by more than this many standard errors of its paired per-row difference
#: from the best (:func:`cross_validate_path`'s ``noise``): on a flat stretch of the
#: path the differences are noise, and the walk goes on (issue 21: a rule that stopped
#: at any rise stopped at 1e5 on some splits, where 1e-3 was far better).
NOISE = 1.0
#: While the weakest candidate tried is the best, the walk goes on past the grid's
#: weakest value, each step this factor weaker, at most EXTEND_STEPS steps.
EXTEND_FACTOR = 10.0
EXTEND_STEPS = 4
#: After each stage of the search, the chosen penalty times and divided by this
#: factor are tried too (None: no second pass; ``bench/odir.py --refine``).
REFINE_FACTOR = math.sqrt(10)
#: Full W (matrix, Dirichlet) up to this many classes is solved with per-class
#: curvature blocks (see ``_Problem.solve``): 2 arrays of K (K+1)**2 float64, 34 MB
#: at K = 128; above it, with their diagonal + rank-1 approximation.
MAX_BLOCK_CLASSES = 128
#: L-BFGS iterations before the curvature blocks are first recomputed (doubled each time).
REFRESH_ITERATIONS = 10
#: Damping of each block: this fraction of the mean curvature weight p(1-p) times the
#: unweighted second moment of the features, so that directions the current
#: probabilities ignore still have bounded steps.
DAMPING = 1e-2
#: The blocks are estimated on at most this many rows (evenly spaced).
BLOCK_ROWS = 8192


class _Blocks:
    """Whitening by per-class Cholesky factors: ``H_i = L_i L_i^T``, ``A_i = L_i^-T``.

    Rows of the (K, K+1) arrays below are the classes' ``(W[i], b[i])``.
    """

    def __init__(self, blocks: np.ndarray):
        self.chol = np.linalg.cholesky(blocks)
        self.inv = np.linalg.inv(self.chol)

    def apply(self, v):  # A v
        return np.einsum("iba,ib->ia", self.inv, v)

    def transpose(self, g):  # A^T g
        return np.einsum("iab,ib->ia", self.inv, g)

    def inverse(self, w):  # A^-1 w
        return np.einsum("iba,ib->ia", self.chol, w)

    def inverse_transpose(self, g):  # A^-T g
        return np.einsum("iab,ib->ia", self.chol, g)


class _RankOne:
    """Whitening by ``H_i ~ D_i + s_i s_i^T / w_i``, for any K.

    ``H_i = D^1/2 (I + rho u u^T) D^1/2`` with ``u`` the unit vector along
    ``D^-1/2 s_i`` and ``rho = |D^-1/2 s_i|^2 / w_i``; ``A_i = D^-1/2 (I - beta u
    u^T)`` with ``(1 - beta)^2 (1 + rho) = 1`` makes ``A_i^T H_i A_i = I``.
    Every product is ``O(K)`` per class.
    """

    def __init__(self, diag: np.ndarray, mean: np.ndarray, weight: np.ndarray):
        self.root = np.sqrt(diag)  # D^1/2
        r = mean / self.root
        norm = np.linalg.norm(r, axis=1)
        self.u = r / np.maximum(norm, 1e-300)[:, None]
        rho = norm**2 / weight
        self.beta = 1.0 - 1.0 / np.sqrt(1.0 + rho)
        self.gamma = self.beta / (1.0 - self.beta)  # (I - beta uu^T)^-1 = I + gamma uu^T

    def _along_u(self, v, c):  # (I + c u u^T) v, per class
        return v + c[:, None] * self.u * np.einsum("ia,ia->i", self.u, v)[:, None]

    def apply(self, v):
        return self._along_u(v, -self.beta) / self.root

    def transpose(self, g):
        return self._along_u(g / self.root, -self.beta)

    def inverse(self, w):
        return self._along_u(w * self.root, self.gamma)

    def inverse_transpose(self, g):
        return self._along_u(g, self.gamma) * self.root


class PenalisedSoftmax:
    """The mean NLL of ``softmax(W x + b)`` plus ridge penalties, its gradient and solvers.

    ::

        loss(W, b) = mean_n [logsumexp(u_n) - u_n,y_n]          (u = W x + b)
                     + off * sum_{i != j} W_ij**2 + diag * sum_i (W_ii - t)**2
                     + bias * sum_j b_j**2

    (``t``: ``target``, 1 unless given). A full ``W`` (``structure="full"``:
    parameters ``W.ravel()`` then ``b``) or a diagonal one (``"diagonal"``: the K
    diagonal entries, then ``b``; ``off`` is unused). The linear scalers'
    problem (:class:`_Problem`) centres the diagonal on temperature scaling's
    ``beta`` and ties ``diag`` to ``bias``; structured matrix and vector scaling
    (:mod:`calibrators.structured`) centre it on 1 and weigh the three parts
    apart. :meth:`solve` is exact for any of them.

    Parameters
    ----------
    x : ndarray of shape (n_samples, n_classes), float64
        The features ``phi(z)``.
    y : ndarray of shape (n_samples,), int
    structure : {"diagonal", "full"}
    off, diag, bias : float, default 0.0
        Penalty coefficients (>= 0) per squared entry.
    target : float, default 1.0
        The value the diagonal penalty pulls each ``W_ii`` to; ``W = target I, b =
        0`` is also the solvers' default start (:meth:`initial`).
    block_rows : int, default BLOCK_ROWS
        The whitening's curvature is estimated on at most this many (evenly
        spaced) rows.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, *, off: float = 0.0,
                 diag: float = 0.0, bias: float = 0.0, target: float = 1.0,
                 block_rows: int = BLOCK_ROWS):
        self.x, self.y, self.structure = x, y, structure
        self.target = target
        self.block_rows = block_rows
        self.n, self.k = x.shape
        self.c_off, self.c_diag, self.c_bias = off, diag, bias
        self.offdiag = ~np.eye(self.k, dtype=bool) if structure == "full" else None
        self.evaluations = 0

    def unpack(self, theta: np.ndarray):
        k = self.k
        if self.structure == "full":
            return theta[: k * k].reshape(k, k), theta[k * k :]
        return theta[:k], theta[k:]

    def initial(self) -> np.ndarray:
        k = self.k
        w = np.eye(k).ravel() if self.structure == "full" else np.ones(k)
        return np.concatenate([self.target * w, np.zeros(k)])

    def logits(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
        w, b = self.unpack(theta)
        if x.dtype != w.dtype:  # float32 features: float32 products (half the work)
            w, b = w.astype(x.dtype), b.astype(x.dtype)
        u = x @ w.T if self.structure == "full" else x * w
        u += b  # in place: a second (N, K) temporary costs more than the product
        return u

    def __call__(self, theta: np.ndarray):
        """Loss and gradient at ``theta``."""
        self.evaluations += 1
        return self.penalised(theta, *self.data_term(theta))

    def data_term(self, theta: np.ndarray):
        """The mean NLL at ``theta`` and its gradient in ``W`` and ``b``, without the
        penalty: ``(loss, gw, gb)``, ``gw`` of ``W``'s shape (full) or (K,)."""
        x, y, n = self.x, self.y, self.n
        u = self.logits(theta, x)
        uy = u[np.arange(n), y]
        u, row_max, log_total = softmax_terms(u, overwrite=True)  # now u = p
        loss = float(np.mean(log_total - (uy - row_max)))
        u[np.arange(n), y] -= 1.0  # p - onehot(y)
        u /= n
        gb = u.sum(axis=0)
        gw = u.T @ x if self.structure == "full" else np.einsum("nk,nk->k", u, x)
        return loss, gw, gb

    def penalised(self, theta: np.ndarray, loss: float, gw: np.ndarray, gb: np.ndarray):
        """``(loss, gradient)`` of the whole objective from :meth:`data_term`'s parts
        (``gw`` and ``gb`` are updated in place)."""
        w, b = self.unpack(theta)
        k = self.k
        if self.structure == "full":
            off = w * self.offdiag
            loss += self.c_off * float(np.sum(off * off))
            gw += 2.0 * self.c_off * off
            if self.c_diag:
                d = np.diag(w) - self.target
                loss += self.c_diag * float(d @ d)
                gw[np.arange(k), np.arange(k)] += 2.0 * self.c_diag * d
            gw = gw.ravel()
        elif self.c_diag:
            d = w - self.target
            loss += self.c_diag * float(d @ d)
            gw += 2.0 * self.c_diag * d
        loss += self.c_bias * float(b @ b)
        gb += 2.0 * self.c_bias * b
        return loss, np.concatenate([gw, gb])

    def canonical(self, theta: np.ndarray) -> np.ndarray:
        """``theta`` moved along the directions the NLL cannot see, to the least penalty.

        softmax is unchanged when the same number is added to every class's logit,
        so the NLL is unchanged by ``W -> W + 1 v^T`` (any ``v``: column j of W
        shifted by ``v_j``) and ``b -> b + c 1``; only the penalty sees these
        K + 1 directions. Its minimum along them is in closed form: the bias
        centred on 0, and each column shifted by ``v_j = -(off * s_j + diag *
        (W_jj - t)) / (off (K - 1) + diag)``, ``s_j`` the sum of its off-diagonal
        entries (without a diagonal penalty: its off-diagonal entries centred on
        0). This map is an affine projection, and minimising
        ``loss(canonical(theta))`` instead of ``loss(theta)`` has the same
        minimum without the K + 1 directions of penalty-only (for weak
        penalties: nearly zero) curvature that slow the solver down. Full W
        only (a diagonal W cannot shift a column).
        """
        if self.structure != "full":
            return theta
        k = self.k
        w, b = self.unpack(theta)
        if self.c_diag:
            dw = np.diag(w)
            shift = -(self.c_off * (w.sum(axis=0) - dw) + self.c_diag * (dw - self.target)) / (
                self.c_off * (k - 1) + self.c_diag
            )
        else:
            shift = -(w.sum(axis=0) - np.diag(w)) / (k - 1)
        return np.concatenate([(w + shift).ravel(), b - b.mean()])

    def canonical_gradient(self, grad: np.ndarray) -> np.ndarray:
        """The gradient of ``loss(canonical(theta))`` from that of ``loss`` at
        ``canonical(theta)`` (the transpose of the projection)."""
        if self.structure != "full":
            return grad
        k = self.k
        gw, gb = grad[: k * k].reshape(k, k), grad[k * k :]
        if self.c_diag:
            weights = np.where(self.offdiag, self.c_off, self.c_diag)
            out = gw - gw.sum(axis=0) * (weights / (self.c_off * (k - 1) + self.c_diag))
        else:
            out = gw - (gw.sum(axis=0) / (k - 1)) * self.offdiag
        return np.concatenate([out.ravel(), gb - gb.mean()])

    def solve(self, theta0: np.ndarray, *, max_iter: int, tol: float,
              block_classes: int | None = None, diagonal_blocks: bool = False):
        """Minimise from ``theta0``: L-BFGS-B in preconditioned variables.

        Full W uses per-class curvature blocks (:meth:`_solve_blocks`) up to
        ``block_classes`` (default ``MAX_BLOCK_CLASSES``) classes and their
        diagonal + rank-1 approximation (:meth:`_solve_rank_one`) above; a
        diagonal W, the penalty scaling (:meth:`_solve_scaled`), or with
        ``diagonal_blocks`` the 2 x 2 curvature blocks of each class's
        ``(w_i, b_i)`` (:meth:`diagonal_blocks`). All are exact changes of
        variables: the optimum is the same, only the conditioning of the problem
        L-BFGS sees changes.

        When every part of ``W`` and ``b`` is infinitely penalised (:meth:`at_centre`)
        the only feasible point is the centre, :meth:`initial`: it is returned
        without solving (its ``jac`` is 0, the projected gradient of a single point).
        """
        if self.at_centre():
            theta = self.initial()
            return OptimizeResult(
                x=theta, fun=self.nll(theta, self.x, self.y), jac=np.zeros_like(theta), nit=0,
                success=True, status=0, message="infinite penalties: the centre, not solved")
        if self.structure != "full":
            if diagonal_blocks:
                return self._solve_whitened(
                    theta0, lambda t: _Blocks(self.diagonal_blocks(t)), max_iter=max_iter,
                    tol=tol,
                )
            return self._solve_scaled(theta0, max_iter=max_iter, tol=tol)
        if self.k <= (MAX_BLOCK_CLASSES if block_classes is None else block_classes):
            return self._solve_blocks(theta0, max_iter=max_iter, tol=tol)
        return self._solve_rank_one(theta0, max_iter=max_iter, tol=tol)

    def at_centre(self) -> bool:
        """Every parameter infinitely penalised: ``W = target I, b = 0`` is the solution."""
        parts = [self.c_diag, self.c_bias] + ([self.c_off] if self.structure == "full" else [])
        return all(math.isinf(c) for c in parts)

    def _lbfgs(self, fun, v0, max_iter: int, tol: float, gtol: float | None = None):
        return minimize(
            fun,
            v0,
            jac=True,
            method="L-BFGS-B",
            options={
                "maxiter": max_iter,
                "ftol": tol,
                "gtol": tol if gtol is None else gtol,
                "maxcor": 20,
            },
        )

    def _solve_scaled(self, theta0: np.ndarray, *, max_iter: int, tol: float):
        """L-BFGS-B from ``theta0`` in penalty-scaled variables.

        L-BFGS runs on ``phi = theta / d`` with ``d = 1 / sqrt(1 + c)``, ``c``
        the curvature the penalty adds to each parameter (``2 off`` off the
        diagonal, ``2 diag`` on it, ``2 bias`` on the bias; for the linear
        scalers ``2 lam / (K (K - 1))``, ``2 lam / K`` and ``2 mu / K``): it
        removes the ill-conditioning that the penalty alone adds to strongly
        penalised fits (``bench/odir.py`` measures the effect).
        """
        k = self.k
        if self.structure == "full":
            cw = np.where(self.offdiag, 2.0 * self.c_off, 2.0 * self.c_diag).ravel()
        else:
            cw = np.full(k, 2.0 * self.c_diag)
        d = 1.0 / np.sqrt(1.0 + np.concatenate([cw, np.full(k, 2.0 * self.c_bias)]))

        def scaled(phi):
            loss, grad = self(self.canonical(phi * d))
            return loss, self.canonical_gradient(grad) * d

        res = self._lbfgs(scaled, theta0 / d, max_iter, tol)
        res.x, res.jac = self.canonical(res.x * d), res.jac / d
        return res

    def curvature_rows(self) -> np.ndarray:
        """The rows the whitening's curvature is estimated on: at most ``block_rows``,
        evenly spaced."""
        return self.x[:: -(-self.n // self.block_rows)]

    def curvature_blocks(self, theta: np.ndarray) -> np.ndarray:
        """Per-class curvature of the loss at ``theta``, shape (K, K+1, K+1).

        Block i is the Hessian of the loss in class i's parameters ``(W[i], b[i])``
        when the other classes are held fixed, ``mean_n q_ni x~_n x~_n^T`` with
        ``q = p (1 - p)`` and ``x~ = [phi(z), 1]``, plus the penalty's
        curvature and a small damping (``DAMPING``). Estimated on at most
        ``block_rows`` rows, and each block only on the rows where ``q_ni``
        outweighs the damping, so that it costs about as much as one loss
        evaluation.
        What makes Dirichlet features hard is visible here: log-probabilities
        share a large per-row offset, so the weighted moments are dominated by
        one direction per class, and the diagonal entries, unpenalised, have
        curvature only where class i is likely, which is where ``log p_i`` is
        near 0.
        """
        k = self.k
        x = self.curvature_rows()
        n = len(x)
        # p as exp(log_softmax): the fitted numbers are pinned to this rounding
        # (tests/calibrators/test_reference_outputs.py), not to that of softmax().
        q = np.exp(log_softmax(self.logits(theta, x)))
        q *= 1.0 - q
        damping = DAMPING * float(q.mean())
        blocks = np.empty((k, k + 1, k + 1))
        for i in range(k):
            # Rows weighing less than the damping adds are left out: they change
            # the block by less than the damping does, and they are most rows.
            rows = np.flatnonzero(q[:, i] > 0.5 * damping)
            root = np.sqrt(q[rows, i] / n)
            xi = x[rows] * root[:, None]
            blocks[i, :k, :k] = xi.T @ xi
            blocks[i, :k, k] = blocks[i, k, :k] = xi.T @ root
            blocks[i, k, k] = root @ root
        diag = np.arange(k + 1)
        penalty = np.full((k, k + 1), 2.0 * self.c_off)
        penalty[np.arange(k), np.arange(k)] = 2.0 * self.c_diag
        penalty[:, k] = 2.0 * self.c_bias
        blocks[:, diag, diag] += penalty
        moment = np.empty((k + 1, k + 1))
        moment[:k, :k] = x.T @ x / n
        moment[:k, k] = moment[k, :k] = x.mean(axis=0)
        moment[k, k] = 1.0
        blocks += damping * moment
        return blocks

    def diagonal_blocks(self, theta: np.ndarray) -> np.ndarray:
        """Per-class curvature of a diagonal W's loss at ``theta``, shape (K, 2, 2).

        Block i is the Hessian in ``(w_i, b_i)`` with the other classes held
        fixed, ``mean_n q_ni [x_ni, 1] [x_ni, 1]^T`` with ``q = p (1 - p)``, plus
        the penalty's curvature and the damping of :meth:`curvature_blocks`, on
        at most ``block_rows`` rows: ``O(N K)``. Log-probability features share
        a large negative offset, so ``w_i`` and ``b_i`` are strongly coupled:
        these blocks undo that.
        """
        x = self.curvature_rows()
        q = np.exp(log_softmax(self.logits(theta, x)))
        q *= 1.0 - q
        damping = DAMPING * float(q.mean())
        qx = q * x
        blocks = np.empty((self.k, 2, 2))
        blocks[:, 0, 0] = np.einsum("nk,nk->k", qx, x) / len(x) + 2.0 * self.c_diag
        blocks[:, 0, 1] = blocks[:, 1, 0] = qx.mean(axis=0) + damping * x.mean(axis=0)
        blocks[:, 1, 1] = q.mean(axis=0) + 2.0 * self.c_bias + damping
        blocks[:, 0, 0] += damping * np.einsum("nk,nk->k", x, x) / len(x)
        return blocks

    def rank_one_factors(self, theta: np.ndarray) -> _RankOne:
        """Each curvature block approximated by a diagonal plus a rank-1 term.

        Block i is ``mean_n q_ni x~ x~^T``: its weighted mean ``s_i = mean_n q_ni
        x~_n`` (the rank-1 part, ``s_i s_i^T / mean_n q_ni``) carries what makes
        Dirichlet hard, the shared log-probability offset; the rest is taken as
        diagonal (the weighted variance of each feature), plus the penalty and the
        damping of :meth:`curvature_blocks`. Two matrix products to build and
        ``O(K^2)`` memory, for any K.
        """
        k = self.k
        x = self.curvature_rows()
        m = len(x)
        xt = np.concatenate([x, np.ones((m, 1), dtype=x.dtype)], axis=1)
        xx = xt * xt
        q = np.exp(log_softmax(self.logits(theta, x)))
        q *= 1.0 - q
        weight = np.maximum(q.mean(axis=0), 1e-300)  # (K,)
        mean = q.T @ xt / m  # (K, K+1)
        diag = q.T @ xx / m - mean * mean / weight[:, None]
        penalty = np.full((k, k + 1), 2.0 * self.c_off)
        penalty[np.arange(k), np.arange(k)] = 2.0 * self.c_diag
        penalty[:, k] = 2.0 * self.c_bias
        diag = np.maximum(diag, 0.0) + penalty + DAMPING * float(q.mean()) * xx.mean(axis=0)
        if not np.all(diag > 0):  # an unused, unpenalised parameter: nothing to whiten with
            raise np.linalg.LinAlgError("a zero diagonal")
        return _RankOne(diag, mean, weight)

    def _solve_blocks(self, theta0: np.ndarray, *, max_iter: int, tol: float):
        """L-BFGS-B whitened by the per-class curvature blocks (K <= MAX_BLOCK_CLASSES).

        With ``H_i = L_i L_i^T`` (:meth:`curvature_blocks`), class i's parameters
        are ``(W[i], b[i]) = L_i^-T v_i``, so the loss L-BFGS sees has a Hessian
        close to the identity within each class: far fewer evaluations than
        with the penalty scaling alone, to an equal or lower loss, above all for
        Dirichlet features (``bench/odir.py``; figures in ``bench/README.md``).
        """
        return self._solve_whitened(
            theta0, lambda t: _Blocks(self.curvature_blocks(t)), max_iter=max_iter, tol=tol
        )

    def _solve_rank_one(self, theta0: np.ndarray, *, max_iter: int, tol: float):
        """L-BFGS-B whitened by diagonal + rank-1 blocks (:meth:`rank_one_factors`).

        For K above ``MAX_BLOCK_CLASSES``: nearly as few evaluations as the full
        blocks, and far fewer than the penalty scaling alone or a diagonal
        preconditioner (``bench/odir.py``; figures in ``bench/README.md``).
        """
        return self._solve_whitened(theta0, self.rank_one_factors, max_iter=max_iter, tol=tol)

    def _solve_whitened(self, theta0: np.ndarray, factors, *, max_iter: int, tol: float):
        """L-BFGS-B on ``theta = A v`` per class, ``A`` from ``factors(theta)``.

        The factors depend on the probabilities, so they are recomputed after
        ``REFRESH_ITERATIONS`` iterations, then twice as many, and so on, until
        L-BFGS converges. Each restart is scaled so that L-BFGS-B's first step,
        of length 1 / |g|, is the whitened Newton step -g (otherwise a restart
        near the optimum starts with a far too long step, backtracks, and the
        tiny decrease passes L-BFGS-B's relative-decrease test for convergence).
        """
        k = self.k
        theta, used, refresh = self.canonical(theta0), 0, REFRESH_ITERATIONS
        while True:
            try:
                a = factors(theta)
            except np.linalg.LinAlgError:  # singular (e.g. a constant feature)
                res = self._solve_scaled(theta, max_iter=max_iter - used, tol=tol)
                res.nit += used
                return res
            v0 = a.inverse(self._rows(theta)).ravel()
            loss0, grad0 = self(theta)
            g0 = self._whitened_gradient(a, grad0)
            scale = max(float(np.linalg.norm(g0)), 1e-300)

            def to_theta(v, a=a, scale=scale):
                return self.canonical(self._theta(a.apply(v.reshape(k, -1) * scale)))

            def fun(v, a=a, scale=scale, first=[v0 / scale, loss0, g0]):  # noqa: B006
                if first and np.array_equal(v, first[0]):  # L-BFGS starts where we did
                    _, loss, g = first
                    first.clear()
                    return loss, g * scale
                loss, grad = self(to_theta(v))
                return loss, self._whitened_gradient(a, grad) * scale

            budget = min(refresh, max_iter - used)
            res = self._lbfgs(fun, v0 / scale, budget, tol, gtol=tol * scale)
            used += res.nit
            theta = to_theta(res.x)
            res.jac = res.jac / scale
            if res.status != 1 or used >= max_iter:  # converged, failed, or out of budget
                break
            refresh *= 2
        if res.status != 0 and res.nit == 0 and used < max_iter:
            # No step was possible in these variables (a line search failed at once):
            # go on with the plain scaling from where the whitening got to.
            res = self._solve_scaled(theta, max_iter=max_iter - used, tol=tol)
            res.nit += used
            return res
        g = a.inverse_transpose(res.jac.reshape(k, -1))
        res.x, res.jac, res.nit = theta, self._theta(g), used
        return res

    def _rows(self, theta: np.ndarray) -> np.ndarray:
        """Class i's parameters as row i: ``(W[i], b[i])``, shape (K, K+1) for a
        full W, ``(w_i, b_i)``, shape (K, 2), for a diagonal one."""
        w, b = self.unpack(theta)
        if self.structure == "full":
            return np.concatenate([w, b[:, None]], axis=1)
        return np.stack([w, b], axis=1)

    def _theta(self, rows: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`_rows`."""
        if self.structure == "full":
            return np.concatenate([rows[:, : self.k].ravel(), rows[:, self.k]])
        return np.concatenate([rows[:, 0], rows[:, 1]])

    def _whitened_gradient(self, a, grad: np.ndarray) -> np.ndarray:
        return a.transpose(self._rows(self.canonical_gradient(grad))).ravel()

    def nll(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Unpenalised mean NLL of ``theta`` on other rows ``x, y``."""
        return float(np.mean(self.row_nll(theta, x, y)))

    def row_nll(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Unpenalised NLL of ``theta`` on each of the rows ``x, y``, shape (n_rows,)."""
        u = log_softmax(self.logits(theta, x))
        return -u[np.arange(len(y)), y].astype(np.float64)


class _Problem(PenalisedSoftmax):
    """The penalised NLL of the module docstring: ``off = lam / (K (K - 1))``, ``diag =
    lam / K`` with the diagonal pulled to ``beta`` (temperature scaling's inverse
    temperature on the same features), ``bias = mu / K``.

    ``lam = mu = inf`` is temperature scaling itself, ``W = beta I, b = 0``:
    :meth:`solve` returns it without solving.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, lam: float, mu: float,
                 beta: float = 1.0):
        if math.isinf(lam) != math.isinf(mu):
            raise ValueError(f"lam and mu must be both infinite or both finite. Got {lam}, {mu}.")
        k = x.shape[1]
        super().__init__(x, y, structure, off=lam / (k * (k - 1)), diag=lam / k, bias=mu / k,
                         target=beta)
        self.lam, self.mu = lam, mu
        self.temperature = self.at_centre()


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
    fold's fit is warm-started from that fold's previous solution, and the
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
        knows (:class:`calibrators.structured._Problem`). Default: a new
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
        if noise is None:
            return res.x, prob.nll(res.x, *rows), prob.evaluations, None
        per_row = prob.row_nll(res.x, *rows)
        return res.x, float(np.mean(per_row)), prob.evaluations, per_row

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
            thetas = [r[0] for r in results]
            # the mean over the folds (of the folds' means), as without ``noise``
            scores.append(float(np.mean([r[1] for r in results])))
            solutions.append(thetas)
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


def check_grid(name: str, value) -> list[float]:
    """The penalty grid as a list of distinct floats, strongest (largest) first.

    Raises CalibrationInputError unless ``value`` is a non-empty list (or tuple,
    or 1-D array) of finite numbers > 0.
    """
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise CalibrationInputError(
            f"{name} must be a non-empty list of finite numbers > 0. Got {value!r}."
        )
    values = [check_positive(f"{name} values", g) for g in value]
    if not values:
        raise CalibrationInputError(
            f"{name} must be a non-empty list of finite numbers > 0. Got {value!r}."
        )
    return sorted({float(g) for g in values}, reverse=True)


class _LinearScaler(LinearSoftmax):
    """Shared fitting of the vector/matrix/Dirichlet scalers (see module docstring).

    Parameters
    ----------
    reg_lambda : float, optional
        Weight of the penalty on ``W - beta I`` (``beta``: temperature scaling's
        inverse temperature), its off-diagonal and diagonal parts each normalised
        by their number of entries; 0 or more; chosen by cross-validation when
        None.
    reg_mu : float, optional
        Weight of the penalty on the bias, 0 or more; chosen by cross-validation
        when None.
    grid : sequence of float, default=DEFAULT_GRID
        Candidate penalty weights for the cross-validation (stored in
        ``to_params()`` sorted, strongest first, without repeats).
    n_folds : int, default=3
        2 to 1,000 (``MAX_FOLDS``).
    seed : int, default=0
        Seed of the fold assignment (``numpy.random.default_rng``): an int64, >= 0
        when a penalty is cross-validated.
    max_iter : int, default=1000
        L-BFGS iterations per fit; 1 to 1,000,000 (``MAX_ITERATIONS``).
    tol : float, default=1e-9
        L-BFGS tolerance on the relative loss decrease and projected gradient.
    """

    has_bias = True
    option_checks: ClassVar[dict] = {
        "reg_lambda": Positive(allow_zero=True, allow_none=True),
        "reg_mu": Positive(allow_zero=True, allow_none=True),
        "grid": check_grid,
        "n_folds": Integer(2, MAX_FOLDS),
        "seed": Integer(INT64_MIN, INT64_MAX),
        "max_iter": Integer(1, MAX_ITERATIONS),
        "tol": Positive(),
    }

    def __init__(
        self,
        *,
        reg_lambda: float | None = None,
        reg_mu: float | None = None,
        grid=DEFAULT_GRID,
        n_folds: int = 3,
        seed: int = 0,
        max_iter: int = 1000,
        tol: float = 1e-9,
    ):
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        self.grid = grid
        self.n_folds = n_folds
        self.seed = seed
        self.max_iter = max_iter
        self.tol = tol

    def _validate_params(self) -> dict:
        options = super()._validate_params()
        searched = options["reg_mu"] is None or options["reg_lambda"] is None
        if searched and options["seed"] < 0:
            raise CalibrationInputError(
                "seed must be an integer >= 0 when a penalty is chosen by cross-validation "
                f"(reg_lambda or reg_mu None). Got {options['seed']!r}."
            )
        return options

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: float64 copies of the scores, and for a
        full ``W`` the solver's ``K**2``-sized state.

        ``P`` parameters (``2 K`` diagonal, ``K**2 + K`` full); ``F`` folds, ``T =
        min(F, n_threads())`` of them fitted at once; ``b = min(N, BLOCK_ROWS)``.
        The solver holds ``S = 2 lbfgs_bytes(P, 20) + 8 * 30 P + B``: two L-BFGS-B
        workspaces (a result and the next solve), parameter-sized temporaries and
        the whitening ``B`` of a full ``W``: ``4 * 8 K (K + 1)**2 + 2 * 8 b K``
        (per-class curvature blocks, their Cholesky factors and inverses) up to
        ``MAX_BLOCK_CLASSES`` classes; above, that term at ``MAX_BLOCK_CLASSES`` (a
        bound that keeps the model non-decreasing in K) plus ``8 (6 K (K + 1) + 4 b
        (K + 1))`` (diagonal + rank-1 factors); for a diagonal ``W`` (whitened by its 2 x
        2 blocks) ``4 * 8 b K``, the blocks' temporaries.

        * bytes = ``8 N K + max(2 * 8 N K + S, T * fold, temperature) + 8 C (F P + N)
          + chunk_bytes(1, K, threads=1)``: the features; the final fit's logits
          and softmax, or ``fold = 8 N K (3 (F - 1) + 1) / F + S`` (a fold's copies
          and temporaries) when a penalty is cross-validated (else 0), or the
          temperature fit on the features (``min(chunk_bytes(3, K), 3 * 8 N K) + 32
          N``: its model, its chunks bounded by the rows);
          the fold solutions and per-row held-out NLLs of the ``C`` candidates
          tried (per searched penalty ``len(grid) + EXTEND_STEPS``, 2 more with
          ``REFINE_FACTOR``; 1 more, temperature scaling, when ``mu`` is
          searched); a chunk of slack for small temporaries.
        * flops = the temperature fit's + ``100 (1 + C F / 2) (4 N K**2 + SWEEP_FLOPS
          N K)`` for a full ``W`` (without ``4 N K**2`` for a diagonal one): about
          100 loss evaluations per solve, the warm-started fold solves about half
          as many.
        """
        n, k = n_samples, n_classes
        full = cls.structure == "full"
        params = k * k + k if full else 2 * k
        folds = options["n_folds"]
        searched = [options["reg_mu"] is None, options["reg_lambda"] is None]
        candidates = sum(searched) * (
            len(options["grid"]) + EXTEND_STEPS + (2 if REFINE_FACTOR else 0)
        ) + int(searched[0])
        temperature = TemperatureScaler.fit_cost(n, k, TemperatureScaler().get_options())
        rows = min(n, BLOCK_ROWS)
        whitening = 4 * FLOAT64 * rows * k  # a diagonal W's 2 x 2 blocks: their temporaries
        if full:
            kb = min(k, MAX_BLOCK_CLASSES)
            whitening = 4 * FLOAT64 * kb * (kb + 1) ** 2 + 2 * FLOAT64 * rows * kb
            if k > MAX_BLOCK_CLASSES:
                whitening += FLOAT64 * (6 * k * (k + 1) + 4 * rows * (k + 1))
        solver = 2 * lbfgs_bytes(params, 20) + 30 * FLOAT64 * params + whitening
        scores = FLOAT64 * n * k
        fold = scores * (3 * (folds - 1) + 1) / folds + solver if candidates else 0
        threads = min(folds, n_threads())
        # the temperature fit's chunks, on the N rows of held features
        centre = min(chunk_bytes(3, n_classes=k), 3 * scores) + 4 * FLOAT64 * n
        memory = scores + max(2 * scores + solver, threads * fold, centre) + (
            FLOAT64 * candidates * (folds * params + n) + chunk_bytes(1, n_classes=k, threads=1)
        )
        evaluation = (4.0 * n * k * k if full else 0.0) + SWEEP_FLOPS * n * k
        return Cost(bytes=int(memory), flops=temperature.flops
                    + 100.0 * (1 + candidates * folds / 2) * evaluation)

    def _features(self, x: np.ndarray, kind: str) -> np.ndarray:
        """``phi`` of the validated scores, float64 (N, K), in row blocks."""
        return map_rows(lambda block: self._phi(logits64(block, kind)), x)

    def _cross_validate(self, feats, y, fold_of, candidates, warm, progress, beta):
        """:func:`cross_validate_path` of the penalised problems (``candidates``: (lam,
        mu) pairs), the diagonal pulled to ``beta``."""
        return cross_validate_path(
            lambda x, yy, cand: _Problem(x, yy, self.structure, *cand, beta=beta),
            feats, y, fold_of, candidates, warm, progress,
            max_iter=self.max_iter, tol=max(self.tol, CV_TOL),  # options as validated by fit
            noise=NOISE, solve_options=self._solve_options(),
        )

    def _solve_options(self) -> dict:
        """A diagonal W is whitened by its exact 2 x 2 (w_i, b_i) curvature blocks
        (:meth:`PenalisedSoftmax.solve`): log-probability features couple the two."""
        return {"diagonal_blocks": True} if self.structure == "diagonal" else {}

    def _fit(self, x: np.ndarray, y: np.ndarray, *, kind: str, options: dict,
             progress: Progress) -> dict:
        with single_threaded_blas():
            return self._fit_penalised(x, y, kind, options, progress)

    def _fit_penalised(self, x, y, kind, opts, progress) -> dict:
        started = time.perf_counter()
        feats = self._features(x, kind)
        n, _ = feats.shape
        grid = opts["grid"]
        # The centre of every penalty: temperature scaling on the same features.
        beta = float(TemperatureScaler().fit(feats, y).weight_)
        lam = opts["reg_lambda"]
        mu = opts["reg_mu"]
        tied = mu is None  # stage 1 moves mu with lam
        # Stage 1: lam along the grid with mu tied to it, temperature scaling (both
        # infinite) first; stage 2: mu along the grid at the chosen lam. A given
        # penalty skips its stage.
        stages = []
        if lam is None:
            stages.append("lam")
        if mu is None:
            stages.append("mu")
        total = len(stages) * (len(grid) + 1) * opts["n_folds"] + 1
        done = [0]

        def tick(fits):
            done[0] += fits
            progress(min(0.95, 0.95 * done[0] / total))

        evaluations = 0
        tried = []  # (stage, (lam, mu), cv_nll, fold solutions), every candidate scored
        if stages:
            if n < 2 * opts["n_folds"]:
                raise CalibrationInputError(
                    f"cross-validating the penalties needs at least {2 * opts['n_folds']} rows; "
                    f"give reg_lambda and reg_mu explicitly for tiny sets. Got {n} rows."
                )
            fold_of = fold_assignment(n, opts["n_folds"], opts["seed"])
            warm = [None] * opts["n_folds"]

            def walk(stage, cands, start, report):
                scores, thetas, evals = self._cross_validate(
                    feats, y, fold_of, cands, start, report, beta)
                tried.extend((stage, c, sc, th)
                             for c, sc, th in zip(cands, scores, thetas, strict=False))
                return scores, thetas, evals

            for stage in stages:
                if stage == "lam":
                    cands = [(g, g if tied else mu) for g in grid]
                    if tied:
                        cands.insert(0, (math.inf, math.inf))
                else:
                    # at the chosen lam; after temperature scaling, the strongest finite one
                    at = lam if lam is None or math.isfinite(lam) else grid[0]
                    cands = [(at, g) for g in grid]

                def weaker(cand, f, stage=stage):
                    a, b = cand
                    return (a * f, b * f if tied else b) if stage == "lam" else (a, b * f)

                scores, thetas, evals = walk(stage, cands, warm, tick)
                evaluations += evals
                best = int(np.argmin(scores))
                # Past the grid's weakest value while the weakest tried is the best.
                extended = 0
                while best == len(cands) - 1 and extended < EXTEND_STEPS:
                    cands = [*cands, weaker(cands[-1], 1.0 / EXTEND_FACTOR)]
                    more, sols, evals = walk(stage, cands[-1:], thetas[-1], lambda _: None)
                    evaluations += evals
                    scores, thetas = scores + more, thetas + sols
                    best, extended = int(np.argmin(scores)), extended + 1
                if REFINE_FACTOR and math.isfinite(cands[best][1]):
                    # A finer pass: the chosen value times and divided by the factor
                    # (the tie of stage 1 kept), each warm-started from the choice.
                    for f in (REFINE_FACTOR, 1.0 / REFINE_FACTOR):
                        _, _, evals = walk(stage, [weaker(cands[best], f)], thetas[best],
                                           lambda _: None)
                        evaluations += evals
                chosen = min((t for t in tried if t[0] == stage), key=lambda t: t[2])
                lam, mu = chosen[1]
                warm = chosen[3]
            _, (lam, mu), _, warm = min(tried, key=lambda t: t[2])
        prob = _Problem(feats, y, self.structure, lam, mu, beta=beta)
        # The final fit starts from the mean of the folds' solutions at the
        # chosen penalties (each fold path itself started from temperature scaling).
        start = prob.initial() if not stages else np.mean(warm, axis=0)
        res = prob.solve(start, max_iter=opts["max_iter"], tol=opts["tol"],
                         **self._solve_options())
        evaluations += prob.evaluations
        w, b = prob.unpack(res.x)
        self.weight_, self.bias_ = w.copy(), b.copy()
        progress(1.0)

        def finite(value):
            return value if value is None or math.isfinite(value) else None

        cv = [{"stage": stage, "reg_lambda": finite(a), "reg_mu": finite(b),
               "cv_nll": float(sc)} for stage, (a, b), sc, _ in tried]
        return {
            "reg_lambda": finite(lam),
            "reg_mu": finite(mu),
            "temperature_scaling": prob.temperature,
            "temperature": 1.0 / beta,
            "converged": bool(res.success),
            "message": str(res.message),
            "iterations": int(res.nit),
            "loss": float(res.fun),
            "gradient_max": float(np.max(np.abs(res.jac))),
            "evaluations": evaluations,
            "seconds": time.perf_counter() - started,
            "cross_validation": {"n_folds": opts["n_folds"], "candidates": cv} if cv else None,
        }


class VectorScaler(_LinearScaler):
    """Vector scaling: ``softmax(w * clr(z) + b)`` with a per-class scale and bias.

    ``clr(z)`` is the centred log-ratio of the logits
    (:func:`calibrators.validation.centred_log_ratio`), so logits with any per-row
    constant and the probabilities of the same distribution get one answer.
    Parameters are those of the shared fit (see :mod:`calibrators.linear`);
    ``reg_lambda`` weighs the scales' distance from temperature scaling's ``beta``.
    """

    method = "vector"
    structure = "diagonal"
    feature = "clr"
    format_1_feature = "logits"


class MatrixScaler(_LinearScaler):
    """Matrix scaling: ``softmax(W clr(z) + b)`` with a full ``W``, penalised towards
    temperature scaling.

    ``clr(z)`` as for :class:`VectorScaler`. Parameters are those of the shared fit
    (see :mod:`calibrators.linear`).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(200, 3))
    >>> y = (z.argmax(axis=1) + 1) % 3  # the model is always one class off
    >>> cal = MatrixScaler(reg_lambda=0.1, reg_mu=0.1).fit(z, y)
    >>> cal.weight_.shape, cal.fit_info_["converged"]
    ((3, 3), True)
    >>> float((cal.predict_proba(z).argmax(axis=1) == y).mean()) > 0.9
    True
    """

    method = "matrix"
    structure = "full"
    feature = "clr"
    format_1_feature = "logits"


class DirichletScaler(_LinearScaler):
    """Dirichlet calibration: ``softmax(W log_softmax(z) + b)``, penalised towards
    temperature scaling (see :mod:`calibrators.linear`)."""

    method = "dirichlet"
    structure = "full"
    feature = "log_softmax"
