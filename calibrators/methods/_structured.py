"""Structured vector and matrix scaling (SVS, SMS) of Berta et al. (2025).

Both fit ``u = W x + b`` on robust log-probability features ``x`` of the logits
``z``, with separate ridge penalties on the diagonal and off-diagonal parts of
``W`` and on the bias::

    x = log((softmax(beta z) + c) / (1 + K c))          (the preprocessing)
    loss(W, b) = mean_n [logsumexp(u_n) - u_n,y_n]
                 + lam_o K (K - 1) / N * sum_{i != j} W_ij**2     (SMS only)
                 + lam_d K / N * sum_i (W_ii - 1)**2
                 + lam_b K / N * sum_j b_j**2

The preprocessing is fitted first: ``beta`` is the exact temperature-scaling
optimum (:class:`calibrators.methods.temperature.TemperatureScaler`), and ``c = 1 / (N K)``
mixes the tempered probabilities with the uniform distribution at weight
``1 / (N + 1)``, so every feature lies in ``[log(c / (1 + K c)), 0]``: extreme or
``-inf`` log-probabilities cannot dominate the fit. With ``W = I, b = 0`` the model
is temperature scaling of the smoothed probabilities; the penalties pull towards
it. SVS has a diagonal ``W`` (``K`` scales), SMS a full one.

The penalty multipliers ``lam`` scale the paper's rule (``lam = 1`` for all three
is its default). Those left None are chosen together, as one multiplier, by
cross-validation over ``grid``: the rows are dealt into ``n_folds`` folds, and for
each of them (SMS: the first ``SMS_SCORED_FOLDS``) a problem on the other folds'
rows is fitted and scored on the fold's; each problem uses its own N in the rule,
the grid is walked from the strongest penalty down, each fit warm-started from
its neighbour (on the same copy of the fold's rows, inheriting the NLL and gradient
at its start: only the penalty is new there, :meth:`_Problem.retarget`), until the
CV NLL rises; the final fit on all rows starts from the
mean of the fits' solutions. The fits' size (``(F - 1) / F`` of the rows) is what
decides which penalty wins, since weak penalties pay off only with enough rows;
for SMS, whose evaluations cost ``O(N K**2)``, scoring two folds rather than all
four halves the search's work and on the shared CIFAR outputs chooses the same
penalties; SVS's search is cheap and its CV curve flatter (two folds mislead it
on CIFAR-100), so it scores all (``bench/README.md`` has both). The final fit, and
SMS's fold fits, are solved to optimality by the solver of
:class:`calibrators.solvers.penalised.PenalisedSoftmax` (L-BFGS-B in variables whitened
by per-class curvature blocks: diagonal + rank-1 for a full ``W``, exact 2 x 2 blocks
of ``(w_i, b_i)`` for a diagonal one). Only the ranking of the candidates matters in
the search, so its fits run on float32 copies of the features, SMS's to a looser
tolerance (``CV_TOL``), SVS's as two Newton steps in those 2 x 2 blocks from the
fold's previous fit, the last one not evaluated (``SEARCH_STEPS``: one evaluation per
fold and candidate); the final fit is float64, to
``tol``, its evaluations split over the threads by rows (:class:`_RowSplit`); for
SMS it starts from the float32 problem's solution to ``PRESOLVE_TOL`` (most of the
iterations at a third of the cost; the float64 stage then ends at the same optimum). The
folds are a fixed permutation of the rows (``FOLD_SEED``): a fit is deterministic.

SVS is linear in K per row, so it must fit language-model vocabularies (K =
262,144) without an N x K copy: above ``HELD_ELEMENTS`` features its fit never
holds them, but recomputes them from the scores one row chunk at a time on every
pass (:class:`FeatureRows`), and sums the loss, gradient and curvature over the
chunks (:class:`_ChunkedDiagonal`): the same problem and solver, memory for a few
chunks per thread and the ``O(K)`` solver state, independent of N.

References
----------
Berta, Holzmüller, Jordan, Bach. "Structured Matrix Scaling for Multi-Class
Calibration", arXiv:2511.03685, 2025.
"""

from __future__ import annotations

import copy
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from calibrators.base import Calibrator, Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes, lbfgs_bytes
from calibrators.linear_softmax import WEIGHT_SHAPES
from calibrators.methods.temperature import TemperatureScaler
from calibrators.numerics import (
    log_softmax,
    map_chunks,
    n_threads,
    row_chunks,
    single_threaded_blas,
    softmax_terms,
)
from calibrators.options import Integer, Positive, check_grid
from calibrators.solvers.crossval import cross_validate_path, fold_assignment
from calibrators.solvers.penalised import DAMPING, PenalisedSoftmax
from calibrators.validation import MAX_FOLDS, MAX_ITERATIONS, CalibrationInputError, logits64

if TYPE_CHECKING:  # ONNX is imported by to_onnx only, not with the package
    from calibrators.onnx_export import GraphBuilder

