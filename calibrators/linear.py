"""Vector, matrix and Dirichlet scaling with ODIR regularisation.

All three fit ``u = W phi(z) + b`` by minimising the mean NLL plus the ODIR
penalty of Kull et al. (2019)::

    loss(W, b) = mean_n [logsumexp(u_n) - u_n,y_n]
                 + lam / (K (K - 1)) * sum_{i != j} W_ij**2
                 + mu / K * sum_j b_j**2

(off-diagonal entries and bias are pulled to 0; the diagonal is free). The
gradient is analytic, ``dloss/dW = (P - Y)^T phi(z) / N + penalty'``, and the
problem is solved by scipy's L-BFGS-B from the identity (``W = I, b = 0``, so
an untrained model is plain softmax), in variables whitened per class by the
curvature of the loss (``_Problem.solve``): the log-probability features of
Dirichlet scaling make the plain problem badly conditioned.

When ``reg_lambda`` / ``reg_mu`` are not given they are chosen by k-fold
cross-validation over a log-spaced grid: within each fold the grid is walked
from the strongest penalty to the weakest, each fit warm-started from its
neighbour's solution (so it starts near its own optimum; ``bench/odir.py``
measures what that saves). After each stage a finer second pass tries the
chosen penalty times and divided by ``REFINE_FACTOR`` (``sqrt(10)``, half a step
of the grid; beyond its ends too): the CV NLL along the grid is not always
unimodal, and the weakest or strongest candidate is sometimes the best. The
final model is refitted on all rows at the chosen penalties. Everything is
deterministic for a given ``seed``.

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
from scipy.optimize import minimize

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
#: Stop walking the grid after this many candidates worse than the best.
PATIENCE = 2
#: ... worse by more than this fraction of the best CV NLL (the search's own tolerance):
#: on a flat stretch of the path the differences are the solver's, and the walk goes
#: on (``bench/README.md``, the lenet-5 1.2818 goal).
TIE = CV_TOL
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
                     + off * sum_{i != j} W_ij**2 + diag * sum_i (W_ii - 1)**2
                     + bias * sum_j b_j**2

    A full ``W`` (``structure="full"``: parameters ``W.ravel()`` then ``b``) or a
    diagonal one (``"diagonal"``: the K diagonal entries, then ``b``; ``off`` is
    unused). ODIR (:class:`_Problem`) is the case ``diag = 0``; structured
    matrix and vector scaling (:mod:`calibrators.structured`) penalise all three
    parts. :meth:`solve` is exact for any of them.

    Parameters
    ----------
    x : ndarray of shape (n_samples, n_classes), float64
        The features ``phi(z)``.
    y : ndarray of shape (n_samples,), int
    structure : {"diagonal", "full"}
    off, diag, bias : float, default 0.0
        Penalty coefficients (>= 0) per squared entry.
    block_rows : int, default BLOCK_ROWS
        The whitening's curvature is estimated on at most this many (evenly
        spaced) rows.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, *, off: float = 0.0,
                 diag: float = 0.0, bias: float = 0.0, block_rows: int = BLOCK_ROWS):
        self.x, self.y, self.structure = x, y, structure
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
        return np.concatenate([w, np.zeros(k)])

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
                d = np.diag(w) - 1.0
                loss += self.c_diag * float(d @ d)
                gw[np.arange(k), np.arange(k)] += 2.0 * self.c_diag * d
            gw = gw.ravel()
        elif self.c_diag:
            d = w - 1.0
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
        (W_jj - 1)) / (off (K - 1) + diag)``, ``s_j`` the sum of its off-diagonal
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
            shift = -(self.c_off * (w.sum(axis=0) - dw) + self.c_diag * (dw - 1.0)) / (
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
        """
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
        diagonal, ``2 diag`` on it, ``2 bias`` on the bias; for ODIR ``2 lam /
        (K (K - 1))``, 0 and ``2 mu / K``): it removes the ill-conditioning that
        the penalty alone adds to strongly penalised fits (``bench/odir.py``
        measures the effect).
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
        u = log_softmax(self.logits(theta, x))
        return float(-np.mean(u[np.arange(len(y)), y]))


