"""Intra order-preserving calibration: positive multipliers of the gaps between sorted logits.

Sort a row of logits descending, ``s_1 >= s_2 >= ... >= s_K``. The calibrated
logit of the class at rank ``j`` is the sum of the rescaled gaps below it::

    u_(j) = sum_{i=j}^{k} m_i(s) * (s_i - s_{i+1})          j = 1 .. k + 1
    u_(l) = beta * (s_l - s_{k+1})                           l > k + 1 (the tail)

with ``k = min(n_top, K - 1)`` gaps and multipliers ``m_i(s) > 0``. Every
increment ``m_i * (s_i - s_{i+1})`` is >= 0, and exactly 0 when the two logits
are tied, so ``u`` is ordered like ``z`` by construction: the predicted class
never changes and ties stay ties. Rahimi et al. (2020) show that every
continuous intra order-preserving map has this form. Below rank ``k + 1`` the
logits keep temperature scaling's slope ``beta`` and are shifted with the
``(k + 1)``-th, so the order holds across the boundary too and a row costs
``O(K)`` (a partial sort and one affine map), whatever ``K``.

The multipliers are a one-layer network of the sorted logits with a fixed
first layer and non-negative output weights::

    m_i(s) = beta * (FLOOR + a_i + sum_{f, b} W_{i, f, b} * hat_b(xi_f(s)))
    xi_f(s) = log2(1 + beta * (s_1 - s_{r_f + 1})),  r_f in FEATURE_RANKS (capped at k)
    hat_b(xi) = max(0, 1 - |clip(xi, 0, N_KNOTS - 1) - b|),  b = 0 .. N_KNOTS - 1

* ``beta`` is temperature scaling's inverse temperature, fitted first;
* ``xi_f`` measures how far, in temperature-scaled nats on a log scale, the
  top logit is from the logit at rank ``r_f + 1`` (ranks 2, 3, 5, 9, 17, 33);
* the hat units are a piecewise-linear basis over knots at ``xi = 0, 1, ...,
  7`` (distances of 0, 1, 3, 7, ..., 127 nats): each multiplier is a
  non-negative piecewise-linear function of each distance, summed over them;
* ``a`` (``n_top``) is a multiplier per rank (alone, the "diagonal" model),
  ``W`` (``n_top`` x ``F`` x ``N_KNOTS``) the dependence on the row.

Negative stored entries of ``a`` or ``W`` act as 0, so any stored parameters
give an order-preserving map. With ``a = 1 - FLOOR`` and ``W = 0`` every
multiplier is ``beta`` and the map is exactly temperature scaling: the fit
starts there. The network's output is linear in ``(a, W)`` and the NLL is
convex in the calibrated logits, so the fit is a convex problem: L-BFGS-B with
the bounds ``a, W >= 0``, an analytic gradient, and the penalty::

    (reg_mu * |a - (1 - FLOOR)|^2 + reg_lambda * |W|^2) / n

(a Gaussian prior centred on temperature scaling: ``reg_mu`` pulls the
per-rank multipliers to ``beta``, ``reg_lambda`` pulls away the dependence on
the row). With positive penalties the optimum is unique, and no random start
is needed to find it. A penalty left as
None is chosen by ``n_folds``-fold cross-validation over ``grid`` (both
penalties equal when both are None), walked from the strongest, each fit
warm-started from its neighbour, with temperature scaling itself as the first
candidate: the search keeps temperature scaling unless the network predicts
held-out folds better. ``seed`` only assigns rows to folds.

``n_top`` bounds the work: the fit sorts each row once (``O(n K)``), then each
L-BFGS evaluation costs ``O(n n_top F N_KNOTS)``. The default 32 covers the
ranks where the true class of a misclassified row usually lies (every gap gets
a multiplier when K <= 33); below it the tail keeps temperature scaling, which
costs little NLL while the evaluations stay cheap: ``bench/iop_seeds.py``
measures the choice against 8, 16, 64 and K - 1.

The ONNX graph (:meth:`IntraOrderPreserving.to_onnx`) is the same map: ``TopK``
sorts, ``Gather``/``Log``/``Clip``/``Abs``/``Relu`` make the hat units, a
``MatMul`` the multipliers, ``CumSum`` (reversed) the sums of increments and
``ScatterElements`` puts them back over the tail.

References
----------
Rahimi, Shaban, Cheng, Hartley, Boots. "Intra Order-preserving Functions for
Calibration of Multi-Class Neural Networks", NeurIPS 2020.

Examples
--------
With the starting parameters the map is temperature scaling:

>>> import numpy as np
>>> from calibrators import from_params
>>> cal = from_params({"method": "iop", "n_classes": 4, "beta": 0.5,
...     "rank_scale": [1 - FLOOR] * 32, "weight": np.zeros((32, 6, 8)).tolist()})
>>> cal.predict_proba([[2.0, 0.5, 0.5, -1.0]]).round(4).tolist()
[[0.4613, 0.2179, 0.2179, 0.1029]]
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from scipy.optimize import minimize

from calibrators.base import Calibrator
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes, lbfgs_bytes
from calibrators.methods.temperature import TemperatureScaler
from calibrators.numerics import row_chunks, single_threaded_blas
from calibrators.options import Integer, Positive, check_grid
from calibrators.solvers.crossval import cross_validate_path, fold_assignment
from calibrators.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_FOLDS,
    MAX_ITERATIONS,
    MAX_TOP,
    CalibrationInputError,
    logits64,
)

if TYPE_CHECKING:
    from calibrators.onnx_export import GraphBuilder

#: Ranks r whose distance to the top logit, ``s_1 - s_{r+1}``, the network reads.
FEATURE_RANKS = (1, 2, 4, 8, 16, 32)
#: Hat units per feature, at ``xi = 0 .. N_KNOTS - 1``, i.e. ``2**xi - 1`` nats.
N_KNOTS = 8
#: Every multiplier is at least ``FLOOR * beta``: the order is kept strictly.
FLOOR = 1e-3
#: Penalty candidates (prior precisions), strongest first.
DEFAULT_GRID = (1000.0, 100.0, 10.0, 1.0, 0.1)
#: L-BFGS-B stops when an iteration lowers the loss by less than this fraction
#: (``ftol``), or every projected gradient entry is below ``GTOL``.
DEFAULT_TOL = 1e-10
CV_TOL = 1e-7
GTOL = 1e-8
_INV_LN2 = 1.0 / math.log(2.0)


def _top(z: np.ndarray, n_top: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n_top`` largest entries of each row, descending, and their columns."""
    if n_top < z.shape[1]:
        cut = z.shape[1] - n_top
        part = np.argpartition(z, cut, axis=1)[:, cut:]
        order = np.argsort(-np.take_along_axis(z, part, axis=1), axis=1, kind="stable")
        idx = np.take_along_axis(part, order, axis=1)
    else:
        idx = np.argsort(-z, axis=1, kind="stable")
    return np.take_along_axis(z, idx, axis=1), idx