#: Default multipliers of the paper's penalty rule tried by the search, strongest first
#: (sms's; svs declares its own, :data:`calibrators.methods.svs.SVS_GRID`).
DEFAULT_GRID = (4.0, 1.0, 0.25, 1 / 16, 1 / 64, 1 / 256)
#: L-BFGS tolerance inside the search (only the ranking of candidates matters; the
#: search runs in float32, its whitening on at most CV_BLOCK_ROWS rows).
CV_TOL = 1e-3
#: Inside the search, the whitening's curvature is estimated on at most this many rows.
CV_BLOCK_ROWS = 1024
#: The walk along the grid stops at the first candidate worse than the best by more
#: than NOISE standard errors of the paired per-row difference
#: (:func:`calibrators.solvers.crossval.cross_validate_path`; a rule that stopped at any rise
#: stopped sms at the strongest multiplier on one of five CIFAR-100 splits: 0.959
#: held-out NLL against 0.885-0.936 on the others).
PATIENCE = 1
NOISE = 1.0
#: Folds the SMS search fits and scores (the first ones; at most ``n_folds``).
SMS_SCORED_FOLDS = 2
#: The final fit's whitening is estimated on at most this many rows (its evaluations
#: run on every thread, the whitening on one).
FINAL_BLOCK_ROWS = 2048
#: SMS's final fit first solves the float32 problem to this tolerance, then the
#: float64 one from there (None: float64 only; ``bench/README.md`` has the figures).
PRESOLVE_TOL = 1e-6
#: Tolerance of the preprocessing's temperature scaling (its relative gradient): the
#: float64 pass that meets it is followed by a Halley step without another pass
#: (cubic convergence: its error is about the cube of the gradient's), so beta is
#: temperature scaling's answer at its default tolerance, 1e-10, to the last bit or
#: one ulp on the 10 shared splits, for one float64 pass over the scores fewer.
TEMPERATURE_TOL = 1e-6
#: Seed of the fold permutation.
FOLD_SEED = 0
#: Whitening of :meth:`calibrators.solvers.penalised.PenalisedSoftmax.solve`: diagonal + rank-1
#: curvature blocks for a full W at any K (the penalty keeps them close to the
#: exact blocks, for a fraction of their cost), 2 x 2 blocks for a diagonal W.
SOLVER = {"block_classes": 0, "diagonal_blocks": True}
#: Inside svs's search each fold's fit is this many Newton steps in the 2 x 2 blocks
#: from where its previous candidate's last evaluation was, the last step not
#: evaluated (:meth:`calibrators.solvers.penalised.PenalisedSoftmax._solve_block_newton`),
#: not an L-BFGS solve to ``CV_TOL``: one evaluation per fold and candidate instead of
#: two, the same choices on the 5-split protocol of both shared files
#: (``bench/README.md``). One step is not enough: from the identity, lenet-5's first
#: candidate is left far from its optimum and 4 of 5 splits choose a weaker penalty.
SEARCH_STEPS = 2
#: SVS holds its features (float64, N x K) up to this many entries (32 MiB); above it
#: every pass recomputes them from the scores one row chunk at a time
#: (:class:`FeatureRows`), so a fit at K = 262,144 needs memory for chunks and
#: O(K) parameters, not for N x K features. SMS always holds them: its K**2
#: parameters outgrow the features long before the features outgrow memory.
HELD_ELEMENTS = 1 << 22
#: The final fit's evaluations run on up to this many parts of the rows at once
#: (:class:`_RowSplit`), each of at least SPLIT_ELEMENTS features (smaller parts
#: cost more in threads than they save): fixed numbers, so that the fitted values
#: do not depend on the machine's thread count.
SPLIT_PARTS = 4
SPLIT_ELEMENTS = 1 << 16
#: svs's loss and gradient are evaluated in row blocks of about this many entries, whose
#: temporaries stay in the CPU's caches: at 5,000 x 100 a float64 evaluation takes a
#: quarter less time than in one pass over all rows, a float32 one a fifth less.
BLOCK_ELEMENTS = 1 << 17
#: Penalty options and the parts of the penalty they weigh.
#: :class:`_Problem` skips the row-maximum shift of the softmax while every logit is
#: provably within this bound (exp(60) times K stays far from float32's overflow,
#: exp(-60) far above its subnormals).
EXP_BOUND = 60.0
PARTS = {"reg_off_diagonal": "off", "reg_diagonal": "diag", "reg_intercept": "bias"}


def structured_features(z: np.ndarray, beta: float, smoothing: float, *,
                        overwrite: bool = False) -> np.ndarray:
    """The preprocessed features ``log((softmax(beta z) + c) / (1 + K c))``.

    Parameters
    ----------
    z : ndarray of shape (n_rows, n_classes), float64
        Logits.
    beta : float
        Inverse temperature.
    smoothing : float
        ``c > 0``, added to every probability before the log.
    overwrite : bool, default False
        Compute in the memory of ``z`` (no temporary of its size).

    Returns
    -------
    ndarray of shape (n_rows, n_classes), float64
        Log-probabilities of the smoothed distribution, each in
        ``[log(c / (1 + K c)), 0]``.

    Examples
    --------
    >>> x = structured_features(np.array([[0.0, 0.0, 1000.0]]), 1.0, 0.01)
    >>> float(np.exp(x).sum().round(12)), float(x.min().round(4))  # log(0.01 / 1.03)
    (1.0, -4.6347)
    """
    if overwrite:
        z *= beta
        x = z
    else:
        x = beta * z
    x -= x.max(axis=1, keepdims=True)
    np.exp(x, out=x)
    # the softmax's row sums as a matrix-vector product, its division as a product
    x *= (1.0 / (x @ np.ones(x.shape[1], x.dtype)))[:, None]
    x += smoothing
    np.log(x, out=x)
    x -= math.log1p(z.shape[1] * smoothing)
    return x


