"""Ensemble temperature scaling: a mixture of a tempered softmax, the softmax and the uniform.

    p(z) = w1 softmax(beta z) + w2 softmax(z) + w3 / K,   w on the simplex, beta > 0

and the calibrated logits are ``u = log p``. Each component keeps the order of
the scores (``softmax(beta z)`` and ``softmax(z)`` are increasing in each score
for ``beta > 0``; the uniform is constant) and the weights are positive, so the
mixture keeps the order of every row: ties stay ties and the argmax never
changes. ``u`` is computed as ``logsumexp_i(log w_i + log_softmax_i(z))``,
finite for any finite input. With ``w = (1, 0, 0)`` it is temperature scaling.

Fitting
-------
Zhang et al. fit ``beta`` by temperature scaling and then the weights. Here
``beta`` and the weights minimise the mean NLL jointly, from that same start:

* for a fixed ``beta`` the NLL is convex in ``w`` (minus the mean log of a
  linear function) and only needs, per row, the three component probabilities
  of the label: it is solved exactly on the simplex (a Newton method on the
  relative interior of each of its 7 faces; the minimum is the best of them);
* the profile ``F(v) = min_w NLL(exp(v), w)`` of ``v = log beta`` is minimised by
  Newton steps with a backtracking line search, each accepted only if it lowers
  ``F``, from the best of a coarse grid of ``v`` around temperature scaling's (the
  profile is flat where the tempered component gets no weight, so a start there
  would be a stationary point). ``F'`` is the partial derivative at the optimal
  weights (the envelope theorem) and ``F''`` the Schur complement of the Hessian
  on the active face;
  both come exactly from one pass over the data (the label's log-probability
  under ``softmax(beta z)`` and its first two derivatives in ``beta``).

Every accepted step lowers the NLL, so the fit never ends above temperature
scaling's (its start) on the fit set.

References
----------
Zhang, Kailkhura, Han. "Mix-n-Match: Ensemble and Compositional Methods for
Uncertainty Calibration in Deep Learning", ICML 2020.

Examples
--------
>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> y = rng.integers(0, 4, 300)
>>> z = rng.normal(size=(300, 4)) * 4
>>> z[np.arange(300), y] += 3.0
>>> cal = EnsembleTemperatureScaler().fit(z, y)
>>> cal.fit_info_["nll"] <= cal.fit_info_["nll_temperature"]
True
>>> cal.weights.round(3).tolist()  # tempered softmax, softmax, uniform
[0.841, 0.0, 0.159]
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from calibrators.base import Calibrator, Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes
from calibrators.methods.temperature import TemperatureScaler
from calibrators.numerics import log_softmax
from calibrators.options import Integer, Positive
from calibrators.solvers.tempered import nll_terms
from calibrators.validation import MAX_PASSES, CalibrationInputError

if TYPE_CHECKING:  # ONNX is imported by to_onnx only, not with the package
    from calibrators.onnx_export import GraphBuilder

#: A weight the fit sets to 0 is stored as this log-weight (its share is below 1e-300).
LOG_WEIGHT_FLOOR = math.log(1e-300)
#: The two softmax components together keep at least this share, so that the
#: mixture is never (numerically) the uniform, whose argmax is arbitrary.
MIN_SHARE = 1e-6
#: Armijo constant of the line search.
ARMIJO = 1e-4
#: Largest step in ``log beta``.
MAX_STEP = 2.0
#: The start is the best of these offsets of ``log beta`` from temperature scaling's
#: (0 first: on ties, temperature scaling's beta).
START_OFFSETS = (0.0, -3.0, -2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0)


def _scaled(la: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a`` from ``la = log a``, each row divided by its largest entry, and that log."""
    top = la.max(axis=1)
    return np.exp(la - top[:, None]), top