def _feature_columns(k: int) -> list[int]:
    """Columns of the sorted values (``k + 1`` of them) that the features read."""
    return [min(r, k) for r in FEATURE_RANKS]


def _hats(vals: np.ndarray, beta: float) -> np.ndarray:
    """The hat units of sorted values (n, k + 1): (n, F * N_KNOTS)."""
    k = vals.shape[1] - 1
    xi = np.log(beta * (vals[:, :1] - vals[:, _feature_columns(k)]) + 1.0) * _INV_LN2
    np.clip(xi, 0.0, N_KNOTS - 1.0, out=xi)
    h = 1.0 - np.abs(xi[:, :, None] - np.arange(N_KNOTS, dtype=np.float64))
    return np.maximum(h, 0.0).reshape(vals.shape[0], -1)


def _gaps_below(increments: np.ndarray) -> np.ndarray:
    """``c_j = sum_{i >= j} increments_i``, then a final 0: (n, k) -> (n, k + 1)."""
    c = np.zeros((increments.shape[0], increments.shape[1] + 1))
    np.cumsum(increments[:, ::-1], axis=1, out=c[:, -2::-1])
    return c


class _Rows:
    """What the fit needs of a set of rows, with the sort and the tail done once.

    ``gaps`` (n, k): ``s_i - s_{i+1}``; ``hats`` (n, F * N_KNOTS); ``tail``
    (n,): ``log sum_{l > k+1} exp(beta (s_l - s_{k+1}))`` (-inf without a
    tail); ``rank`` (n,): the label's sorted position in ``0 .. k``, or -1 in
    the tail; ``label_tail`` (n,): the label's calibrated logit in the tail.
    """

    def __init__(self, gaps, hats, tail, rank, label_tail):
        self.gaps, self.hats, self.tail = gaps, hats, tail
        self.rank, self.label_tail = rank, label_tail
        self.n = gaps.shape[0]
        self.labelled = np.flatnonzero(rank >= 0)

    @classmethod
    def build(cls, scores: np.ndarray, y: np.ndarray, kind: str, beta: float, k: int,
              index: np.ndarray | None = None) -> _Rows:
        """The rows ``index`` (default all) of validated scores, one row chunk at a time."""
        index = np.arange(y.shape[0]) if index is None else index
        parts = []
        for chunk in row_chunks(index.shape[0], scores.shape[1]):
            rows = index[chunk]
            z = logits64(scores[rows], kind)
            vals, idx = _top(z, k + 1)
            labels = y[rows]
            hit = idx == labels[:, None]
            in_top = hit.any(axis=1)
            last = vals[:, -1:]
            z -= last
            z *= beta  # the tail's calibrated logits
            label_tail = np.where(in_top, 0.0, z[np.arange(len(labels)), labels])
            np.put_along_axis(z, idx, -np.inf, axis=1)
            np.exp(z, out=z)
            with np.errstate(divide="ignore"):
                tail = np.log(z.sum(axis=1))
            parts.append((vals[:, :-1] - vals[:, 1:], _hats(vals, beta), tail,
                          np.where(in_top, hit.argmax(axis=1), -1), label_tail))
        return cls(*(np.concatenate(p) for p in zip(*parts, strict=True)))

    def subset(self, mask: np.ndarray) -> _Rows:
        return _Rows(self.gaps[mask], self.hats[mask], self.tail[mask], self.rank[mask],
                     self.label_tail[mask])