class FeatureRows:
    """The features of some rows of the scores, computed one row chunk at a time.

    Stands where an (n_rows, K) array of :func:`structured_features` would, for
    the fits that must not hold one (:data:`HELD_ELEMENTS`): indexing rows gives
    another :class:`FeatureRows` (an index array, no copy of the scores), and
    :meth:`sum` adds up a function of the features of consecutive row chunks,
    each computed from the scores when it is needed and dropped after.

    Parameters
    ----------
    z : ndarray of shape (N, K)
        Validated scores (any float dtype; a memmap is read chunk by chunk).
    kind : {"logits", "probabilities"}
    beta, smoothing : float
        The preprocessing (:func:`structured_features`).
    rows : ndarray of shape (n_rows,), int, optional
        The rows of ``z`` these features are of (default: all, in order).
    dtype : numpy dtype, default float64
        The dtype of the feature chunks; float32 chunks of float32 logits are
        computed in float32 (the search's: only its ranking matters).
    log_norm : ndarray of shape (N,), optional
        ``logsumexp(beta z_n)`` of every row of ``z``; computed (one pass) when not
        given, then shared by the row subsets, so that each chunk's features are
        ``log(exp(beta z - log_norm) + c) - log(1 + K c)``: one exp and one log per
        entry, no row maximum or sum.
    """

    def __init__(self, z, kind: str, beta: float, smoothing: float, rows=None,
                 dtype=np.float64, log_norm=None):
        self.z, self.kind, self.beta, self.smoothing = z, kind, beta, smoothing
        self.rows, self.dtype = rows, np.dtype(dtype)
        self.shape = (z.shape[0] if rows is None else len(rows), z.shape[1])
        if log_norm is None:
            log_norm = np.empty(z.shape[0])
            for chunk in row_chunks(*z.shape):
                u = logits64(z[chunk], kind)
                u *= beta
                _, row_max, log_total = softmax_terms(u, overwrite=True)
                log_norm[chunk] = row_max + log_total
        self.log_norm = log_norm
        self.log_scale = math.log1p(z.shape[1] * smoothing)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> FeatureRows:
        local = np.arange(self.shape[0])[key]
        rows = local if self.rows is None else self.rows[local]
        return FeatureRows(self.z, self.kind, self.beta, self.smoothing, rows, self.dtype,
                           self.log_norm)

    def astype(self, dtype) -> FeatureRows:
        return FeatureRows(self.z, self.kind, self.beta, self.smoothing, self.rows, dtype,
                           self.log_norm)

    def block(self, rows: slice) -> np.ndarray:
        """The features of rows ``rows`` (positions in these rows), shape (n, K)."""
        index = rows if self.rows is None else self.rows[rows]
        z = self.z[index]
        if self.kind == "logits" and self.dtype == np.float32:
            x = np.multiply(z, np.float32(self.beta), dtype=np.float32)
        else:
            x = logits64(z, self.kind)
            x *= self.beta
            x = x.astype(self.dtype, copy=False)
        x -= self.log_norm[index, None].astype(x.dtype)
        np.exp(x, out=x)
        x += x.dtype.type(self.smoothing)
        np.log(x, out=x)
        x -= x.dtype.type(self.log_scale)
        return x

    def sum(self, fn) -> np.ndarray:
        """``sum(fn(rows, self.block(rows)) for rows in row chunks)``, ``fn`` returning
        float64 arrays of one shape: each of ``n_threads()`` threads adds up every
        ``n_threads()``-th chunk as it goes, so only one chunk and one running total
        per thread are alive (a list of per-chunk results would be N / rows-per-chunk
        arrays of the result's size: gigabytes at K = 262,144)."""
        slices = list(row_chunks(*self.shape))
        workers = min(n_threads(), len(slices))

        def run(group):
            total = None
            for rows in group:
                part = fn(rows, self.block(rows))
                total = part if total is None else np.add(total, part, out=total)
            return total

        if workers == 1:
            return run(slices)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return sum(pool.map(run, [slices[i::workers] for i in range(workers)]))