def _mixture_nll(scaled: tuple[np.ndarray, np.ndarray], w: np.ndarray):
    """Mean of ``-log(sum_i w_i a_ni)`` and ``R = a / (w . a)``, from :func:`_scaled`."""
    a, top = scaled
    m = a @ w
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return float(-np.mean(np.log(m) + top)), a / m[:, None]


def _simplex_face(scaled, face: tuple[int, ...], iterations: int = 100):
    """Minimise the mixture NLL on the relative interior of one face of the simplex.

    Newton steps on the face's affine hull (the KKT system of ``sum w = 1``) with
    a backtracking line search that keeps the weights of the face positive.
    Returns ``(nll, w)`` at a stationary point, or None when the iterates head
    for the face's boundary (the minimum is then on a smaller face).
    """
    n, m = scaled[0].shape
    w = np.zeros(m)
    w[list(face)] = 1.0 / len(face)
    value, r = _mixture_nll(scaled, w)
    if len(face) == 1 or not math.isfinite(value):  # a row no component of the face explains
        return (value, w) if math.isfinite(value) else None
    idx = list(face)
    size = len(idx)
    kkt = np.zeros((size + 1, size + 1))
    kkt[:size, size] = kkt[size, :size] = 1.0
    for _ in range(iterations):
        rs = r[:, idx]
        grad = -rs.mean(axis=0)
        kkt[:size, :size] = rs.T @ rs / n
        rhs = np.concatenate([-grad, [0.0]])
        step = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:size]
        decrease = -float(grad @ step)
        if decrease <= 1e-15 * (1.0 + abs(value)):
            return value, w
        shrink = step < 0
        alpha = 1.0
        if shrink.any():
            alpha = min(1.0, 0.99 * float(np.min(-w[idx][shrink] / step[shrink])))
        while alpha > 1e-12:
            trial = w.copy()
            trial[idx] += alpha * step
            new_value, new_r = _mixture_nll(scaled, trial)
            if new_value <= value - ARMIJO * alpha * decrease:
                break
            alpha /= 2.0
        else:
            return value, w
        w, value, r = trial, new_value, new_r
        if np.min(w[idx]) < 1e-14:
            return None
    return None


def simplex_weights(la: np.ndarray) -> tuple[float, np.ndarray, tuple[int, ...]]:
    """The exact minimiser of the mean ``-log(w . a_n)`` over the simplex.

    Parameters
    ----------
    la : ndarray of shape (n_samples, n_components)
        ``log a_ni``, the log-likelihood of row n's label under component i.

    Returns
    -------
    nll : float
    w : ndarray of shape (n_components,)
    face : tuple of int
        The components with positive weight.
    """
    m = la.shape[1]
    scaled = _scaled(la)
    best = None
    for size in range(1, m + 1):
        for face in itertools.combinations(range(m), size):
            found = _simplex_face(scaled, face)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], face)
    return best


