"""Temperature scaling, solved exactly.

With inverse temperature ``beta`` the calibrated probabilities are
``softmax(beta * z)``. Per row, with ``p = softmax(beta * z)``:

* NLL(beta)      = logsumexp(beta * z) - beta * z_y
* dNLL/dbeta     = E_p[z] - z_y
* d2NLL/dbeta2   = Var_p(z) >= 0              (the mean NLL is convex in beta)
* H(beta)        = logsumexp(beta * z) - beta * E_p[z]
* dH/dbeta       = -beta * Var_p(z) <= 0      (entropy decreases in beta)

Both problems (minimise the mean NLL; hit a target mean entropy) are solved by
a safeguarded Newton iteration on ``beta`` (Numerical Recipes' ``rtsafe``):
Newton steps inside a bracket ``[lo, hi]`` that always contains the root of
the monotone function, with a geometric bisection of the bracket whenever a
step leaves it. ``beta > 0`` holds at every iterate, so the argmax never
changes. Each pass is one sweep over the data in float64 row chunks.

The iteration on the full data starts from the root for a strided subsample of
the rows, already close to the full-data root, so that the full data are swept
only a few times (``bench/README.md`` counts the passes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from calibrators.base import Integer, Positive, Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes
from calibrators.linear_softmax import LinearSoftmax
from calibrators.numerics import map_chunks
from calibrators.validation import MAX_PASSES, CalibrationInputError, logits64

#: Bracket ends: beta is searched in [BETA_MIN, BETA_MAX] / scale.
BETA_MIN = 1e-8
BETA_MAX = 1e8
#: Rows used for the subsample start (0 disables it).
SUBSAMPLE_ROWS = 8192


@dataclass(frozen=True)
class _Pass:
    """Means over rows at one beta (float64 accumulators)."""

    nll: float
    grad: float  # dNLL/dbeta
    var: float  # d2NLL/dbeta2 = mean Var_p(z)
    skew: float  # d3NLL/dbeta3 = mean third central moment of z under p
    entropy: float
    spread: float  # mean (max z - mean z): the scale of the logits


def _chunk_sums(x: np.ndarray, y: np.ndarray, kind: str, beta: float, rows: slice) -> np.ndarray:
    c = logits64(x[rows], kind)
    c -= c.max(axis=1, keepdims=True)  # shift-invariant; now max c = 0 per row
    zy = np.take_along_axis(c, y[rows, None], axis=1)[:, 0]
    e = np.multiply(c, beta)
    np.exp(e, out=e)
    s = e.sum(axis=1)
    # Unnormalised moments sum(e * c**j), j = 1..3, each one fused sweep.
    m1 = np.einsum("ij,ij->i", e, c)
    e *= c
    m2 = np.einsum("ij,ij->i", e, c)
    e *= c
    m3 = np.einsum("ij,ij->i", e, c)
    inv = 1.0 / s
    ez, ez2, ez3 = m1 * inv, m2 * inv, m3 * inv
    lse = np.log(s)
    var = np.maximum(ez2 - ez * ez, 0.0)
    skew = ez3 - 3.0 * ez * ez2 + 2.0 * ez**3  # third central moment = dVar/dbeta
    return np.array(
        [
            np.sum(lse - beta * zy),
            np.sum(ez - zy),
            np.sum(var),
            np.sum(skew),
            np.sum(lse - beta * ez),
            -np.sum(c) / c.shape[1],
        ]
    )


def _pass(x: np.ndarray, y: np.ndarray, kind: str, beta: float) -> _Pass:
    """One sweep over the data: mean NLL, its two derivatives and entropy at ``beta``."""
    parts = map_chunks(lambda rows: _chunk_sums(x, y, kind, beta, rows), *x.shape)
    total = np.sum(parts, axis=0) / x.shape[0]
    return _Pass(*map(float, total))


def _safeguarded_newton(f, lo, hi, x, *, tol, max_passes, increasing):
    """Root of a monotone ``f`` in ``[lo, hi]`` by Halley/Newton steps with bisection fallback.

    ``f(x)`` returns ``(value, derivative, second_derivative, extra)``. A
    Halley step (cubic convergence: the relative error e becomes O(e**3), where a
    Newton step gives O(e**2), so fewer passes over the data) is taken
    when its denominator is sound, else a Newton step; a step that leaves the
    bracket is replaced by a geometric bisection. Returns
    ``(x, value, extra, passes, reason)``; reason is "converged" or
    "max_passes" or "bound".
    """
    sign = 1.0 if increasing else -1.0
    passes = 0
    while True:
        value, deriv, second, extra = f(x)
        passes += 1
        if abs(value) < tol:
            return x, value, extra, passes, "converged"
        if sign * value > 0:
            hi = x
        else:
            lo = x
        if passes >= max_passes:
            return x, value, extra, passes, "max_passes"
        if hi / lo <= 1 + 1e-15:
            return x, value, extra, passes, "bound"
        x_new = math.nan
        if deriv != 0 and math.isfinite(deriv):
            x_new = x - value / deriv
            denominator = 2.0 * deriv * deriv - value * second
            if math.isfinite(second) and denominator > deriv * deriv:
                x_new = x - 2.0 * value * deriv / denominator
        if not (lo < x_new < hi):  # Newton left the bracket: bisect (geometrically)
            x_new = math.sqrt(lo * hi)
        x = x_new


class TemperatureScaler(LinearSoftmax):
    """Temperature scaling ``softmax(beta * z)`` with the exact optimal ``beta``.

    Parameters
    ----------
    target_entropy : float, optional
        Instead of minimising the mean NLL, choose the ``beta`` whose mean
        predictive entropy (nats) equals this value, in ``(0, log K)``.
    tol : float, default=1e-10
        Stop when ``|dNLL/dbeta| < tol * scale`` (or ``|H - target| < tol``),
        where ``scale`` is the mean spread ``max z - mean z`` of the logits.
    max_passes : int, default=50
        Bound on the passes over the full data; 1 to 10,000 (``MAX_PASSES``).

    Attributes
    ----------
    beta_ : float
        Inverse temperature (``weight_``); the temperature is ``1 / beta_``.
    fit_info_ : dict
        ``passes``, ``reason`` ("converged", "max_passes" or "bound"),
        ``gradient`` (dNLL/dbeta at ``beta_``), ``nll``, ``entropy``, ``scale``.

    References
    ----------
    Guo et al., "On Calibration of Modern Neural Networks", ICML 2017.

    Examples
    --------
    >>> import numpy as np
    >>> z = np.array([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    >>> cal = TemperatureScaler().fit(z, [0, 1, 2, 2])
    >>> round(cal.beta_, 6), cal.fit_info_["reason"]
    (0.44794, 'converged')
    """

    method = "temperature"
    structure = "scalar"
    has_bias = False
    preserves_argmax = True
    option_checks: ClassVar[dict] = {
        "target_entropy": Positive(allow_none=True),
        "tol": Positive(),
        "max_passes": Integer(1, MAX_PASSES),
    }

    def __init__(self, *, target_entropy: float | None = None, tol: float = 1e-10,
                 max_passes: int = 50):
        self.target_entropy = target_entropy
        self.tol = tol
        self.max_passes = max_passes

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: linear in K per row chunk, independent of N.

        * bytes = ``chunk_bytes(3, K)`` (per thread: a float64 copy of one row
          chunk, its exponentials, and for probabilities the clipped chunk before
          its log) ``+ 32 N`` (labels and per-row checks).
        * flops = ``SWEEP_FLOPS * K * (passes * N + 8 * rows_s)``: 4 passes over
          the N rows after a start solved on the ``rows_s`` rows of the strided
          subsample (N > 2 * ``SUBSAMPLE_ROWS``), else 8 passes and no subsample.
        """
        n, k = n_samples, n_classes
        subsample = n > 2 * SUBSAMPLE_ROWS > 0
        rows_s = -(-n // (n // SUBSAMPLE_ROWS)) if subsample else 0
        passes = 4 if subsample else 8
        return Cost(
            bytes=chunk_bytes(3, n_classes=k) + 4 * FLOAT64 * n,
            flops=float(SWEEP_FLOPS) * k * (passes * n + 8 * rows_s),
        )

    @property
    def beta_(self) -> float:
        self._check_fitted()
        return self.weight_

    @property
    def temperature_(self) -> float:
        return 1.0 / self.beta_

    def _fit(self, z: np.ndarray, y: np.ndarray, *, kind: str, options: dict,
             progress: Progress) -> dict:
        n, k = z.shape
        target = options["target_entropy"]
        if target is not None and not 0 < target < math.log(k):
            raise CalibrationInputError(
                f"target_entropy must lie in (0, log K) = (0, {math.log(k):.6g}) nats for "
                f"K = {k}. Got {target!r}."
            )
        # The subsample (every row when n is small) gives the start and the
        # bracket; the full data are then swept only by the root finder itself.
        if SUBSAMPLE_ROWS and n > 2 * SUBSAMPLE_ROWS:
            # Every step-th row, a view: the start costs no copy of the scores
            # (a copy of 8,192 rows is 8 GiB at K = 262,144).
            step = n // SUBSAMPLE_ROWS
            zs, ys = z[::step], y[::step]
        else:
            zs, ys = z, y
        first = _pass(zs, ys, kind, 1.0)
        if first.spread == 0.0 and zs is not z:
            first = _pass(z, y, kind, 1.0)  # the subsample may be constant, the rest not
        if first.spread == 0.0:
            if target is not None:
                raise CalibrationInputError(
                    "target_entropy needs scores that vary within rows: every row is constant, "
                    "so the entropy is log K at any temperature. Got constant scores."
                )
            # Every beta gives the same (uniform) prediction: keep beta = 1.
            self.weight_ = 1.0
            return self._info(first, 1.0, 1, "converged", target)
        lo, hi = BETA_MIN / first.spread, BETA_MAX / first.spread
        tol = options["tol"]
        max_passes = options["max_passes"]

        if target is None:
            # dNLL/dbeta and its derivatives, in units of the logits' spread (so
            # the tolerance is relative to the scale of the logits).
            def f(beta, zz=z, yy=y):
                r = _pass(zz, yy, kind, beta)
                return r.grad / r.spread, r.var / r.spread, r.skew / r.spread, r
            increasing = True
        else:
            def f(beta, zz=z, yy=y):
                r = _pass(zz, yy, kind, beta)
                # d2H/dbeta2 = -Var - beta * dVar/dbeta
                return r.entropy - target, -beta * r.var, -r.var - beta * r.skew, r
            increasing = False

        beta0 = 1.0
        if zs is not z:
            beta0, *_ = _safeguarded_newton(
                lambda beta: f(beta, zs, ys), lo, hi, 1.0, tol=1e-6,
                max_passes=max_passes, increasing=increasing,
            )
        progress(0.2)
        beta, value, r, passes, reason = _safeguarded_newton(
            f, lo, hi, beta0, tol=tol, max_passes=max_passes, increasing=increasing
        )
        if target is not None and reason == "bound" and abs(value) > 1e-6:
            raise CalibrationInputError(
                f"target_entropy {target!r} is not reachable: the mean entropy only goes down to "
                f"{r.entropy:.6g} nats (rows with tied top scores). Got {target!r}."
            )
        self.weight_ = float(beta)
        progress(1.0)
        return self._info(r, beta, passes, reason, target)

    @staticmethod
    def _info(r: _Pass, beta, passes, reason, target) -> dict:
        scale = r.spread
        return {
            "objective": "nll" if target is None else "target_entropy",
            "passes": passes,
            "reason": reason,
            "gradient": r.grad,
            "relative_gradient": r.grad / scale if scale else 0.0,
            "nll": r.nll,
            "entropy": r.entropy,
            "scale": scale,
            "temperature": 1.0 / beta,
        }