def _centre(k: int) -> np.ndarray:
    """``theta`` of temperature scaling: ``a = 1 - FLOOR``, ``W = 0``."""
    theta = np.zeros(k * (1 + len(FEATURE_RANKS) * N_KNOTS))
    theta[:k] = 1.0 - FLOOR
    return theta


class _Problem:
    """The penalised mean NLL in ``theta = [a (k), W (k * F * N_KNOTS)]``, and its gradient.

    Arrays are held rank-major, (k, n): the sums over ranks then run across
    contiguous rows of ``n`` numbers.
    """

    def __init__(self, rows: _Rows, beta: float, lam: float = 0.0, mu: float = 0.0):
        self.rows, self.beta, self.lam, self.mu = rows, beta, lam, mu
        self.k = rows.gaps.shape[1]
        self.scaled_gaps = np.ascontiguousarray(beta * rows.gaps.T)  # (k, n)
        self.hats = np.ascontiguousarray(rows.hats.T)  # (F * N_KNOTS, n)
        self.label = (rows.rank[rows.labelled], rows.labelled)
        self.centre = _centre(self.k)
        self.evaluations = 0

    def _terms(self, theta):
        k, r = self.k, self.rows
        inc = theta[k:].reshape(k, -1) @ self.hats
        inc += (theta[:k] + FLOOR)[:, None]
        inc *= self.scaled_gaps
        c = np.zeros((k + 1, r.n))
        for i in range(k - 1, -1, -1):  # a loop over ranks: numpy's cumsum is slower
            np.add(c[i + 1], inc[i], out=c[i])
        top = c[0]  # the largest calibrated logit (the tail's are <= 0 <= c)
        e = np.exp(c - top)
        total = e.sum(axis=0) + np.exp(r.tail - top)
        label = r.label_tail.copy()
        label[self.label[1]] = c[self.label]
        return top + np.log(total) - label, e, total

    def nll(self, theta) -> np.ndarray:
        """The NLL of each row."""
        return self._terms(theta)[0]

    def loss_and_gradient(self, theta):
        self.evaluations += 1
        k, n = self.k, self.rows.n
        nll, e, total = self._terms(theta)
        # d nll / d c_j = p_j - [rank = j], and c_j sums the increments i >= j.
        e /= total
        e[self.label] -= 1.0
        d_m = e[:-1]
        for i in range(1, k):
            d_m[i] += d_m[i - 1]
        d_m *= self.scaled_gaps
        d_m /= n
        d = theta - self.centre
        weights = np.full(theta.shape, self.lam / n)
        weights[:k] = self.mu / n
        grad = np.concatenate([d_m.sum(axis=1), (d_m @ self.hats.T).ravel()])
        grad += 2.0 * weights * d
        return float(nll.mean() + weights @ (d * d)), grad

    def solve(self, start, *, max_iter: int, tol: float):
        return minimize(
            self.loss_and_gradient, start, jac=True, method="L-BFGS-B",
            bounds=[(0.0, None)] * start.shape[0],
            options={"maxiter": max_iter, "ftol": tol, "gtol": GTOL, "maxcor": 20},
        )