class EnsembleTemperatureScaler(Calibrator):
    """Ensemble temperature scaling (see the module docstring).

    Parameters
    ----------
    tol : float, default=1e-10
        Stop when ``|dF/dlog beta| < tol``.
    max_passes : int, default=50
        Bound on the passes over the data of the Newton search (after temperature
        scaling's fit, the pass at ``beta = 1`` and the starting grid's passes);
        1 to 10,000 (``MAX_PASSES``).

    Attributes
    ----------
    beta_ : float
        Inverse temperature of the tempered component.
    log_weights_ : ndarray of shape (3,)
        Logarithms of the (unnormalised) weights of ``softmax(beta z)``,
        ``softmax(z)`` and the uniform; :attr:`weights` normalises them.
    fit_info_ : dict
        ``nll`` and ``nll_temperature`` on the fit set, ``weights``,
        ``temperature``, ``passes``, ``reason``, ``gradient``.
    """

    method = "ets"
    preserves_argmax = True  # a positive mixture of order-preserving maps
    onnx_graph_name = "ensemble_temperature"
    option_checks: ClassVar[dict] = {"tol": Positive(), "max_passes": Integer(1, MAX_PASSES)}
    fitted_arrays: ClassVar[dict] = {"beta": (), "log_weights": (3,)}

    def __init__(self, *, tol: float = 1e-10, max_passes: int = 50):
        self.tol = tol
        self.max_passes = max_passes

    @property
    def weights(self) -> np.ndarray:
        """The mixture weights, ndarray of shape (3,), on the simplex."""
        self._check_fitted()
        lw = self.log_weights_ - self.log_weights_.max()
        w = np.exp(lw)
        return w / w.sum()

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: temperature scaling's, then per-row work.

        * bytes = ``chunk_bytes(3, K)`` (per thread: a float64 chunk and its
          exponentials; temperature scaling's start needs the same) ``+ 8 N *
          40`` (the per-row log-likelihoods, their derivatives and the simplex
          solver's temporaries);
        * flops = temperature scaling's ``+ SWEEP_FLOPS * N K * 20``: the pass at
          ``beta = 1``, the 9 of the starting grid and about ten of the Newton
          search.
        """
        ts = TemperatureScaler.fit_cost(n_samples, n_classes, {})
        return Cost(
            bytes=chunk_bytes(3, n_classes=n_classes) + 40 * FLOAT64 * n_samples,
            flops=ts.flops + float(SWEEP_FLOPS) * n_samples * n_classes * 20,
        )

    def _fit(self, x, y, *, kind, options, progress: Progress) -> dict:
        n, k = x.shape
        ts = TemperatureScaler().fit(x, y, kind=kind)
        ts_info = ts.fit_info_
        progress(0.3)
        log_p2 = -nll_terms(x, y, kind, 1.0)[:, 0]
        log_uniform = np.full(n, -math.log(k))
        passes = 1

        def profile(v: float) -> dict:
            beta = math.exp(v)
            f, f1, f2 = nll_terms(x, y, kind, beta).T
            la = np.stack([-f, log_p2, log_uniform], axis=1)
            value, w, face = simplex_weights(la)
            _, r = _mixture_nll(_scaled(la), w)
            # d log p1 / d v = -beta f1;  d2 log p1 / d v2 = -beta f1 - beta**2 f2
            dl, d2l = -beta * f1, -beta * f1 - beta * beta * f2
            q = w[0] * r[:, 0]  # w1 p1 / m
            grad = -float(np.mean(q * dl))
            h_vv = float(np.mean(-q * (d2l + dl * dl) + (q * dl) ** 2))
            # d2 NLL / dv dw_i = -mean dl (R_1 [i = 1] - q R_i), R = a / m
            own = np.zeros_like(r)
            own[:, 0] = r[:, 0]
            h_vw = -np.mean(dl[:, None] * (own - q[:, None] * r), axis=0)
            second = h_vv
            if len(face) > 1:
                basis = np.zeros((3, len(face) - 1))
                for j in range(len(face) - 1):
                    basis[face[j], j], basis[face[-1], j] = 1.0, -1.0
                h_ww = r.T @ r / n
                b = basis.T @ h_vw
                second -= float(b @ np.linalg.lstsq(basis.T @ h_ww @ basis, b, rcond=None)[0])
            return {"v": v, "nll": value, "w": w, "grad": grad, "second": second}

        # The profile is flat wherever the tempered component gets no weight (there
        # softmax(z) and the uniform do better without it), so a Newton method
        # started there stops at once: it starts from the best point of a coarse
        # grid around temperature scaling's beta instead.
        v_ts = math.log(ts.weight_)
        state = min((profile(v_ts + offset) for offset in START_OFFSETS),
                    key=lambda s: s["nll"])
        passes += len(START_OFFSETS)
        nll_temperature = ts_info["nll"]
        reason, budget = "max_passes", passes + options["max_passes"]
        while passes < budget:
            grad = state["grad"]
            if abs(grad) < options["tol"]:
                reason = "converged"
                break
            step = -grad / state["second"] if state["second"] > 0 else -math.copysign(1.0, grad)
            step = max(-MAX_STEP, min(MAX_STEP, step))
            if abs(step * grad) <= 1e-15 * (1.0 + abs(state["nll"])):
                reason = "converged"  # the step's gain is below the rounding of the NLL
                break
            accepted = False
            while passes < budget and abs(step * grad) > 1e-15 * (1.0 + abs(state["nll"])):
                trial = profile(state["v"] + step)
                passes += 1
                if trial["nll"] <= state["nll"] + ARMIJO * step * grad:
                    accepted = True
                    break
                step /= 2.0
            if not accepted:
                reason = "max_passes" if passes >= budget else "converged"
                break
            state = trial
            progress(0.3 + 0.7 * min(1.0, (passes + options["max_passes"] - budget)
                                     / options["max_passes"]))
        w = state["w"]
        if w[0] + w[1] < MIN_SHARE:  # a classifier worse than uniform: keep the order anyway
            w = np.array([MIN_SHARE * w[0] / max(w[0] + w[1], 1e-300) if w[0] + w[1] > 0
                          else MIN_SHARE, 0.0, 1.0 - MIN_SHARE])
        self.beta_ = math.exp(state["v"])
        with np.errstate(divide="ignore"):
            self.log_weights_ = np.maximum(np.log(w), LOG_WEIGHT_FLOOR)
        progress(1.0)
        return {
            "nll": state["nll"],
            "nll_temperature": nll_temperature,
            "weights": [float(v) for v in w],
            "temperature": 1.0 / self.beta_,
            "temperature_start": 1.0 / ts.weight_,
            "passes": passes,
            "temperature_passes": ts_info["passes"],
            "reason": reason,
            "gradient": state["grad"],
        }

    def _load_params(self, params) -> None:
        super()._load_params(params)
        if not self.beta_ > 0:
            raise CalibrationInputError(f"params beta for ets must be > 0. Got {self.beta_!r}.")
        share = float(self.weights[:2].sum())
        if share < MIN_SHARE:
            raise CalibrationInputError(
                f"params log_weights for ets must give the two softmax components a share "
                f">= {MIN_SHARE:g}. Got {share!r}."
            )

    # -- the map --------------------------------------------------------------
    def _terms(self) -> tuple[float, float, float]:
        """Normalised log-weights; the uniform's includes ``-log K``."""
        lw = self.log_weights_ - self.log_weights_.max()
        lw = lw - math.log(float(np.exp(lw).sum()))
        return float(lw[0]), float(lw[1]), float(lw[2]) - math.log(self.n_classes_)

    def _forward(self, z: np.ndarray) -> np.ndarray:
        l1, l2, l3 = self._terms()
        t1 = log_softmax(z * self.beta_) + l1
        t2 = log_softmax(z) + l2
        top = np.maximum(np.maximum(t1, t2), l3)
        return top + np.log(np.exp(t1 - top) + np.exp(t2 - top) + np.exp(l3 - top))

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        l1, l2, l3 = self._terms()
        scaled = graph.node("Mul", [z, graph.constant(self.beta_, "beta")], "scaled")
        t1 = graph.node("Add", [graph.node("LogSoftmax", [scaled], "log_p1", axis=1),
                                graph.constant(l1, "log_w1")], "t1")
        t2 = graph.node("Add", [graph.node("LogSoftmax", [z], "log_p2", axis=1),
                                graph.constant(l2, "log_w2")], "t2")
        t3 = graph.constant(l3, "t3")
        top = graph.node("Max", [t1, t2, t3], "t_max")
        total = graph.node("Sum", [
            graph.node("Exp", [graph.node("Sub", [t, top], f"{name}_shifted")], f"{name}_exp")
            for t, name in ((t1, "t1"), (t2, "t2"), (t3, "t3"))
        ], "t_total")
        return graph.node("Add", [top, graph.node("Log", [total], "log_total")], "u")