class _ChunkedDiagonal(PenalisedSoftmax):
    """:class:`calibrators.solvers.penalised.PenalisedSoftmax` with a diagonal ``W`` on
    :class:`FeatureRows`: the loss, gradient, curvature blocks and held-out NLL
    summed over row chunks (float64 accumulators), the solvers inherited. The same
    problem as on the held features, to the rounding of the sums."""

    def __init__(self, x: FeatureRows, y: np.ndarray, structure: str, **options):
        if structure != "diagonal":
            raise ValueError(f"chunked features need a diagonal W. Got {structure!r}.")
        super().__init__(x, y, structure, **options)

    def __call__(self, theta: np.ndarray):
        self.evaluations += 1
        w, b = self.unpack(theta)

        def chunk(rows, x):
            y = self.y[rows]
            at = np.arange(len(y))
            u = self.logits(theta, x)
            uy = u[at, y]
            p, row_max, log_total = softmax_terms(u, overwrite=True)
            p[at, y] -= 1.0
            return np.concatenate([[np.sum(log_total - (uy - row_max), dtype=np.float64)],
                                   np.einsum("nk,nk->k", p, x, dtype=np.float64),
                                   p.sum(axis=0, dtype=np.float64)])

        sums = self.x.sum(chunk) / self.n
        loss, gw, gb = float(sums[0]), sums[1 : self.k + 1], sums[self.k + 1 :]
        d = w - 1.0
        loss += self.c_diag * float(d @ d) + self.c_bias * float(b @ b)
        return loss, np.concatenate([gw + 2.0 * self.c_diag * d, gb + 2.0 * self.c_bias * b])

    def diagonal_blocks(self, theta: np.ndarray) -> np.ndarray:
        """As :meth:`PenalisedSoftmax.diagonal_blocks`, from sums over row chunks."""
        x = self.x[:: -(-self.n // self.block_rows)]

        def chunk(rows, xc):
            q = np.exp(log_softmax(self.logits(theta, xc)))
            q *= 1.0 - q
            qx = q * xc
            return np.stack([np.einsum("nk,nk->k", qx, xc, dtype=np.float64),
                             qx.sum(axis=0, dtype=np.float64), q.sum(axis=0, dtype=np.float64),
                             xc.sum(axis=0, dtype=np.float64),
                             np.einsum("nk,nk->k", xc, xc, dtype=np.float64)])

        qxx, qx, q, sx, sxx = x.sum(chunk) / len(x)
        damping = DAMPING * float(q.mean())
        blocks = np.empty((self.k, 2, 2))
        blocks[:, 0, 0] = qxx + 2.0 * self.c_diag + damping * sxx
        blocks[:, 0, 1] = blocks[:, 1, 0] = qx + damping * sx
        blocks[:, 1, 1] = q + 2.0 * self.c_bias + damping
        return blocks

    def nll(self, theta: np.ndarray, x: FeatureRows, y: np.ndarray) -> float:
        def chunk(rows, xc):
            u = log_softmax(self.logits(theta, xc))
            return np.sum(u[np.arange(u.shape[0]), y[rows]], dtype=np.float64, keepdims=True)

        return -float(x.sum(chunk)[0]) / len(x)

    def row_nll(self, theta: np.ndarray, x: FeatureRows, y: np.ndarray) -> np.ndarray:
        out = np.empty(len(x))
        for rows in row_chunks(*x.shape):
            u = log_softmax(self.logits(theta, x.block(rows)))
            out[rows] = -u[np.arange(u.shape[0]), y[rows]]
        return out


class _Problem(PenalisedSoftmax):
    """:class:`calibrators.solvers.penalised.PenalisedSoftmax` on held features, with a leaner
    loss and gradient: the same numbers to rounding, fewer passes over the (N, K)
    logits.

    The features lie in ``[-log((1 + K c) / c), 0]``, so ``|u_nk| <= |b_k| + sum_j
    |W_kj| * xmax`` bounds every logit; while that bound is below ``EXP_BOUND`` the
    exponentials need no row-maximum shift (no overflow, no subnormals, even in
    float32), and the softmax's two normalisations (by the row sum, by N) are one
    product. A diagonal ``W`` (svs) goes further: ``exp(b)`` multiplies K-vectors,
    not the (N, K) array, the labels' parts are constants, and the rows are taken in
    cache-sized blocks (:meth:`_diagonal_data_term`); its held-out NLL and whitening
    share that softmax (:meth:`diagonal_exp`). A full ``W``'s whitening is estimated
    on float32 copies of the curvature rows: it is a change of variables, so its
    rounding moves no optimum, and it costs a third of the float64 one.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, **options):
        super().__init__(x, y, structure, **options)
        self.at = np.arange(self.n)
        self.xmax = max(float(-x.min()), float(x.max())) if self.n else 0.0
        if structure == "diagonal":
            # The labels' part of the mean NLL, mean_n (w_yn x_n,yn + b_yn), and of its
            # gradient do not depend on theta: two K-vectors, once.
            self.label_counts = np.bincount(y, minlength=self.k) / max(self.n, 1)
            self.label_x = np.bincount(y, weights=x[self.at, y], minlength=self.k) / max(
                self.n, 1)
        # (theta, loss, gw, gb): the last data term, and one handed over by retarget
        self.last = self.handed = None
        # (theta, the data part of diagonal_blocks there)
        self.kept_blocks = None

    def retarget(self, keep_start: bool, **penalties) -> _Problem:
        """The same rows (no copy) with other penalty coefficients, for the next
        candidate of the search, warm-started where this problem's solve ended.

        The NLL and its gradient there are this problem's last evaluation: only the
        penalty is new, so that point costs no evaluation. ``keep_start``: the
        penalties have the same shape (off-diagonal to diagonal ratio), so the
        canonical projection is the same and that point is canonical as it is (a
        second projection would only round it differently).
        """
        other = copy.copy(self)
        other.c_off, other.c_diag, other.c_bias = (
            penalties.get(name, 0.0) for name in ("off", "diag", "bias"))
        other.evaluations = 0
        other.last, other.handed = None, self.last if keep_start else None
        return other

    def centre_nll(self, theta: np.ndarray) -> float:
        """By :meth:`data_term`, whose gradient :meth:`retarget` hands over: the
        search's first finite candidate starts at the centre, the identity, which
        is canonical under any penalty."""
        return self.data_term(theta)[0]

    def canonical(self, theta: np.ndarray) -> np.ndarray:
        if self.handed is not None and np.array_equal(theta, self.handed[0]):
            return self.handed[0]
        return super().canonical(theta)

    def __call__(self, theta: np.ndarray):
        if self.handed is not None and theta is self.handed[0]:
            _, loss, gw, gb = self.handed
            self.handed = None
            return self.penalised(theta, loss, gw.copy(), gb.copy())
        return super().__call__(theta)

    def data_term(self, theta: np.ndarray):
        if self.structure == "diagonal":
            loss, gw, gb = self._diagonal_data_term(theta)
        else:
            loss, gw, gb = self._full_data_term(theta)
        self.last = (theta, loss, gw.copy(), gb.copy())
        return loss, gw, gb

    def _full_data_term(self, theta: np.ndarray):
        w, b = self.unpack(theta)
        x, y, n, at = self.x, self.y, self.n, self.at
        u = self.logits(theta, x)
        uy = u[at, y]
        if float(np.max(np.abs(b) + np.abs(w).sum(axis=1) * self.xmax)) < EXP_BOUND:
            np.exp(u, out=u)
            total = u.sum(axis=1)
            loss = float(np.mean(np.log(total) - uy))
        else:
            row_max = u.max(axis=1)
            u -= row_max[:, None]
            np.exp(u, out=u)
            total = u.sum(axis=1)
            loss = float(np.mean(np.log(total) - (uy - row_max)))
        u *= (1.0 / (n * total))[:, None]  # now (softmax(u) - 0) / N
        u[at, y] -= u.dtype.type(1.0 / n)
        return loss, u.T @ x, u.sum(axis=0)

    def _diagonal_data_term(self, theta: np.ndarray):
        """Three passes over each block of ``BLOCK_ELEMENTS`` (``w x``, its exp, its
        product with ``x``); the sums are matrix-vector products, the labels' parts
        constants."""
        w, b = self.unpack(theta)
        log_total, ge, gex = 0.0, np.zeros(self.k), np.zeros(self.k)
        for rows in row_chunks(self.n, self.k, BLOCK_ELEMENTS):
            x = self.x[rows]
            e, c, shift = self.diagonal_exp(theta, x, self.xmax)
            total = e @ c  # row sums of exp(u - m)
            log_total += float(np.sum(np.log(total) + shift, dtype=np.float64))
            s = (1.0 / (self.n * total)).astype(e.dtype)  # softmax(u) / N = e * c * s
            ge += s @ e
            e *= x
            gex += s @ e
        loss = log_total / self.n - float(w @ self.label_x + b @ self.label_counts)
        return loss, c * gex - self.label_x, c * ge - self.label_counts

    def diagonal_exp(self, theta: np.ndarray, x: np.ndarray, xmax: float):
        """``exp(u - m)`` of a diagonal ``W``'s logits ``u = w x + b`` on rows ``x``
        (features within ``[-xmax, xmax]``) as ``e * c``: ``(e, c, m)``, ``e`` of
        shape (n_rows, K) and ``c`` (K,) in ``x``'s dtype.

        While every logit is within ``EXP_BOUND`` (see the class docstring), ``m =
        0``, ``e = exp(w x)`` and ``c = exp(b)``: the bias is never added to the
        (n_rows, K) array, only folded into its products with K-vectors. Else ``m``
        is each row's maximum, ``e = exp(u - m)`` and ``c = 1``.
        """
        w, b = self.unpack(theta)
        if float(np.max(np.abs(b) + np.abs(w) * xmax)) < EXP_BOUND:
            e = x * w.astype(x.dtype)
            np.exp(e, out=e)
            return e, np.exp(b).astype(x.dtype), 0.0
        e = self.logits(theta, x)
        shift = e.max(axis=1)
        e -= shift[:, None]
        np.exp(e, out=e)
        return e, np.ones(self.k, x.dtype), shift

    def row_nll(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """As :meth:`PenalisedSoftmax.row_nll`; for a diagonal ``W`` by
        :meth:`diagonal_exp`, with one (n_rows, K) temporary."""
        if self.structure == "full":
            return super().row_nll(theta, x, y)
        w, b = self.unpack(theta)
        xmax = max(float(-x.min()), float(x.max())) if len(x) else 0.0
        e, c, shift = self.diagonal_exp(theta, x, xmax)
        xy = x[np.arange(len(y)), y].astype(np.float64)
        return np.log((e @ c).astype(np.float64)) + shift - (xy * w[y] + b[y])

    @cached_property
    def moments(self):
        """The curvature rows (contiguous) and their unweighted moments ``mean_n
        x_nk**2`` and ``mean_n x_nk``: the same for every candidate of the search
        (:meth:`retarget` copies them)."""
        x = np.ascontiguousarray(super().curvature_rows())
        return x, np.einsum("nk,nk->k", x, x, dtype=np.float64) / len(x), x.mean(
            axis=0, dtype=np.float64)

    def diagonal_blocks(self, theta: np.ndarray) -> np.ndarray:
        """:meth:`PenalisedSoftmax.diagonal_blocks`, the softmax by
        :meth:`diagonal_exp`, the unweighted moments from :attr:`moments`, the
        weighted ones summed in the features' dtype (a change of variables: its
        rounding moves no optimum).

        The blocks' data part at the last ``theta`` is kept (and copied by
        :meth:`retarget`): svs's search asks for it again at the start of the fold's
        next candidate, where only the penalty is new
        (:meth:`calibrators.solvers.penalised.PenalisedSoftmax._solve_block_newton`
        computes the blocks where each step starts, and the next candidate starts
        where the last, unevaluated, step started)."""
        kept = self.kept_blocks
        if kept is not None and np.array_equal(kept[0], theta):
            blocks = kept[1].copy()
        else:
            x, sxx, sx = self.moments
            q, c, _ = self.diagonal_exp(theta, x, self.xmax)
            total = q @ c
            q *= c
            q /= total[:, None]  # now p
            q -= q * q  # p (1 - p)
            mean = np.full(len(x), 1.0 / len(x), dtype=q.dtype)
            q_mean = mean @ q
            damping = DAMPING * float(q_mean.mean())
            qx = q * x
            blocks = np.empty((self.k, 2, 2))
            blocks[:, 0, 0] = mean @ (qx * x) + damping * sxx
            blocks[:, 0, 1] = blocks[:, 1, 0] = mean @ qx + damping * sx
            blocks[:, 1, 1] = q_mean + damping
            self.kept_blocks = (theta.copy(), blocks.copy())
        blocks[:, 0, 0] += 2.0 * self.c_diag
        blocks[:, 1, 1] += 2.0 * self.c_bias
        return blocks

    def curvature_rows(self) -> np.ndarray:
        rows = super().curvature_rows()
        return rows.astype(np.float32) if self.structure == "full" else rows


class _RowSplit(_Problem):
    """:class:`_Problem` whose loss and gradient are evaluated on parts of the rows
    at once, on up to ``n_threads()`` threads.

    ``min(SPLIT_PARTS, N K // SPLIT_ELEMENTS)`` consecutive parts, each the same problem
    on its rows (views, no copies). With weights ``n_i / N`` their mean NLLs and
    gradients average to the whole problem's; the penalty is added once. The
    solvers and the whitening are inherited. For the final fit, whose evaluations
    would otherwise be one thread's work while the search's folds use every thread.
    Inside :meth:`threads` the parts share one pool of threads (else one per
    evaluation).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, structure: str, **options):
        super().__init__(x, y, structure, **options)
        parts = max(1, min(SPLIT_PARTS, self.n * self.k // SPLIT_ELEMENTS))
        bounds = np.linspace(0, self.n, parts + 1)
        bounds = bounds.astype(int)
        self.parts = [
            (_Problem(x[a:b], y[a:b], structure, **options), (b - a) / self.n)
            for a, b in pairwise(bounds)
        ]
        self.pool = None

    @contextmanager
    def threads(self):
        """Evaluations inside share one pool of ``min(parts, n_threads())`` threads."""
        workers = min(len(self.parts), n_threads())
        if workers == 1:
            yield self
            return
        with ThreadPoolExecutor(max_workers=workers) as pool:
            self.pool = pool
            try:
                yield self
            finally:
                self.pool = None

    def data_term(self, theta: np.ndarray):
        if len(self.parts) == 1:
            return super().data_term(theta)
        workers = min(len(self.parts), n_threads())
        if workers == 1:
            results = [part.data_term(theta) for part, _ in self.parts]
        elif self.pool is not None:
            results = list(self.pool.map(lambda part: part[0].data_term(theta), self.parts))
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                results = list(pool.map(lambda part: part[0].data_term(theta), self.parts))
        weights = [w for _, w in self.parts]
        return tuple(sum(w * r[i] for w, r in zip(weights, results, strict=True))
                     for i in range(3))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _coefficients(n: int, k: int, multipliers: dict[str, float]) -> dict[str, float]:
    """Penalty part -> coefficient per squared entry: the multiplier times the paper's
    rule for ``n`` rows and ``k`` classes."""
    scale = {"off": k * (k - 1) / n, "diag": k / n, "bias": k / n}
    return {part: m * scale[part] for part, m in multipliers.items()}


class StructuredScaler(Calibrator):
    """Shared fit of SVS and SMS (see the module docstring).

    Parameters
    ----------
    reg_off_diagonal : float, optional
        Multiplier ``lam_o`` of the off-diagonal penalty (SMS only), 0 or more;
        chosen by cross-validation when None.
    reg_diagonal : float, optional
        Multiplier ``lam_d`` of the penalty on ``W_ii - 1``; as above.
    reg_intercept : float, optional
        Multiplier ``lam_b`` of the bias penalty; as above.
    grid : sequence of float, default=DEFAULT_GRID
        Candidate multipliers for the cross-validation (stored sorted, strongest
        first, without repeats).
    n_folds : int, default=4
        Folds of the search: each fit is on ``(n_folds - 1) / n_folds`` of the rows
        (``n_folds`` fits per candidate; ``min(n_folds, SMS_SCORED_FOLDS)`` for SMS);
        2 to 1,000 (``MAX_FOLDS``).
    max_iter : int, default=1000
        L-BFGS iterations per fit; 1 to 1,000,000 (``MAX_ITERATIONS``).
    tol : float, default=1e-9
        L-BFGS tolerance of the final fit on the relative loss decrease and the
        (whitened) projected gradient.

    Attributes
    ----------
    beta_ : float
        Inverse temperature of the preprocessing.
    smoothing_ : float
        ``c`` of the preprocessing, ``1 / (N K)`` with N the fitted rows.
    weight_ : ndarray of shape (K,) (SVS) or (K, K) (SMS)
    bias_ : ndarray of shape (K,)
    fit_info_ : dict
        The multipliers used, the penalty coefficients, the search's candidates
        and CV NLL, how the final fit converged (``float32_iterations``: those of
        SMS's float32 first stage, ``PRESOLVE_TOL``; None for SVS), and
        ``features``: "held" (an N x K array) or "chunked" (:class:`FeatureRows`,
        SVS above ``HELD_ELEMENTS``).
    """

    structure: ClassVar[str]
    option_checks: ClassVar[dict] = {
        "reg_off_diagonal": Positive(allow_zero=True, allow_none=True),
        "reg_diagonal": Positive(allow_zero=True, allow_none=True),
        "reg_intercept": Positive(allow_zero=True, allow_none=True),
        "grid": check_grid,
        "n_folds": Integer(2, MAX_FOLDS),
        "max_iter": Integer(1, MAX_ITERATIONS),
        "tol": Positive(),
    }
    onnx_graph_name = "structured_scaling"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.fitted_arrays = {
            "beta": (),
            "smoothing": (),
            "weight": WEIGHT_SHAPES[cls.structure],
            "bias": ("n_classes",),
        }

    def __init__(
        self,
        *,
        reg_off_diagonal: float | None = None,
        reg_diagonal: float | None = None,
        reg_intercept: float | None = None,
        grid=DEFAULT_GRID,
        n_folds: int = 4,
        max_iter: int = 1000,
        tol: float = 1e-9,
    ):
        self.reg_off_diagonal = reg_off_diagonal
        self.reg_diagonal = reg_diagonal
        self.reg_intercept = reg_intercept
        self.grid = grid
        self.n_folds = n_folds
        self.max_iter = max_iter
        self.tol = tol

    # -- the map -----------------------------------------------------------
    def _forward(self, z: np.ndarray) -> np.ndarray:
        x = structured_features(z, self.beta_, self.smoothing_)
        if self.structure == "diagonal":
            return x * self.weight_ + self.bias_
        return x @ self.weight_.T + self.bias_

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        from calibrators.onnx_export import linear_subgraph

        k = graph.n_classes
        bz = graph.node("Mul", [z, graph.constant(self.beta_, "beta")], "beta_z")
        p = graph.node("Softmax", [bz], "tempered", axis=1)
        pc = graph.node("Add", [p, graph.constant(self.smoothing_, "smoothing")], "smoothed")
        logp = graph.node("Log", [pc], "log_smoothed")
        norm = graph.constant(math.log1p(k * self.smoothing_), "log_normaliser")
        x = graph.node("Sub", [logp, norm], "features")
        return linear_subgraph(graph, x, weight=self.weight_, bias=self.bias_, feature="logits")

    def _load_params(self, params) -> None:
        super()._load_params(params)
        for name in ("beta", "smoothing"):
            value = getattr(self, f"{name}_")
            if not value > 0:
                raise CalibrationInputError(f"params {name} must be > 0. Got {value!r}.")

    # -- fitting -------------------------------------------------------------
    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: the features, the folds, the solver's state.

        ``P`` parameters (``2 K`` for SVS, ``K**2 + K`` for SMS); ``F`` folds, of
        which ``G`` are fitted per candidate (:meth:`_scored_folds`), ``T = min(G,
        n_threads())`` of them at once; ``C = len(grid)`` candidates
        when a multiplier is searched, else 0; ``b = min(N, FINAL_BLOCK_ROWS)``. The
        solver holds ``S = 2 lbfgs_bytes(P, 20) + 8 * 30 P + B``: two L-BFGS-B
        workspaces, parameter-sized temporaries and the whitening ``B``:
        ``8 (6 K (K + 1) + 4 b (K + 1))`` for SMS (diagonal + rank-1 factors),
        ``8 * 3 min(b K, E)`` for SVS (the temporaries of its 2 x 2 blocks), with
        ``E = HELD_ELEMENTS`` for SVS (infinite for SMS) and ``M = min(N K, E)``.

        * held features (SMS; SVS with ``N K <= E``): ``temperature + 8 M + 4 M' +
          max(2 * 8 M + S, search) + 8 G C P + chunk_bytes(1, K, threads=1)``: the
          temperature fit's chunks, the features, their float32 copy (``M' = M`` for
          SMS or a search, else 0), the final fit's logits and softmax or ``search =
          8 M G + T (2 * 8 M (F - 1) / F + S)`` when searching (the scored folds' row
          copies, kept along the path, and a fit's temporaries per thread), the fold
          solutions of the candidates, a chunk of slack.
        * chunked features (SVS with ``N K > E``): ``temperature + 8 N (F + 7) +
          T (S + chunk_bytes(8, K) + 8 * 5 K n_threads()) + 8 G C P``: per-row
          labels, folds, row indices and log-normalisers; per fold in flight the solver and, per
          thread, eight float64 temporaries of a row chunk (scores, logits,
          features, logits of the model, curvature weights) and a running sum of
          five K-vectors; the fold solutions. No term in ``N K``: at K = 262,144 it
          is the ``O(K)`` solver state and a few one-row chunks per thread.
        * bytes = the first with held features; with chunked ones the larger of the
          two (the first capped at ``M = E``), so that the model never decreases
          in N or K across ``E``.
        * flops = ``30 (1 + C G / 2) (4 N K**2 + SWEEP_FLOPS N K)`` for SMS
          (without ``4 N K**2`` for SVS, and ``3 SWEEP_FLOPS N K`` per evaluation
          with chunked features, which are recomputed each time): tens of
          evaluations per whitened solve, about half as many for a warm-started fold.
        """
        n, k = n_samples, n_classes
        full = cls.structure == "full"
        params = k * k + k if full else 2 * k
        folds = options["n_folds"]
        scored = cls._scored_folds(folds)
        searched = any(
            options[name] is None for name, part in PARTS.items() if full or part != "off"
        )
        candidates = len(options["grid"]) if searched else 0
        rows = min(n, FINAL_BLOCK_ROWS)
        held = n * k if full else min(n * k, HELD_ELEMENTS)
        if full:
            whitening = FLOAT64 * (6 * k * (k + 1) + 4 * rows * (k + 1))
        else:
            whitening = 3 * FLOAT64 * min(rows * k, HELD_ELEMENTS)
        solver = 2 * lbfgs_bytes(params, 20) + 30 * FLOAT64 * params + whitening
        scores = FLOAT64 * held
        # the scored folds' row copies (kept along the path), a fit's temporaries per thread
        search = scored * scores + min(scored, n_threads()) * (
            2 * scores * (folds - 1) / folds + solver) if candidates else 0
        threads = min(scored, n_threads()) if candidates else 1
        temperature = TemperatureScaler.fit_cost(n, k, TemperatureScaler().checked_options())
        solutions = FLOAT64 * scored * candidates * params
        low = scores / 2 if full or candidates else 0
        memory = temperature.bytes + scores + low + max(
            2 * scores + solver, search
        ) + solutions + chunk_bytes(1, n_classes=k, threads=1)
        evaluation = (4.0 * n * k * k if full else 0.0) + SWEEP_FLOPS * n * k
        if not full and n * k > HELD_ELEMENTS:
            chunked = temperature.bytes + FLOAT64 * n * (folds + 7) + threads * (
                solver + chunk_bytes(8, n_classes=k) + FLOAT64 * 5 * k * n_threads()
            ) + solutions
            memory = max(memory, chunked)
            evaluation *= 3
        return Cost(bytes=int(memory), flops=temperature.flops
                    + 30.0 * (1 + candidates * scored / 2) * evaluation)

    @classmethod
    def _scored_folds(cls, n_folds: int) -> int:
        """Folds fitted and scored per candidate: all for SVS, at most
        ``SMS_SCORED_FOLDS`` for SMS (see the module docstring)."""
        return min(n_folds, SMS_SCORED_FOLDS) if cls.structure == "full" else n_folds

    def _multipliers(self, options: dict) -> dict[str, float | None]:
        """Penalty part -> multiplier (None: searched); SVS has no off-diagonal part."""
        return {
            part: options[name] for name, part in PARTS.items()
            if self.structure == "full" or part != "off"
        }

    def _problem(self, x: np.ndarray, y: np.ndarray, multipliers: dict[str, float], *,
                 split: bool = False, **options):
        """The penalised problem on rows ``x, y`` (the paper's rule with their N);
        ``split``: evaluated on all threads (:class:`_RowSplit`)."""
        if not isinstance(x, np.ndarray):
            problem = _ChunkedDiagonal
        else:
            problem = _RowSplit if split else _Problem
        return problem(x, y, self.structure, **_coefficients(*x.shape, multipliers), **options)

    def _fit(self, x: np.ndarray, y: np.ndarray, *, kind: str, options: dict,
             progress: Progress) -> dict[str, Any]:
        with single_threaded_blas():
            return self._fit_structured(x, y, kind, options, progress)

    def _fit_structured(self, x, y, kind, opts, progress) -> dict[str, Any]:
        started = time.perf_counter()
        n, k = x.shape
        smoothing = 1.0 / (n * k)
        # Temperature scaling of the scores as given: probabilities are fitted as they
        # are, from beta = 1 (their own calibration), a few passes from the root; the
        # float64 log of probabilities handed over as logits would be rescaled by a
        # power of two and started far from it (8 passes instead of 5 on the CIFAR-100
        # fit half, the same beta to the last bit; 4 with TEMPERATURE_TOL).
        beta = float(TemperatureScaler(tol=TEMPERATURE_TOL).fit(x, y, kind=kind).weight_)
        if self.structure == "full" or n * k <= HELD_ELEMENTS:
            feats = np.empty((n, k))

            def features(rows):
                feats[rows] = logits64(x[rows], kind)
                structured_features(feats[rows], beta, smoothing, overwrite=True)

            map_chunks(features, n, k)
        else:
            feats = FeatureRows(x, kind, beta, smoothing)
        fixed = self._multipliers(opts)
        searched = [part for part, m in fixed.items() if m is None]
        # float32 features: the search's, and SMS's float32 first stage of the final fit
        low = feats.astype(np.float32) if searched or self.structure == "full" else None
        grid = opts["grid"]
        cv, warm, evaluations = [], None, 0
        if searched:
            n_folds = opts["n_folds"]
            if n < 2 * n_folds:
                raise CalibrationInputError(
                    f"cross-validating the penalties needs at least {2 * n_folds} rows; give "
                    f"{', '.join(o for o, p in PARTS.items() if p in searched)} explicitly for "
                    f"tiny sets. Got {n} rows."
                )
            scored = self._scored_folds(n_folds)
            total = len(grid) * scored + 1
            done = [0]

            def tick(fits):
                done[0] += fits
                progress(0.95 * done[0] / total)

            def with_multiplier(m):
                return {part: m if value is None else value for part, value in fixed.items()}

            # The next candidate's fold problem keeps the rows, and the NLL at its start
            # (the last point of the fold's previous fit), when the penalty keeps its shape.
            keep_start = self.structure == "diagonal" or ("off" in searched) == (
                "diag" in searched)

            def retarget(prob, m):
                return prob.retarget(keep_start, **_coefficients(prob.n, prob.k,
                                                                 with_multiplier(m)))

            # With every part searched, the path starts at infinite penalties: the
            # identity on the features, temperature scaling (of the smoothed
            # probabilities), not solved (PenalisedSoftmax.solve).
            path = [math.inf, *grid] if len(searched) == len(fixed) else list(grid)
            scores, solutions, evaluations = cross_validate_path(
                lambda xx, yy, m: self._problem(xx, yy, with_multiplier(m),
                                                block_rows=CV_BLOCK_ROWS),
                low, y, fold_assignment(n, n_folds, FOLD_SEED), path,
                [None] * scored, tick, max_iter=opts["max_iter"], tol=max(opts["tol"], CV_TOL),
                patience=PATIENCE, noise=NOISE, solve_options=SOLVER if self.structure == "full"
                else {**SOLVER, "newton_steps": SEARCH_STEPS},
                retarget=retarget if isinstance(low, np.ndarray) else None,
            )
            best = int(np.argmin(scores))
            multipliers, warm = with_multiplier(path[best]), np.mean(solutions[best], axis=0)
            cv = [{"multiplier": m if math.isfinite(m) else None, "cv_nll": s}
                  for m, s in zip(path[: len(scores)], scores, strict=True)]
        else:
            multipliers = fixed
        prob = self._problem(feats, y, multipliers, split=True, block_rows=FINAL_BLOCK_ROWS)
        start, presolve = prob.initial() if warm is None else warm, None
        with prob.threads() if isinstance(prob, _RowSplit) else nullcontext():
            if self.structure == "full" and PRESOLVE_TOL:
                # Most of the way in float32 (a third of the work per evaluation), the
                # rest in float64 from there: the same optimum, to ``tol``.
                pre = self._problem(low, y, multipliers, split=True,
                                    block_rows=FINAL_BLOCK_ROWS)
                with pre.threads():
                    presolve = pre.solve(start, max_iter=opts["max_iter"],
                                         tol=max(opts["tol"], PRESOLVE_TOL), **SOLVER)
                start = presolve.x
                evaluations += pre.evaluations
            res = prob.solve(start, max_iter=opts["max_iter"], tol=opts["tol"], **SOLVER)
        evaluations += prob.evaluations
        w, b = prob.unpack(res.x)
        self.beta_, self.smoothing_ = beta, smoothing
        self.weight_, self.bias_ = w.copy(), b.copy()
        progress(1.0)
        names = {part: name for name, part in PARTS.items()}
        return {
            "temperature": 1.0 / beta,
            # None: infinite (the search chose the identity, temperature scaling)
            "multipliers": {names[part]: _finite(m) for part, m in multipliers.items()},
            "penalties": {"off_diagonal": _finite(prob.c_off) if self.structure == "full" else None,
                          "diagonal": _finite(prob.c_diag), "intercept": _finite(prob.c_bias)},
            "converged": bool(res.success),
            "message": str(res.message),
            "iterations": int(res.nit),
            "float32_iterations": None if presolve is None else int(presolve.nit),
            "loss": float(res.fun),
            "gradient_max": float(np.max(np.abs(res.jac))),
            "evaluations": evaluations,
            "seconds": time.perf_counter() - started,
            "features": "held" if isinstance(feats, np.ndarray) else "chunked",
            "cross_validation": {
                "n_folds": opts["n_folds"], "scored_folds": self._scored_folds(opts["n_folds"]),
                "candidates": cv,
            } if cv else None,
        }