class IntraOrderPreserving(Calibrator):
    """Intra order-preserving calibration: sorted-logit gaps rescaled by a small network.

    See :mod:`calibrators.methods.iop` for the map and the fit.

    Parameters
    ----------
    n_top : int, default=32
        The gaps between the ``n_top + 1`` largest logits get their own
        multipliers; the logits below keep temperature scaling's slope. 1 to
        1,048,576 (``MAX_TOP``; at most ``K - 1`` are used).
    reg_lambda : float, optional
        Penalty weight of the dependence on the row (``W``), 0 or more; chosen
        by cross-validation when None.
    reg_mu : float, optional
        Penalty weight of the per-rank multipliers (``a``), 0 or more; chosen
        by cross-validation when None.
    grid : sequence of float, default=DEFAULT_GRID
        Candidate penalty weights for the cross-validation (stored sorted,
        strongest first, without repeats).
    n_folds : int, default=3
        2 to 1,000 (``MAX_FOLDS``).
    seed : int, default=0
        Seed of the assignment of rows to folds (an int64; >= 0 when a penalty is
        cross-validated).
    max_iter : int, default=2000
        L-BFGS-B iterations per fit; 1 to 1,000,000 (``MAX_ITERATIONS``).
    tol : float, default=1e-10
        L-BFGS-B's ``ftol`` in the final fit.

    Attributes
    ----------
    beta_ : float
        Temperature scaling's inverse temperature.
    rank_scale_ : ndarray of shape (n_top,)
        ``a``; entries past ``K - 1`` are unused.
    weight_ : ndarray of shape (n_top, len(FEATURE_RANKS), N_KNOTS)
        ``W``; rows past ``K - 1`` are unused.
    fit_info_ : dict
        The chosen penalties (None for both when temperature scaling won),
        the cross-validation's candidates and NLLs, iterations, loss, timing.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> y = rng.integers(0, 5, 300)
    >>> z = 3.0 * rng.normal(size=(300, 5))
    >>> z[np.arange(300), y] += 3.0
    >>> cal = IntraOrderPreserving(reg_lambda=10.0, reg_mu=10.0).fit(z, y)
    >>> bool((cal.predict_proba(z).argmax(axis=1) == z.argmax(axis=1)).all())
    True
    """

    method = "iop"
    preserves_argmax = True
    onnx_graph_name = "intra_order_preserving"
    option_checks: ClassVar[dict] = {
        "n_top": Integer(1, MAX_TOP),
        "reg_lambda": Positive(allow_zero=True, allow_none=True),
        "reg_mu": Positive(allow_zero=True, allow_none=True),
        "grid": check_grid,
        "n_folds": Integer(2, MAX_FOLDS),
        "seed": Integer(INT64_MIN, INT64_MAX),
        "max_iter": Integer(1, MAX_ITERATIONS),
        "tol": Positive(),
    }
    fitted_arrays: ClassVar[dict] = {
        "beta": (),
        "rank_scale": ("n_top",),
        "weight": ("n_top", len(FEATURE_RANKS), N_KNOTS),
    }

    def __init__(
        self,
        *,
        n_top: int = 32,
        reg_lambda: float | None = None,
        reg_mu: float | None = None,
        grid=DEFAULT_GRID,
        n_folds: int = 3,
        seed: int = 0,
        max_iter: int = 2000,
        tol: float = DEFAULT_TOL,
    ):
        self.n_top = n_top
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        self.grid = grid
        self.n_folds = n_folds
        self.seed = seed
        self.max_iter = max_iter
        self.tol = tol

    def checked_options(self) -> dict:
        options = super().checked_options()
        searched = options["reg_lambda"] is None or options["reg_mu"] is None
        if searched and options["seed"] < 0:
            raise CalibrationInputError(
                "seed must be an integer >= 0 when a penalty is chosen by cross-validation "
                f"(reg_lambda or reg_mu None). Got {options['seed']!r}."
            )
        return options

    def _load_params(self, params: Mapping[str, Any]) -> None:
        super()._load_params(params)
        if not self.beta_ > 0:
            raise CalibrationInputError(f"params beta for iop must be > 0. Got {self.beta_!r}.")

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: one pass over the scores in row chunks, then O(N k).

        With ``k = min(n_top, K - 1)`` gaps, ``P = len(FEATURE_RANKS) * N_KNOTS``
        hat units, ``f = n_folds`` and ``c`` candidate penalties (``len(grid)``
        when a penalty is searched, else 1 and no folds):

        * bytes = the larger of temperature scaling's (fitted first) and
          ``chunk_bytes(4, K, threads=1)`` (a float64 row chunk, its partition,
          a copy of it for probabilities) ``+ 8 N (k + P + 4) (3 + 2 f)`` (the
          sorted rows' gaps, hat units and tail, and their row-major and
          rank-major copies in every fold) ``+ 48 N (k + 1)`` (one evaluation's
          temporaries) ``+ 2 lbfgs_bytes(k (P + 1), 20)``;
        * flops = temperature scaling's ``+ SWEEP_FLOPS * N K * 2`` (the sort)
          ``+ 100 (f c + 1) * 4 N k P``: about 100 L-BFGS evaluations per fit,
          each two products of (k, P) by (P, N).
        """
        n, k = n_samples, min(options["n_top"], n_classes - 1)
        p = len(FEATURE_RANKS) * N_KNOTS
        searched = options["reg_lambda"] is None or options["reg_mu"] is None
        folds = options["n_folds"] if searched else 0
        fits = folds * len(options["grid"]) + 1
        own = (chunk_bytes(4, n_classes=n_classes, threads=1)
               + FLOAT64 * n * (k + p + 4) * (3 + 2 * folds)
               + 6 * FLOAT64 * n * (k + 1)
               + 2 * lbfgs_bytes(k * (p + 1), 20))
        first = TemperatureScaler.fit_cost(n, n_classes, TemperatureScaler().checked_options())
        return Cost(
            bytes=max(own, first.bytes),
            flops=first.flops + float(SWEEP_FLOPS) * n * n_classes * 2
            + 100.0 * fits * 4 * n * k * p,
        )

    # -- the map -----------------------------------------------------------
    def _weights(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``a + FLOOR`` (k,) and ``W`` as (F * N_KNOTS, k), negative entries read as 0."""
        a = np.maximum(self.rank_scale_[:k], 0.0) + FLOOR
        w = np.maximum(self.weight_[:k], 0.0).reshape(k, -1).T
        return a, np.ascontiguousarray(w)

    def _forward(self, z: np.ndarray) -> np.ndarray:
        k = min(self.rank_scale_.shape[0], z.shape[1] - 1)
        a, w = self._weights(k)
        vals, idx = _top(z, k + 1)
        inc = _hats(vals, self.beta_) @ w
        inc += a
        inc *= self.beta_
        inc *= vals[:, :-1] - vals[:, 1:]
        u = self.beta_ * (z - vals[:, -1:])
        np.put_along_axis(u, idx, _gaps_below(inc), axis=1)
        return u

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        from onnx import helper

        g = graph
        k = min(self.rank_scale_.shape[0], g.n_classes - 1)
        a, w = self._weights(k)

        def ints(values, hint):
            return g.constant(np.array(values, dtype=np.int64), hint)

        axis = ints([1], "iop_axis")
        first, second, end, after = (ints([i], f"iop_{i}") for i in (0, 1, k, k + 1))
        vals, idx = g.name("sorted"), g.name("sorted_index")
        g.nodes.append(helper.make_node("TopK", [z, after], [vals, idx], axis=1, largest=1,
                                        sorted=1))
        top = g.node("Slice", [vals, first, second, axis], "s_top")
        last = g.node("Slice", [vals, end, after, axis], "s_last")
        gaps = g.node("Sub", [g.node("Slice", [vals, first, end, axis], "s_head"),
                              g.node("Slice", [vals, second, after, axis], "s_rest")], "gaps")
        beta = g.constant(self.beta_, "iop_beta")
        # the hat units: xi = log2(1 + beta (s_1 - s_{r+1})), clipped, against the knots
        ranked = g.node("Gather", [vals, ints(_feature_columns(k), "feature_columns")],
                        "feature_values", axis=1)
        dist = g.node("Mul", [g.node("Sub", [top, ranked], "distance"), beta], "scaled_distance")
        one = g.constant(1.0, "iop_one")
        log1p = g.node("Log", [g.node("Add", [dist, one], "one_plus")], "log_one_plus")
        xi = g.node("Clip", [g.node("Mul", [log1p, g.constant(_INV_LN2, "inv_ln2")], "xi_raw"),
                             g.constant(0.0, "xi_min"), g.constant(N_KNOTS - 1.0, "xi_max")], "xi")
        offset = g.node("Sub", [g.node("Unsqueeze", [xi, ints([2], "knot_axis")], "xi_3d"),
                                g.constant(np.arange(N_KNOTS, dtype=np.float64), "knots")],
                        "knot_offset")
        hats = g.node("Relu", [g.node("Sub", [one, g.node("Abs", [offset], "knot_distance")],
                                      "hat_raw")], "hat")
        flat = g.node("Reshape", [hats, ints([-1, len(FEATURE_RANKS) * N_KNOTS], "hat_shape")],
                      "hat_units")
        m = g.node("Add", [g.node("MatMul", [flat, g.constant(w, "iop_weight")], "row_part"),
                           g.constant(a, "rank_part")], "multiplier")
        inc = g.node("Mul", [g.node("Mul", [m, beta], "scaled_multiplier"), gaps], "increment")
        zero = g.node("Sub", [last, last], "zero")
        c = g.node("CumSum", [g.node("Concat", [inc, zero], "increment_0", axis=1),
                              ints(1, "cumsum_axis")], "top_logits", reverse=1)
        tail = g.node("Mul", [g.node("Sub", [z, last], "below_last"), beta], "tail_logits")
        return g.node("ScatterElements", [tail, idx, c], "u", axis=1)

    # -- fitting ------------------------------------------------------------
    def _fit(self, x, y, *, kind, options, progress):
        with single_threaded_blas():  # small products: BLAS threads only spin
            return self._fit_convex(x, y, kind, options, progress)

    def _fit_convex(self, x, y, kind, options, progress):
        started = time.perf_counter()
        n, n_classes = x.shape
        n_top = options["n_top"]
        k = min(n_top, n_classes - 1)
        beta = float(TemperatureScaler().fit(x, y, kind=kind).weight_)
        rows = _Rows.build(x, y, kind, beta, k)
        progress(0.1)
        lam, mu = options["reg_lambda"], options["reg_mu"]
        cv, start, evaluations = None, None, 0
        if lam is None or mu is None:
            if n < 2 * options["n_folds"]:
                raise CalibrationInputError(
                    "cross-validating the penalties needs at least "
                    f"{2 * options['n_folds']} rows; give reg_lambda and reg_mu explicitly "
                    f"for tiny sets. Got {n} rows."
                )
            cands = [(g if lam is None else lam, g if mu is None else mu)
                     for g in options["grid"]]
            (lam, mu), start, cv, evaluations = _cross_validate(rows, beta, cands, options,
                                                                progress)
        prob = _Problem(rows, beta, lam or 0.0, mu or 0.0)
        if lam is None:  # temperature scaling won the cross-validation
            theta = prob.centre
            info = {"converged": True, "iterations": 0,
                    "loss": float(prob.nll(theta).mean())}
        else:
            res = prob.solve(prob.centre if start is None else start,
                             max_iter=options["max_iter"], tol=options["tol"])
            theta = res.x
            info = {"converged": bool(res.success), "message": str(res.message),
                    "iterations": int(res.nit), "loss": float(res.fun)}
        evaluations += prob.evaluations
        self.beta_ = beta
        self.rank_scale_ = np.full(n_top, 1.0 - FLOOR)
        self.rank_scale_[:k] = theta[:k]
        self.weight_ = np.zeros((n_top, len(FEATURE_RANKS), N_KNOTS))
        self.weight_[:k] = theta[k:].reshape(k, len(FEATURE_RANKS), N_KNOTS)
        progress(1.0)
        return {
            "reg_lambda": lam,
            "reg_mu": mu,
            "temperature": 1.0 / beta,
            "n_gaps": k,
            **info,
            "evaluations": evaluations,
            "seconds": time.perf_counter() - started,
            "cross_validation": cv,
        }