class _Problem(PenalisedSoftmax):
    """The ODIR-penalised NLL (module docstring): ``off = lam / (K (K - 1))``,
    ``diag = 0``, ``bias = mu / K``."""

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, lam: float, mu: float):
        k = x.shape[1]
        super().__init__(x, y, structure, off=lam / (k * (k - 1)), bias=mu / k)
        self.lam, self.mu = lam, mu


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
                        retarget=None):
    """Mean held-out NLL of penalty candidates along a path, over the folds.

    The candidates are walked in order (strongest penalty first); each
    fold's fit is warm-started from that fold's previous solution, and the
    folds of one candidate run on parallel threads (numpy and scipy
    release the GIL in the products). The walk stops early once the CV
    NLL has risen ``patience`` times past the best candidate (a candidate
    within ``tie`` times the best CV NLL of it is not a rise): the weakly
    penalised fits at the end of the path are the slow ones.

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
    scores, solutions, evaluations = [], [], 0

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
        return res.x, prob.nll(res.x, *rows), prob.evaluations

    with ThreadPoolExecutor(max_workers=min(n_folds, n_threads())) as pool:
        for cand in candidates:
            results = list(pool.map(fit_fold, [(f, cand) for f in range(n_folds)]))
            thetas = [r[0] for r in results]
            scores.append(float(np.mean([r[1] for r in results])))
            solutions.append(thetas)
            evaluations += sum(r[2] for r in results)
            progress(n_folds)
            best = int(np.argmin(scores))
            rises = sum(s > scores[best] * (1.0 + tie) for s in scores[best + 1 :]) if tie \
                else len(scores) - 1 - best
            if rises >= patience:
                break
    return scores, solutions, evaluations


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
        Off-diagonal penalty weight, 0 or more; chosen by cross-validation when
        None. Ignored by vector scaling (no off-diagonal).
    reg_mu : float, optional
        Bias penalty weight, 0 or more; chosen by cross-validation when None.
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
        searched = options["reg_mu"] is None or (
            self.structure == "full" and options["reg_lambda"] is None
        )
        if searched and options["seed"] < 0:
            raise CalibrationInputError(
                "seed must be an integer >= 0 when a penalty is chosen by cross-validation "
                f"(reg_lambda or reg_mu None). Got {options['seed']!r}."
            )
        return options

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the ODIR fit: float64 copies of the scores, and for a
        full ``W`` the solver's ``K**2``-sized state.

        ``P`` parameters (``2 K`` diagonal, ``K**2 + K`` full); ``F`` folds, ``T =
        min(F, n_threads())`` of them fitted at once; ``b = min(N, BLOCK_ROWS)``.
        The solver holds ``S = 2 lbfgs_bytes(P, 20) + 8 * 30 P + B``: two L-BFGS-B
        workspaces (a result and the next solve), parameter-sized temporaries and
        the whitening ``B`` of a full ``W``: ``4 * 8 K (K + 1)**2 + 2 * 8 b K``
        (per-class curvature blocks, their Cholesky factors and inverses) up to
        ``MAX_BLOCK_CLASSES`` classes; above, that term at ``MAX_BLOCK_CLASSES`` (a
        bound that keeps the model non-decreasing in K) plus ``8 (6 K (K + 1) + 4 b
        (K + 1))`` (diagonal + rank-1 factors). A diagonal ``W`` has no ``B``.

        * bytes = ``8 N K + max(2 * 8 N K + S, T * fold) + 8 F C P + chunk_bytes(1,
          K, threads=1)``: the features; the final fit's logits and softmax, or
          ``fold = 8 N K (3 (F - 1) + 1) / F + S`` (a fold's copies and
          temporaries) when a penalty is cross-validated (else 0); the fold
          solutions of the ``C`` candidates tried (``len(grid)`` per searched
          penalty, 2 more with ``REFINE_FACTOR``); a chunk of slack for small
          temporaries.
        * flops = ``100 (1 + C F / 2) (4 N K**2 + SWEEP_FLOPS N K)`` for a full
          ``W`` (without ``4 N K**2`` for a diagonal one): about 100 loss
          evaluations per solve, the warm-started fold solves about half as many.
        """
        n, k = n_samples, n_classes
        full = cls.structure == "full"
        params = k * k + k if full else 2 * k
        folds = options["n_folds"]
        searched = [options["reg_mu"] is None, full and options["reg_lambda"] is None]
        candidates = sum(searched) * (len(options["grid"]) + (2 if REFINE_FACTOR else 0))
        rows = min(n, BLOCK_ROWS)
        whitening = 0
        if full:
            kb = min(k, MAX_BLOCK_CLASSES)
            whitening = 4 * FLOAT64 * kb * (kb + 1) ** 2 + 2 * FLOAT64 * rows * kb
            if k > MAX_BLOCK_CLASSES:
                whitening += FLOAT64 * (6 * k * (k + 1) + 4 * rows * (k + 1))
        solver = 2 * lbfgs_bytes(params, 20) + 30 * FLOAT64 * params + whitening
        scores = FLOAT64 * n * k
        fold = scores * (3 * (folds - 1) + 1) / folds + solver if candidates else 0
        threads = min(folds, n_threads())
        memory = scores + max(2 * scores + solver, threads * fold) + (
            FLOAT64 * folds * candidates * params + chunk_bytes(1, n_classes=k, threads=1)
        )
        evaluation = (4.0 * n * k * k if full else 0.0) + SWEEP_FLOPS * n * k
        return Cost(bytes=int(memory), flops=100.0 * (1 + candidates * folds / 2) * evaluation)

    @classmethod
    def fit_key(cls, kind: str) -> tuple:
        """The structure of ``W`` and the features the fit sees: on probabilities the
        logits are ``log p``, whose log-softmax is ``log p`` again (to the rounding of
        ``sum p``), so matrix and Dirichlet scaling fit the same problem there."""
        log_softmax_features = cls.feature == "log_softmax" or kind == "probabilities"
        return ("linear", cls.structure, "log_softmax" if log_softmax_features else "logits")

    def _features(self, x: np.ndarray, kind: str) -> np.ndarray:
        """``phi`` of the validated scores, float64 (N, K), in row blocks."""
        return map_rows(lambda block: self._phi(logits64(block, kind)), x)

    def _cross_validate(self, feats, y, fold_of, candidates, warm, progress):
        """:func:`cross_validate_path` of ODIR problems (``candidates``: (lam, mu) pairs)."""
        return cross_validate_path(
            lambda x, yy, cand: _Problem(x, yy, self.structure, *cand),
            feats, y, fold_of, candidates, warm, progress,
            max_iter=self.max_iter, tol=max(self.tol, CV_TOL),  # options as validated by fit
            tie=TIE,
        )

    def _fit(self, x: np.ndarray, y: np.ndarray, *, kind: str, options: dict,
             progress: Progress) -> dict:
        with single_threaded_blas():
            return self._fit_penalised(x, y, kind, options, progress)

    def _fit_penalised(self, x, y, kind, opts, progress) -> dict:
        started = time.perf_counter()
        feats = self._features(x, kind)
        n, _ = feats.shape
        grid = opts["grid"]
        full = self.structure == "full"
        lam = 0.0 if not full else opts["reg_lambda"]
        mu = opts["reg_mu"]
        # Stage 1: lam along the grid with mu tied to it (strongest first);
        # stage 2: mu along the grid at the chosen lam. A given penalty skips
        # its stage; vector scaling has no lam.
        stages = []
        if lam is None:
            stages.append("lam")
        if mu is None:
            stages.append("mu")
        total = sum(len(grid) for _ in stages) * opts["n_folds"] + 1
        done = [0]

        def tick(fits):
            done[0] += fits
            progress(0.95 * done[0] / total)

        evaluations = 0
        cv = []
        warm = [None] * opts["n_folds"]
        if stages:
            if n < 2 * opts["n_folds"]:
                raise CalibrationInputError(
                    f"cross-validating the penalties needs at least {2 * opts['n_folds']} rows; "
                    f"give reg_lambda and reg_mu explicitly for tiny sets. Got {n} rows."
                )
            fold_of = fold_assignment(n, opts["n_folds"], opts["seed"])
            for stage in stages:
                if stage == "lam":
                    cands = [(g, g if mu is None else mu) for g in grid]
                else:
                    cands = [(lam, g) for g in grid]
                scores, thetas, evals = self._cross_validate(feats, y, fold_of, cands, warm, tick)
                evaluations += evals
                best = int(np.argmin(scores))
                if REFINE_FACTOR:
                    # A finer pass: the chosen value times and divided by the factor
                    # (the tie of stage 1 kept), each warm-started from the choice.
                    tried = len(scores)
                    for f in (REFINE_FACTOR, 1.0 / REFINE_FACTOR):
                        a, b = cands[best]
                        cand = (a * f, b * f if mu is None else b) if stage == "lam" else (a, b * f)
                        more, sols, evals = self._cross_validate(
                            feats, y, fold_of, [cand], thetas[best], lambda _: None)
                        evaluations += evals
                        cands, scores, thetas = ([*cands[:tried], cand], scores + more,
                                                 thetas + sols)
                        tried += 1
                    best = int(np.argmin(scores))
                lam, mu = cands[best]
                warm = thetas[best]
                cv.extend(
                    {
                        "stage": stage,
                        "reg_lambda": a if full else None,
                        "reg_mu": b,
                        "cv_nll": float(s),
                    }
                    for (a, b), s in zip(cands[: len(scores)], scores, strict=True)
                )
        prob = _Problem(feats, y, self.structure, lam, mu)
        # The final fit starts from the mean of the folds' solutions at the
        # chosen penalties (each fold path itself started from the identity).
        start = prob.initial() if warm[0] is None else np.mean(warm, axis=0)
        res = prob.solve(start, max_iter=opts["max_iter"], tol=opts["tol"])
        evaluations += prob.evaluations
        w, b = prob.unpack(res.x)
        self.weight_, self.bias_ = w.copy(), b.copy()
        progress(1.0)
        return {
            "reg_lambda": lam if full else None,
            "reg_mu": mu,
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
    Parameters are those of the shared ODIR fit (see :mod:`calibrators.linear`);
    ``reg_lambda`` has no effect (there are no off-diagonal weights).
    """

    method = "vector"
    structure = "diagonal"
    feature = "clr"
    format_1_feature = "logits"


class MatrixScaler(_LinearScaler):
    """Matrix scaling: ``softmax(W clr(z) + b)`` with a full ``W``, ODIR-regularised.

    ``clr(z)`` as for :class:`VectorScaler`. Parameters are those of the shared ODIR
    fit (see :mod:`calibrators.linear`).

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
    """Dirichlet calibration: ``softmax(W log_softmax(z) + b)``, ODIR-regularised."""

    method = "dirichlet"
    structure = "full"
    feature = "log_softmax"
