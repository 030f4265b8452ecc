"""Parameterized temperature scaling: each row gets its own temperature, from its order statistics.

The calibrated logits are ``u(z) = beta(z) * z`` with a per-row inverse temperature

    beta(z) = beta0 * exp(-C tanh(s(z) / C)),   s(z) = w . phi(z) + w0,

where ``phi(z)`` are features of the row that do not change when a constant is
added to it (``c = z - max z``, ``d_j = -c_(j+1)`` the gap from the largest to
the (j+1)-th largest score):

* ``exp(-d_j)`` and ``log(1 + d_j)``, j = 1..n_top (the sorted top scores; 0
  for j >= K);
* ``logsumexp(c) / log K`` (the surprise of the top class, ``-log p_max``) and
  ``H(softmax(z)) / log K`` (the entropy), both in [0, 1].

``beta(z) > 0`` for every row, so each row's scores are multiplied by one
positive number: their order is kept exactly (ties stay ties) and the argmax
never changes. ``C = log(MAX_RATIO)`` bounds the per-row temperature to
``[T0 / MAX_RATIO, T0 * MAX_RATIO]`` (``T0 = 1 / beta0``) for any parameters.
With ``w = 0`` it is temperature scaling. Features cost ``O(K)`` per row (the
top scores by ``numpy.partition``, not a sort), and every pass over the data goes
in row chunks, so memory is a chunk of rows, not a copy of the scores.

Fitting
-------
The objective is the mean NLL plus ``reg * |a|**2`` on the coefficients ``a`` of
the standardised features. Per row the NLL depends on the parameters only
through ``beta_n``: ``f_n(beta) = logsumexp(beta c_n) - beta c_n,y`` with
``f_n' = E_p[c] - c_y`` and ``f_n'' = Var_p(c)``, so one pass over the data gives
the exact gradient and Hessian (chain rule through ``beta_n``), and the fit is a
damped Newton method (Levenberg-Marquardt steps, each accepted only if it lowers
the objective) from the temperature-scaling solution (``a = 0``). The objective
therefore never ends above temperature scaling's NLL on the fit set.

With ``reg=None`` the penalty is chosen over ``grid`` (strongest first, each fit
warm-started from the previous) by the Takeuchi information criterion, the fit
NLL plus ``trace(J H^-1) / N`` (``J`` the mean outer product of the per-row
gradients, ``H`` the Hessian of the penalised objective): an estimate of the
held-out NLL from the same passes, without refitting on folds. Temperature
scaling itself (``a = 0``) is the first candidate, so a model whose features do
not pay for themselves is not chosen.

References
----------
Tomani, Cremers, Buettner. "Parameterized Temperature Scaling for Boosting the
Expressive Power in Post-Hoc Uncertainty Calibration", ECCV 2022.
Takeuchi, "Distribution of information statistics and validity criteria of
models", Mathematical Science 153, 1976 (the criterion; see Konishi and
Kitagawa, "Information Criteria and Statistical Modeling", 2008, ch. 3).

Examples
--------
>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> y = rng.integers(0, 5, 400)
>>> z = rng.normal(size=(400, 5)) * 3
>>> z[np.arange(400), y] += 2.0
>>> cal = ParameterizedTemperatureScaler(n_top=3, reg=0.1).fit(z, y)
>>> cal.fit_info_["nll"] <= cal.fit_info_["nll_temperature"]
True
>>> bool((cal.predict_proba(z).argmax(axis=1) == z.argmax(axis=1)).all())
True
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from calibrators.base import Calibrator, Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes
from calibrators.methods.temperature import TemperatureScaler
from calibrators.numerics import map_chunks
from calibrators.options import Integer, Positive, check_grid
from calibrators.solvers.tempered import nll_terms
from calibrators.validation import MAX_PASSES, MAX_TOP, CalibrationInputError, logits64

if TYPE_CHECKING:  # ONNX is imported by to_onnx only, not with the package
    from calibrators.onnx_export import GraphBuilder

#: The per-row temperature stays within this factor of ``T0`` either way.
MAX_RATIO = 100.0
SQUASH = math.log(MAX_RATIO)
#: Default penalties (on standardised coefficients), strongest first.
DEFAULT_GRID = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003)
#: Stop walking the grid after this many candidates in a row worse than the best.
PATIENCE = 2
#: Armijo constant of the accepted steps.
ARMIJO = 1e-4
#: Largest change of any standardised parameter in one Newton step.
MAX_STEP = 2.0


def features(z: np.ndarray, n_top: int, *, overwrite: bool = False) -> np.ndarray:
    """The features ``phi`` of a float64 block of logits, shape (n_rows, 2 n_top + 2).

    Columns: ``exp(-d_j)`` for j = 1..n_top, ``log(1 + d_j)`` for j = 1..n_top,
    ``logsumexp(c) / log K``, ``entropy / log K`` (see the module docstring);
    the gaps ``d_j`` for j >= K are absent and their columns 0. ``O(K)`` per row
    (``numpy.partition``), two float64 temporaries of the block's size
    (one with ``overwrite``, which shifts ``z`` in place).
    """
    n, k = z.shape
    c = np.subtract(z, z.max(axis=1, keepdims=True), out=z if overwrite else None)
    m = min(n_top, k - 1)
    out = np.zeros((n, 2 * n_top + 2))
    top = np.partition(c, k - m - 1, axis=1)[:, k - m - 1 :].copy()  # the m + 1 largest
    top.sort(axis=1)
    gaps = -top[:, -2::-1]  # d_1..d_m, from the second largest down
    out[:, :m] = np.exp(-gaps)
    out[:, n_top : n_top + m] = np.log(1.0 + gaps)
    e = np.exp(c)
    total = e.sum(axis=1)
    lse = np.log(total)
    log_k = math.log(k)
    out[:, -2] = lse / log_k
    out[:, -1] = (lse - np.einsum("ij,ij->i", e, c) / total) / log_k
    return out


def _feature_matrix(x: np.ndarray, kind: str, n_top: int) -> np.ndarray:
    parts = map_chunks(
        lambda rows: features(logits64(x[rows], kind), n_top, overwrite=True), *x.shape
    )
    return np.concatenate(parts)


class _Model:
    """The penalised NLL in standardised coordinates ``theta = (b, a)``, b = log T0.

    ``log T_n = b + C tanh(G_n a / C)`` with ``G`` the standardised active
    features; every evaluation is one pass over the data (:func:`nll_terms`).
    """

    def __init__(self, x, y, kind, g: np.ndarray, reg: float):
        self.x, self.y, self.kind, self.g, self.reg = x, y, kind, g, reg
        self.n = len(y)
        self.passes = 0

    def restate(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (another penalty's) with this model's objective: no pass needed."""
        a = state["theta"][1:]
        return {**state, "objective": state["nll"] + self.reg * float(a @ a)}

    def evaluate(self, theta: np.ndarray) -> dict[str, Any]:
        a = theta[1:]
        t = np.tanh(self.g @ a / SQUASH)
        beta = np.exp(-theta[0] - SQUASH * t)  # theta[0] moves by MAX_STEP at most per step
        terms = nll_terms(self.x, self.y, self.kind, beta)
        self.passes += 1
        nll = float(terms[:, 0].mean())
        return {"theta": theta, "t": t, "beta": beta, "terms": terms, "nll": nll,
                "objective": nll + self.reg * float(a @ a)}

    def derivatives(self, state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Gradient and Hessian of the objective, and the per-row NLL gradients."""
        theta, t, beta = state["theta"], state["t"], state["beta"]
        _, f1, f2 = state["terms"].T
        n, p = self.n, len(theta)
        slope = 1.0 - t * t  # d tanh
        xx = np.empty((n, p))
        xx[:, 0] = 1.0
        xx[:, 1:] = self.g * slope[:, None]  # d log T_n / d theta
        rows = -(f1 * beta)[:, None] * xx  # d f_n / d theta
        grad = rows.mean(axis=0)
        weight = f2 * beta * beta + f1 * beta
        hess = (xx * weight[:, None]).T @ xx / n
        curv = f1 * beta * 2.0 * t * slope / SQUASH
        hess[1:, 1:] += (self.g * curv[:, None]).T @ self.g / n
        grad[1:] += 2.0 * self.reg * theta[1:]
        hess[1:, 1:] += 2.0 * self.reg * np.eye(p - 1)
        return grad, hess, rows

    def solve(self, state, *, tol: float, max_passes: int):
        """Damped Newton from ``state``; returns (state, gradient, hessian, rows, reason)."""
        damping = 0.0
        start = self.passes
        while True:
            grad, hess, rows = self.derivatives(state)
            if np.max(np.abs(grad)) < tol:
                return state, grad, hess, rows, "converged"
            scale = max(float(np.max(np.abs(np.diag(hess)))), 1e-300)
            lowest = float(np.linalg.eigvalsh(hess)[0])
            damping = max(damping, 0.0 if lowest > 1e-12 * scale else 1e-8 * scale - lowest)
            while True:
                if self.passes - start >= max_passes:
                    return state, grad, hess, rows, "max_passes"
                step = np.linalg.solve(hess + damping * np.eye(len(grad)), -grad)
                longest = float(np.max(np.abs(step)))
                if longest > MAX_STEP:  # a trust region: T0 moves by e**2 at most
                    step *= MAX_STEP / longest
                slope = float(grad @ step)
                if -slope <= 1e-15 * (1.0 + abs(state["objective"])):
                    return state, grad, hess, rows, "converged"  # nothing left to gain
                trial = self.evaluate(state["theta"] + step)
                if trial["objective"] <= state["objective"] + ARMIJO * slope:
                    state = trial
                    damping = damping / 10.0 if damping > 1e-6 * scale else 0.0
                    break
                damping = max(10.0 * damping, 1e-4 * scale)

    def information(self, grad, hess, rows, active: slice) -> float:
        """``trace(J H^-1) / N`` on the ``active`` parameters (the TIC penalty)."""
        r = rows[:, active]
        j = r.T @ r / self.n
        h = hess[active, active]
        return float(np.trace(np.linalg.lstsq(h, j, rcond=None)[0])) / self.n


class ParameterizedTemperatureScaler(Calibrator):
    """Parameterized temperature scaling ``softmax(beta(z) * z)`` (see the module docstring).

    Parameters
    ----------
    n_top : int, default=10
        Gaps to the top score used as features (the paper uses the top 10 logits);
        1 to 1,048,576 (``MAX_TOP``; at most ``K - 1`` are used).
    reg : float, optional
        Penalty on the standardised coefficients (>= 0); chosen over ``grid`` by
        the Takeuchi information criterion when None.
    grid : sequence of float, default=DEFAULT_GRID
        Candidate penalties (stored sorted, strongest first, without repeats).
    tol : float, default=1e-9
        Stop a fit when every entry of the objective's gradient is below this.
    max_passes : int, default=100
        Bound on the passes over the data of each fit (one per penalty); 1 to 10,000
        (``MAX_PASSES``).

    Attributes
    ----------
    beta_ : float
        ``beta0``, the inverse temperature where ``s(z) = 0``.
    top_weights_ : ndarray of shape (n_top, 2)
        Coefficients of ``exp(-d_j)`` (column 0) and ``log(1 + d_j)`` (column 1).
    row_weights_ : ndarray of shape (2,)
        Coefficients of the normalised log-sum-exp and entropy.
    offset_ : float
        ``w0``.
    fit_info_ : dict
        ``reg`` (None: temperature scaling won), ``nll`` and ``nll_temperature``
        on the fit set, ``temperature_start`` (temperature scaling's T),
        ``passes``, ``reason`` ("converged", "max_passes", or "temperature"),
        ``temperature_range`` (smallest and largest per-row temperature on the fit
        set) and ``candidates`` (the penalties tried, with their criterion).
    """

    method = "pts"
    preserves_argmax = True  # beta(z) > 0 multiplies the whole row
    onnx_graph_name = "parameterized_temperature"
    option_checks: ClassVar[dict] = {
        "n_top": Integer(1, MAX_TOP),
        "reg": Positive(allow_zero=True, allow_none=True),
        "grid": check_grid,
        "tol": Positive(),
        "max_passes": Integer(1, MAX_PASSES),
    }
    fitted_arrays: ClassVar[dict] = {
        "beta": (),
        "top_weights": ("n_top", 2),
        "row_weights": (2,),
        "offset": (),
    }

    def __init__(self, *, n_top: int = 10, reg: float | None = None, grid=DEFAULT_GRID,
                 tol: float = 1e-9, max_passes: int = 100):
        self.n_top = n_top
        self.reg = reg
        self.grid = grid
        self.tol = tol
        self.max_passes = max_passes

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: linear in K per row chunk.

        With ``m = 2 n_top + 2`` features and ``c`` candidate penalties (1 when
        ``reg`` is given, else ``len(grid) + 1``):

        * bytes = ``chunk_bytes(3, K)`` (per thread: a float64 chunk, its
          partition and its exponentials) ``+ 8 N (6 m + 16)`` (the raw and
          standardised features, the per-row Jacobians and NLL terms);
        * flops = ``SWEEP_FLOPS * N K * (9 + 1 + 8 c)``: temperature scaling's
          start, the features, and about 8 Newton passes per candidate.
        """
        n, k = n_samples, n_classes
        m = 2 * options["n_top"] + 2
        candidates = 1 if options["reg"] is not None else len(options["grid"]) + 1
        return Cost(
            bytes=chunk_bytes(3, n_classes=k) + FLOAT64 * n * (6 * m + 16),
            flops=float(SWEEP_FLOPS) * n * k * (10 + 8 * candidates),
        )

    def _fit(self, x, y, *, kind, options, progress: Progress) -> dict:
        n_top = options["n_top"]
        ts = TemperatureScaler().fit(x, y, kind=kind)
        ts_info = ts.fit_info_
        progress(0.1)
        phi = _feature_matrix(x, kind, n_top)
        mean = phi.mean(axis=0)
        std = phi.std(axis=0)
        active = np.flatnonzero(std > 1e-9 * (1.0 + np.abs(mean)))
        g = (phi[:, active] - mean[active]) / std[active]
        del phi
        regs = [options["reg"]] if options["reg"] is not None else list(options["grid"])
        theta = np.zeros(1 + len(active))
        theta[0] = -math.log(ts.weight_)

        # Temperature scaling (a = 0) first: its state, and its criterion.
        model = _Model(x, y, kind, g, 0.0)
        state = model.evaluate(theta)
        grad, hess, rows = model.derivatives(state)
        candidates = [{
            "reg": None, "nll": state["nll"], "reason": "temperature",
            "criterion": state["nll"] + model.information(grad, hess, rows, slice(0, 1)),
        }]
        best = {"state": state, "reg": None, "reason": "temperature", **candidates[0]}
        nll_temperature = state["nll"]
        passes = model.passes
        for i, reg in enumerate(regs):
            model = _Model(x, y, kind, g, reg)
            state, grad, hess, rows, reason = model.solve(
                model.restate(state), tol=options["tol"], max_passes=options["max_passes"]
            )
            passes += model.passes
            criterion = state["nll"] + model.information(grad, hess, rows, slice(None))
            candidates.append({"reg": reg, "nll": state["nll"], "reason": reason,
                               "criterion": criterion})
            progress(0.1 + 0.9 * (i + 1) / len(regs))
            if options["reg"] is not None or criterion < best["criterion"]:
                best = {"state": state, "reg": reg, "reason": reason, "criterion": criterion}
            elif len(candidates) - 1 - _argmin(candidates) >= PATIENCE:
                break
        state = best["state"]
        # Back to the raw features: s = w . phi + w0 with w = a / std, w0 = -w . mean.
        w = np.zeros(2 * n_top + 2)
        w[active] = state["theta"][1:] / std[active]
        self.beta_ = float(math.exp(-state["theta"][0]))
        self.top_weights_ = np.stack([w[:n_top], w[n_top : 2 * n_top]], axis=1)
        self.row_weights_ = w[2 * n_top :].copy()
        self.offset_ = float(-(w[active] @ mean[active]))
        progress(1.0)
        temperatures = 1.0 / state["beta"]
        return {
            "reg": best["reg"],
            "criterion": best["criterion"],
            "nll": state["nll"],
            "nll_temperature": nll_temperature,
            "temperature_start": 1.0 / ts.weight_,
            "temperature_passes": ts_info["passes"],
            "passes": passes,
            "reason": best["reason"],
            "temperature_range": [float(temperatures.min()), float(temperatures.max())],
            "candidates": candidates,
        }

    def _load_params(self, params) -> None:
        super()._load_params(params)
        if not self.beta_ > 0:
            raise CalibrationInputError(f"params beta for pts must be > 0. Got {self.beta_!r}.")

    # -- the map --------------------------------------------------------------
    def _weights(self) -> np.ndarray:
        n_top = self.top_weights_.shape[0]
        w = np.empty(2 * n_top + 2)
        w[:n_top], w[n_top : 2 * n_top] = self.top_weights_[:, 0], self.top_weights_[:, 1]
        w[2 * n_top :] = self.row_weights_
        return w

    def row_beta(self, z: np.ndarray) -> np.ndarray:
        """The inverse temperature of each row of a float64 block of logits, shape (n_rows,)."""
        s = features(z, self.top_weights_.shape[0]) @ self._weights() + self.offset_
        return self.beta_ * np.exp(-SQUASH * np.tanh(s / SQUASH))

    def _forward(self, z: np.ndarray) -> np.ndarray:
        return z * self.row_beta(z)[:, None]

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        k = graph.n_classes
        n_top = self.top_weights_.shape[0]
        m = min(n_top, k - 1)
        from onnx import helper

        axis = graph.constant(np.array([1], dtype=np.int64), "pts_axis")
        # The m + 1 largest logits, sorted (TopK's second output, the indices, is unused).
        top, indices = graph.name("top"), graph.name("top_indices")
        graph.nodes.append(helper.make_node(
            "TopK", [z, graph.constant(np.array([m + 1]), "pts_k")], [top, indices],
            axis=1, largest=1, sorted=1,
        ))
        z_max = graph.node("ReduceMax", [z], "z_max", axes=[1], keepdims=1)
        c = graph.node("Sub", [z, z_max], "c")
        gaps = graph.node("Sub", [z_max, graph.node("Slice", [
            top, graph.constant(np.array([1]), "pts_from"),
            graph.constant(np.array([m + 1]), "pts_to"), axis,
        ], "top_rest")], "gaps")
        near = graph.node("Exp", [graph.node("Neg", [gaps], "neg_gaps")], "near")
        log_gaps = graph.node("Log", [graph.node("Add", [gaps, graph.constant(1.0, "one")],
                                                 "gaps_1")], "log_gaps")
        s = graph.node("Add", [
            graph.node("MatMul", [near, graph.constant(self.top_weights_[:m, 0], "w_near")],
                       "s_near"),
            graph.node("MatMul", [log_gaps, graph.constant(self.top_weights_[:m, 1], "w_log")],
                       "s_log"),
        ], "s_top")
        e = graph.node("Exp", [c], "pts_e")
        total = graph.node("ReduceSum", [e, axis], "pts_total", keepdims=0)
        lse = graph.node("Log", [total], "pts_lse")
        mean_c = graph.node("Div", [graph.node("ReduceSum", [
            graph.node("Mul", [e, c], "pts_ec"), axis], "pts_sum_ec", keepdims=0), total],
            "pts_mean_c")
        entropy = graph.node("Sub", [lse, mean_c], "pts_entropy")
        inv_log_k = 1.0 / math.log(k)
        s = graph.node("Add", [s, graph.node("Mul", [
            lse, graph.constant(self.row_weights_[0] * inv_log_k, "w_lse")], "s_lse")], "s_1")
        s = graph.node("Add", [s, graph.node("Mul", [
            entropy, graph.constant(self.row_weights_[1] * inv_log_k, "w_entropy")],
            "s_entropy")], "s_2")
        s = graph.node("Add", [s, graph.constant(self.offset_, "offset")], "s")
        squash = graph.node("Tanh", [graph.node("Mul", [s, graph.constant(1.0 / SQUASH,
                                                                          "inv_squash")],
                                                "s_scaled")], "squashed")
        beta = graph.node("Mul", [graph.constant(self.beta_, "beta0"), graph.node("Exp", [
            graph.node("Mul", [squash, graph.constant(-SQUASH, "minus_squash")], "log_ratio")],
            "ratio")], "row_beta")
        beta = graph.node("Unsqueeze", [beta, axis], "row_beta_column")
        return graph.node("Mul", [z, beta], "u")


def _argmin(candidates: list[dict]) -> int:
    return int(np.argmin([c["criterion"] for c in candidates]))