class _Fold:
    """A fold's problem in the interface of
    :func:`calibrators.solvers.crossval.cross_validate_path`."""

    def __init__(self, rows: _Rows, beta: float, index: np.ndarray, penalties):
        self.rows, self.beta = rows, beta
        self.problem = _Problem(rows.subset(index), beta, *penalties)

    @property
    def evaluations(self) -> int:
        return self.problem.evaluations

    def initial(self) -> np.ndarray:
        return self.problem.centre

    def solve(self, start, *, max_iter: int, tol: float):
        return self.problem.solve(start, max_iter=max_iter, tol=tol)

    def nll(self, theta, index, y=None) -> float:
        """Mean NLL of the rows ``index`` (held out of this fold's fit)."""
        return float(_Problem(self.rows.subset(index), self.beta).nll(theta).mean())


def _cross_validate(rows: _Rows, beta: float, cands, options, progress):
    """Choose (lam, mu) among temperature scaling and ``cands`` by the folds' NLL.

    The candidates are walked by :func:`calibrators.solvers.crossval.cross_validate_path`
    on the folds of :func:`calibrators.solvers.crossval.fold_assignment`; temperature
    scaling (the centre of the penalty) is scored on the same folds first. The
    folds share ``beta``, fitted on all rows: temperature scaling has seen every
    held-out fold, a bias towards keeping it. Returns ``((lam, mu), start, cv,
    evaluations)``: ``(None, None)`` and no start when temperature scaling
    wins, else the winner and the mean of its folds' solutions (a start for
    the final fit).
    """
    n_folds = options["n_folds"]
    index = np.arange(rows.n)
    fold_of = fold_assignment(rows.n, n_folds, options["seed"])
    done = [0]

    def tick(fits):
        done[0] += fits
        progress(0.1 + 0.8 * done[0] / (n_folds * len(cands)))

    scores, solutions, evaluations = cross_validate_path(
        lambda idx, _, cand: _Fold(rows, beta, idx, cand), index, index, fold_of, cands,
        [None] * n_folds, tick, max_iter=options["max_iter"], tol=CV_TOL,
    )
    centre = _centre(rows.gaps.shape[1])
    temperature = float(np.mean([_Problem(rows.subset(fold_of == f), beta).nll(centre).mean()
                                 for f in range(n_folds)]))
    cv = {
        "n_folds": n_folds,
        "candidates": [{"reg_lambda": a, "reg_mu": b, "cv_nll": sc} for (a, b), sc in zip(
            [(None, None), *cands], [temperature, *scores], strict=False)],
    }
    best = int(np.argmin(scores))
    if not scores[best] < temperature:
        return (None, None), None, cv, evaluations
    return cands[best], np.mean(solutions[best], axis=0), cv, evaluations
