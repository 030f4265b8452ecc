"""The penalised softmax regression every penalty-searching method solves.

:class:`PenalisedSoftmax` is the mean NLL of ``softmax(W x + b)`` plus ridge
penalties on the off-diagonal of ``W``, on its diagonal's distance from a target
(temperature scaling's ``beta``) and on the bias, with its analytic gradient and
two solvers: scipy's L-BFGS-B in variables whitened per class by the curvature of
the loss (exact blocks up to ``MAX_BLOCK_CLASSES`` classes, a diagonal + rank-1
approximation above) and the same for a diagonal ``W``. Vector, matrix and
Dirichlet scaling (:mod:`calibrators.methods._linear`) and SVS/SMS
(:mod:`calibrators.methods._structured`) build their problems on it; the
cross-validated walk along a penalty path is :mod:`calibrators.solvers.crossval`.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import OptimizeResult, minimize

from calibrators.numerics import (
    log_softmax,
    softmax_terms,
)

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
#: A step of :meth:`PenalisedSoftmax._solve_block_newton` is accepted when the loss
#: falls by this fraction of the decrease its slope promises (Armijo's rule), else
#: halved, at most HALVINGS times.
ARMIJO = 1e-4
HALVINGS = 30



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


def _solve_2x2(blocks: np.ndarray, gw: np.ndarray, gb: np.ndarray) -> np.ndarray:
    """``blocks[i]^-1 (gw_i, gb_i)`` for symmetric positive definite 2 x 2 blocks,
    as the parameter vector ``(w, b)`` (shape (2 K,))."""
    a, c, d = blocks[:, 0, 0], blocks[:, 0, 1], blocks[:, 1, 1]
    det = a * d - c * c
    return np.concatenate([(d * gw - c * gb) / det, (a * gb - c * gw) / det])


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
    (:mod:`calibrators.methods._structured`) centre it on 1 and weigh the three parts
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
              block_classes: int | None = None, diagonal_blocks: bool = False,
              newton_steps: int | None = None):
        """Minimise from ``theta0``: L-BFGS-B in preconditioned variables.

        Full W uses per-class curvature blocks (:meth:`_solve_blocks`) up to
        ``block_classes`` (default ``MAX_BLOCK_CLASSES``) classes and their
        diagonal + rank-1 approximation (:meth:`_solve_rank_one`) above; a
        diagonal W, the penalty scaling (:meth:`_solve_scaled`), or with
        ``diagonal_blocks`` the 2 x 2 curvature blocks of each class's
        ``(w_i, b_i)`` (:meth:`diagonal_blocks`). All are exact changes of
        variables: the optimum is the same, only the conditioning of the problem
        L-BFGS sees changes. With ``newton_steps`` a diagonal W is not solved to
        ``tol`` but moved that many damped steps of :meth:`_solve_block_newton`
        (an approximate solution, for penalty searches that rank candidates).

        When every part of ``W`` and ``b`` is infinitely penalised (:meth:`at_centre`)
        the only feasible point is the centre, :meth:`initial`: it is returned
        without solving (its ``jac`` is 0, the projected gradient of a single point).
        """
        if self.at_centre():
            theta = self.initial()
            return OptimizeResult(
                x=theta, fun=self.centre_nll(theta), jac=np.zeros_like(theta), nit=0,
                success=True, status=0, message="infinite penalties: the centre, not solved")
        if self.structure != "full":
            if newton_steps:
                return self._solve_block_newton(theta0, steps=min(newton_steps, max_iter))
            if diagonal_blocks:
                return self._solve_whitened(
                    theta0, lambda t: _Blocks(self.diagonal_blocks(t)), max_iter=max_iter,
                    tol=tol,
                )
            return self._solve_scaled(theta0, max_iter=max_iter, tol=tol)
        if self.k <= (MAX_BLOCK_CLASSES if block_classes is None else block_classes):
            return self._solve_blocks(theta0, max_iter=max_iter, tol=tol)
        return self._solve_rank_one(theta0, max_iter=max_iter, tol=tol)

    def centre_nll(self, theta: np.ndarray) -> float:
        """The NLL at the centre ``theta``: :meth:`solve`'s loss under infinite penalties."""
        return self.nll(theta, self.x, self.y)

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

    def _solve_block_newton(self, theta0: np.ndarray, *, steps: int):
        """``steps`` Newton steps of a diagonal W in its 2 x 2 curvature blocks, from
        ``theta0``, the last one not evaluated: an approximate solution for a penalty
        search, which needs the point's held-out NLL, not its loss.

        Each step solves :meth:`diagonal_blocks` (each class's ``(w_i, b_i)``, the
        other classes held fixed, damped) against the gradient: the first step L-BFGS
        takes in the whitened variables of ``diagonal_blocks=True``, with fresh
        blocks at every step instead of L-BFGS's curvature pairs, and without scipy's
        set-up per solve. Every step but the last is evaluated and halved until the
        loss falls by at least ``ARMIJO`` of the decrease its slope promises (at most
        ``HALVINGS`` times; then the steps end where they are); the last one only
        needs the gradient where it starts.

        Returns an ``OptimizeResult`` whose ``x`` is the point after the last step
        and ``restart`` the last point evaluated (``fun`` and ``jac`` are its loss
        and gradient): a search along a penalty path starts the next candidate's
        fit there, where the NLL and gradient are known (the structured scalers'
        ``_Problem.retarget`` hands them over), rather than at ``x``, which would cost
        an evaluation.
        """
        k = self.k
        theta = self.canonical(theta0)  # (a diagonal W's is itself)
        loss, grad = self(theta)
        x, taken = theta, 0
        for step_number in range(steps):
            direction = -_solve_2x2(self.diagonal_blocks(theta), grad[:k], grad[k:])
            slope = float(grad @ direction)
            if not slope < 0.0:  # a zero gradient (or not finite): nowhere to go
                break
            if step_number == steps - 1:
                x, taken = theta + direction, taken + 1
                break
            step = 1.0
            for _ in range(HALVINGS):
                trial = theta + step * direction
                trial_loss, trial_grad = self(trial)
                if trial_loss <= loss + ARMIJO * step * slope:
                    theta, loss, grad = trial, trial_loss, trial_grad
                    x, taken = theta, taken + 1
                    break
                step *= 0.5
            else:
                break
        return OptimizeResult(x=x, restart=theta, fun=loss, jac=grad, nit=taken, success=True,
                              status=0, message=f"{taken} of {steps} block Newton steps")

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
