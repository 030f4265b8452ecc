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
step leaves it. Halley's step (it also uses the third cumulant of ``z``, the
derivative of the variance) replaces Newton's when sound. ``beta > 0`` holds at
every iterate, so the argmax never changes. Each pass is one sweep over the
data in row chunks, with float64 accumulators.

Passes in float32 cost about half of float64 ones (float64's exp and twice the
bytes), so the search is staged:

1. the root for a strided subsample of the rows (every row when N is small),
   in float32;
2. for a subsample, one float32 pass over every row and its Halley step: the
   start is now within ~1e-6 (relative) of the full-data root, float32's
   rounding included;
3. float64 passes over every row until the gradient is below ``tol``. The last
   Halley step is taken without a pass after it (``fit_info_["extrapolated"]``)
   when it is tiny and the convergence seen so far predicts the error it leaves
   below 1e-18 (relative), so that beta is float64's root to the last digits
   while the data are swept in float64 once or twice (``bench/README.md``).

float32 only moves the start: the root is float64's. Logits differing only below
float32's resolution (or a float32 pass that overflows) skip the float32 stages.

Logits are fitted multiplied by the power of two ``2**m`` that brings their
largest within-row difference into [0.5, 1), and ``beta`` is multiplied back by
``2**m``. Both products are exact in floating point, so ``beta * z`` is the same
number either way, and logits times ``2**e`` get the answer of the logits
themselves: logits of 1e-300 or 1e300, whose moments ``E_p[z**3]`` would
underflow or overflow, get the answer of logits near 1. Where ``|m| <=
WELL_SCALED`` the entries are not multiplied: the per-row sums are (``_moments``),
the same numbers for less work. The scale comes from the subsample; a pass over
every row whose spread is far from the subsample's (rows beyond its scale) starts
the fit again from every row. When the ``beta`` found is not a normal float64
(logits near 1e308, or differing by less than about 2**-1000), the fit refuses
with :class:`CalibrationInputError`. Probabilities are fitted as they are (their
logits lie in [log 2**-149, 0]).

A pass sweeps row chunks of ``PASS_CHUNK_ELEMENTS`` entries through two arrays
per thread, reused from chunk to chunk, and takes its row sums with einsum (not
BLAS: see ``_moments``; ``bench/README.md`` has the figures).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from calibrators.base import Progress
from calibrators.cost import FLOAT64, SWEEP_FLOPS, Cost, chunk_bytes
from calibrators.linear_softmax import LinearSoftmax
from calibrators.numerics import map_chunks, row_chunks
from calibrators.options import Integer, Positive
from calibrators.validation import (
    MAX_PASSES,
    PROBABILITY_FLOOR,
    CalibrationInputError,
    probabilities_to_logits,
)

#: Bracket ends: beta is searched in [BETA_MIN, BETA_MAX] / scale.
BETA_MIN = 1e-8
BETA_MAX = 1e8
#: Rows used for the subsample start (0 disables it).
SUBSAMPLE_ROWS = 8192
#: The float32 start stops at this relative gradient (float32 sums are good to ~1e-7).
START_TOL = 1e-6
#: The last Halley step is taken without a pass after it when it is at most this
#: (relative) and the error it leaves is predicted at most PREDICTED_ERROR.
FINAL_STEP = 1e-6
PREDICTED_ERROR = 1e-18
#: A rescale by 2**m with |m| <= WELL_SCALED is applied to the per-row sums, not
#: to every entry (see _moments): the logits' moments then stay within float32's range.
WELL_SCALED = 16
#: The subsample's spread must be within a factor 2**SAMPLE_SCALE of every row's.
SAMPLE_SCALE = 10
#: Entries per chunk of a pass: its two float64 temporaries (1 MiB) stay in L2.
PASS_CHUNK_ELEMENTS = 1 << 16
#: A pass over at most this many entries runs on the calling thread: its chunks' many
#: small numpy calls hold the GIL, so a second thread only adds a pool's start and
#: hand-offs (at 5,000 x 100 a fit took 9.9 ms against 8.5 on one thread at best,
#: 16.4 against 9.9 in the median; ``bench/README.md``). The same chunks in the same
#: order either way: the same sums, to the bit.
SERIAL_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class _Pass:
    """Means over rows at one beta (float64 accumulators)."""

    nll: float
    grad: float  # dNLL/dbeta
    var: float  # d2NLL/dbeta2 = mean Var_p(z)
    skew: float  # d3NLL/dbeta3 = mean third central moment of z under p
    entropy: float
    spread: float  # mean (max z - mean z): the scale of the logits


def _exponent(z: np.ndarray, kind: str) -> int | None:
    """The ``m`` of the rescale by ``2**m`` that brings the largest within-row
    difference of the logits ``z`` into [0.5, 1) (see the module's docstring); 0 for
    probabilities (their logits lie in [log 2**-149, 0], so they are fitted as they
    are); None when every row is constant."""
    top, bottom = z.max(axis=1), z.min(axis=1)
    if kind == "probabilities":
        return None if np.array_equal(top, np.maximum(bottom, PROBABILITY_FLOOR)) else 0
    # Rescaled by the largest magnitude first: top - bottom may overflow (1e308 - -1e308).
    big = math.frexp(max(float(np.max(top)), -float(np.min(bottom))))[1]
    width = float(np.max(np.ldexp(top, -big) - np.ldexp(bottom, -big)))
    if width == 0.0:
        return None
    return -(math.frexp(width)[1] + big)  # the largest difference is in [2**(e-1), 2**e)


def _shifted_into(out: np.ndarray, block: np.ndarray, kind: str, exponent: int) -> np.ndarray:
    """``out`` (float32 or float64, ``block``'s shape) set to the block of scores as
    logits, times ``2**exponent`` (exact), shifted so that every row's maximum is 0
    (softmax is shift-invariant)."""
    if kind == "probabilities":
        probabilities_to_logits(block, out=out)
    elif out.dtype == block.dtype:
        if not exponent:  # one sweep: the copy is the subtraction
            return np.subtract(block, block.max(axis=1, keepdims=True), out=out)
        np.ldexp(block, exponent, out=out)
    elif out.dtype == np.float64:  # float32 logits, shifted in float64 where it is exact
        np.copyto(out, block)
        if exponent:
            np.ldexp(out, exponent, out=out)
    else:  # float64 logits into float32: shifted in float64, then rounded
        u = np.ldexp(block, exponent) if exponent else block
        return np.subtract(u, u.max(axis=1, keepdims=True), out=out)
    out -= out.max(axis=1, keepdims=True)
    return out


class _Scratch:
    """The arrays of one pass's chunks, reused from chunk to chunk (a fresh chunk-sized
    array costs page faults, more than the arithmetic on it): one pair ``(c, e)`` per
    chunk in work at once; ``ones`` gives their dtype and width."""

    def __init__(self, rows: int, ones: np.ndarray):
        self.shape = (rows, ones.size)
        self.ones = ones
        self._free: list[tuple[np.ndarray, np.ndarray]] = []

    @contextmanager
    def pair(self, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Two arrays of ``rows`` rows, not in use by another thread."""
        try:
            c, e = self._free.pop()  # (atomic: the pool's threads share the list)
        except IndexError:
            c, e = np.empty(self.shape, self.ones.dtype), np.empty(self.shape, self.ones.dtype)
        try:
            yield c[:rows], e[:rows]
        finally:
            self._free.append((c, e))


def _chunk_sums(x: np.ndarray, y: np.ndarray, kind: str, beta: float, rows: slice,
                exponent: int, scratch: _Scratch) -> np.ndarray:
    # Non-finite sums (float32's range, or rows beyond the subsample's scale) are
    # seen by _fit, which starts again in float64 or on the scale of every row.
    with np.errstate(over="ignore", invalid="ignore"), \
            scratch.pair(rows.stop - rows.start) as (c, e):
        labels = None if y is None else y[rows]
        return _moments(c, e, scratch.ones, x[rows], labels, kind, beta, exponent)


def _moments(c: np.ndarray, e: np.ndarray, ones: np.ndarray, block: np.ndarray,
             labels: np.ndarray, kind: str, beta: float, exponent: int) -> np.ndarray:
    """Sums over a block's rows of the terms of :class:`_Pass` for the logits times
    ``2**exponent`` at ``beta``, computed in ``c`` and ``e`` (of the block's shape).

    When the rescale is small (``|exponent| <= WELL_SCALED``) the block is not
    multiplied: ``beta * 2**exponent`` multiplies the logits as they are, and the
    per-row sums ``sum(e * c**j)`` are multiplied by ``2**(j * exponent)``, the
    same numbers (powers of two are exact) for one op per row instead of per entry.
    Without labels (None: an entropy target) the NLL and its gradient are those of a
    label with logit 0 (the row's maximum), figures no caller reads.
    """
    scaled = abs(exponent) > WELL_SCALED
    _shifted_into(c, block, kind, exponent if scaled else 0)  # now max c = 0 per row
    shift = 0 if scaled else exponent
    np.multiply(c, c.dtype.type(math.ldexp(beta, shift)), out=e)
    np.exp(e, out=e)
    # Row sums sum(e * c**j), j = 0..3, by einsum (_row_sums), not as BLAS products
    # with a vector of ones (a quarter of the time, but BLAS calls on the pass's threads
    # beside the process-wide BLAS thread limit that other fits toggle: a fit of the
    # full suite stalled with no CPU twice); in float32 with float32 sums over a row
    # for a start (see _fit), per-row results in float64.
    s = _row_sums(e)
    e *= c
    m1 = np.ldexp(_row_sums(e), shift)
    e *= c
    m2 = np.ldexp(_row_sums(e), 2 * shift)
    e *= c
    m3 = np.ldexp(_row_sums(e), 3 * shift)
    zy = 0.0 if labels is None else np.ldexp(
        c[np.arange(c.shape[0]), labels].astype(np.float64), shift)
    total = math.ldexp(float(np.sum(_row_sums(c))), shift)
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
            -total / c.shape[1],
        ]
    )


def _row_sums(a: np.ndarray) -> np.ndarray:
    """Row sums of a chunk, in its dtype, as float64: einsum's loop, no BLAS, takes a
    third of the time of numpy's sum along rows of K = 100 (7 against 23 us for 655
    rows), a pass of temperature scaling 0.82x (float32) and 0.89x (float64) of it at
    5,000 x 100; the sums round differently (beta by at most one ulp on the reference
    cases)."""
    return np.einsum("ij->i", a).astype(np.float64)


def _pass(x: np.ndarray, y: np.ndarray, kind: str, beta: float, dtype=np.float64,
          exponent: int = 0) -> _Pass:
    """One sweep over the data: mean NLL, its two derivatives and entropy at ``beta``
    for the logits times ``2**exponent``, computed in ``dtype`` (float64 accumulators
    either way), in chunks of about ``PASS_CHUNK_ELEMENTS`` entries (on the calling
    thread up to ``SERIAL_ELEMENTS`` entries, else on
    :func:`calibrators.numerics.n_threads` threads)."""
    n, k = x.shape
    scratch = _Scratch(max(1, PASS_CHUNK_ELEMENTS // k), np.ones(k, dtype))

    def sums(rows):
        return _chunk_sums(x, y, kind, beta, rows, exponent, scratch)

    if n * k <= SERIAL_ELEMENTS:
        parts = [sums(rows) for rows in row_chunks(n, k, PASS_CHUNK_ELEMENTS)]
    else:
        parts = map_chunks(sums, n, k, PASS_CHUNK_ELEMENTS)
    total = np.sum(parts, axis=0) / n
    return _Pass(*map(float, total))


def _finite(r: _Pass) -> bool:
    return all(math.isfinite(v) for v in (r.nll, r.grad, r.var, r.skew, r.entropy, r.spread))


class _Float32Overflow(ArithmeticError):
    """A float32 pass gave a non-finite sum: the start falls back to float64."""


class _BeyondScale(ArithmeticError):
    """A pass over every row is not finite, or its spread is more than
    ``2**SAMPLE_SCALE`` times that of the subsample (or less than its inverse): rows
    outside the subsample reach beyond the scale and the bracket taken from it, so
    the fit starts again from every row."""


def _taylor(r: _Pass, beta: float, d: float) -> _Pass:
    """The pass at ``beta + d`` from the one at ``beta``, by Taylor expansion in ``d``
    (exact to O(d**3) for the gradient, O(d**4) for the NLL; ``skew`` is kept)."""
    return _Pass(
        nll=r.nll + d * (r.grad + d * (r.var / 2 + d * r.skew / 6)),
        grad=r.grad + d * (r.var + d * r.skew / 2),
        var=r.var + d * r.skew,
        skew=r.skew,
        entropy=r.entropy - d * (beta * r.var + d * (r.var + beta * r.skew) / 2),
        spread=r.spread,
    )


def _next(x: float, value: float, deriv: float, second: float, lo: float, hi: float):
    """``(x_new, newton)``: a Halley step from ``x`` when its denominator is sound, else a
    Newton step; a geometric bisection of ``(lo, hi)`` (``newton`` False) when the step
    leaves it."""
    x_new = math.nan
    if deriv != 0 and math.isfinite(deriv):
        x_new = x - value / deriv
        denominator = 2.0 * deriv * deriv - value * second
        if math.isfinite(second) and denominator > deriv * deriv:
            x_new = x - 2.0 * value * deriv / denominator
    if not (lo < x_new < hi):
        return math.sqrt(lo * hi), False
    return x_new, True


def safeguarded_newton(f, lo, hi, x, *, tol, max_passes, increasing, first=None,
                        last_step=None, extrapolate=None):
    """Root of a monotone ``f`` in ``[lo, hi]`` by Halley/Newton steps with bisection fallback.

    ``f(x)`` returns ``(value, derivative, second_derivative, extra)``; ``first``, when
    given, is its value at the start ``x``, already computed. A Halley step (cubic
    convergence: the relative error e becomes O(e**3), where a Newton step gives
    O(e**2), so fewer passes over the data) is taken when its denominator is sound,
    else a Newton step; a step that leaves the bracket is replaced by a geometric
    bisection.

    With ``extrapolate`` (``extra`` at ``x + d`` from ``extra`` at ``x``), a last Halley
    step is taken without evaluating ``f`` again when it is at most ``FINAL_STEP``
    (relative) and either ``|value| < tol`` already, or the convergence seen so far,
    ``C = step / last_step**3`` with ``last_step`` the relative size of the step before
    (an argument for the first), predicts the error left after it, ``C * step**3``, at
    most ``PREDICTED_ERROR``: below float64's resolution, so another pass would only
    confirm it. The value and ``extra`` returned are then extrapolated to the new
    ``x``, and reason is "extrapolated".

    Returns ``(x, value, extra, passes, reason)``; reason is "converged",
    "extrapolated", "max_passes" or "bound".
    """
    sign = 1.0 if increasing else -1.0
    passes = 0
    while True:
        value, deriv, second, extra = first if first is not None and passes == 0 else f(x)
        passes += 1
        converged = abs(value) < tol
        if sign * value > 0:
            hi = x
        else:
            lo = x
        if not converged and passes >= max_passes:
            return x, value, extra, passes, "max_passes"
        if not converged and hi / lo <= 1 + 1e-15:
            return x, value, extra, passes, "bound"
        x_new, newton = _next(x, value, deriv, second, lo, hi)
        step = abs(x_new - x) / x
        if (extrapolate is not None and newton and step <= FINAL_STEP and (
                converged or (last_step and step * (step / last_step)**3 <= PREDICTED_ERROR))):
            d = x_new - x
            return (x_new, value + d * (deriv + d * second / 2), extrapolate(extra, x, d),
                    passes, "extrapolated")
        if converged:
            return x, value, extra, passes, "converged"
        last_step = step if newton else None
        x = x_new


class TemperatureScaler(LinearSoftmax):
    """Temperature scaling ``softmax(beta * z)`` with the exact optimal ``beta``.

    Parameters
    ----------
    target_entropy : float, optional
        Instead of minimising the mean NLL, choose the ``beta`` whose mean
        predictive entropy (nats) equals this value, in ``(0, log K)``. Such a fit
        needs no labels (``fit(scores)``).
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
        ``passes`` (float64 passes over every row), ``reason`` ("converged",
        "max_passes" or "bound"), ``extrapolated`` (the last step was taken
        without a pass after it: ``gradient``, ``nll`` and ``entropy`` are then
        the last pass's Taylor expansions at ``beta_``), ``gradient``
        (dNLL/dbeta at ``beta_``), ``relative_gradient``, ``nll``, ``entropy``,
        ``scale``, ``temperature``, ``rescale_exponent`` (the ``m`` of the logits'
        rescale by ``2**m``, 0 for probabilities); the start's ``start_rows``,
        ``start_passes``, ``start_dtype`` and ``float32_passes`` (over every row).

    Notes
    -----
    When every label is its row's top class the NLL decreases for ever in ``beta``:
    the fit stops at the finite ``beta`` where the gradient falls below ``tol``
    (relative to the logits' spread), or at the bracket's end ``1e8`` over the
    spread (reason "bound"); ``predict_proba`` is then nearly one-hot, without NaN.
    Constant rows (a flat NLL) keep ``beta = 1``. Logits for which the ``beta``
    found is not a normal float64 raise :class:`CalibrationInputError`.

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

        * bytes = ``chunk_bytes(3, K)`` for chunks of ``PASS_CHUNK_ELEMENTS``
          entries (per thread: one row chunk as float64
          logits, its exponentials, and for float64 logits rescaled for a float32
          pass a float64 copy of the chunk) ``+ 8 K`` (a vector of ones) ``+ 32 N``
          (labels and per-row checks).
        * flops = ``SWEEP_FLOPS * K * (passes * N + 8 * rows_s)``, counting every
          pass as a float64 one (an upper bound: a float32 pass costs about a
          third): 4 passes over the N rows (one float32, one or two float64, and
          room) after a start solved on the ``rows_s`` rows of the strided
          subsample (N > 2 * ``SUBSAMPLE_ROWS``), else 8 passes and no subsample.
        """
        n, k = n_samples, n_classes
        subsample = n > 2 * SUBSAMPLE_ROWS > 0
        rows_s = -(-n // (n // SUBSAMPLE_ROWS)) if subsample else 0
        passes = 4 if subsample else 8
        return Cost(
            bytes=chunk_bytes(3, n_classes=k, elements=PASS_CHUNK_ELEMENTS)
            + FLOAT64 * (k + 4 * n),
            flops=float(SWEEP_FLOPS) * k * (passes * n + 8 * rows_s),
        )

    @classmethod
    def needs_labels(cls, options) -> bool:
        """Only the NLL needs labels: a target entropy is a property of the scores."""
        return options["target_entropy"] is None

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
        if SUBSAMPLE_ROWS and n > 2 * SUBSAMPLE_ROWS:
            # Every step-th row, a view: the start costs no copy of the scores
            # (a copy of 8,192 rows is 8 GiB at K = 262,144).
            step = n // SUBSAMPLE_ROWS
            zs, ys = z[::step], None if y is None else y[::step]
        else:
            zs, ys = z, y
        # The scale of the subsample's rows; every row (for the scale and the start)
        # when those are constant, or when a pass over every row shows rows beyond
        # that scale.
        exponent = _exponent(zs, kind)
        if exponent is None and zs is not z:
            zs, ys = z, y
            exponent = _exponent(z, kind)
        try:
            beta, r, passes, reason, start = self._search(z, y, zs, ys, kind, exponent or 0,
                                                          options, progress)
        except _BeyondScale:
            exponent = _exponent(z, kind)
            beta, r, passes, reason, start = self._search(z, y, z, y, kind, exponent,
                                                          options, progress)
        exponent = exponent or 0
        with np.errstate(over="ignore"):  # (refused below)
            weight, scale = np.ldexp([beta, r.spread], [exponent, -exponent])
        if not (sys.float_info.min <= weight and math.isfinite(weight * scale)):
            raise CalibrationInputError(
                "temperature scaling of these logits needs an inverse temperature or a "
                "scale beyond float64's normal range [2**-1022, 2**1024): their within-row "
                f"differences reach 2**{-exponent} (give logits of a moderate scale, or "
                f"probabilities). Got beta = {beta!r} * 2**{exponent}."
            )
        self.weight_ = float(weight)
        progress(1.0)
        info = self._info(r, beta, exponent, passes, reason, target, labelled=y is not None)
        info.update(start)
        return info

    def _search(self, z, y, zs, ys, kind: str, exponent: int, options: dict,
                progress: Progress):
        """``(beta, last pass, passes, reason, start info)`` for the logits times
        ``2**exponent`` (``beta`` in their units); raises _BeyondScale when a float64
        pass over every row is not finite."""
        target = options["target_entropy"]
        # The start: the root for a strided subsample (every row when n is small),
        # in float32, where a pass costs about a third of a float64 one. Then, for a
        # subsample, one float32 pass over every row and its Halley step; then the
        # float64 passes over every row, the last step usually extrapolated (see
        # safeguarded_newton): float32's rounding only moves the start, the root
        # is float64's.
        start_dtype = np.float32
        first = _pass(zs, ys, kind, 1.0, np.float32, exponent)
        if not (first.spread > 0.0 and _finite(first)):
            # Rows that differ only below float32's resolution, or logits beyond its
            # range: the start in float64, as the rest.
            start_dtype = np.float64
            first = _pass(zs, ys, kind, 1.0, exponent=exponent)
        if first.spread == 0.0:
            if target is not None:
                raise CalibrationInputError(
                    "target_entropy needs scores that vary within rows: every row is constant, "
                    "so the entropy is log K at any temperature. Got constant scores."
                )
            # Every beta gives the same (uniform) prediction: keep beta = 1.
            return 1.0, first, 1, "converged", {}
        lo, hi = BETA_MIN / first.spread, BETA_MAX / first.spread
        tol = options["tol"]
        max_passes = options["max_passes"]

        if target is None:
            # dNLL/dbeta and its derivatives, in units of the logits' spread (so
            # the tolerance is relative to the scale of the logits).
            def g(r, beta):
                return r.grad / r.spread, r.var / r.spread, r.skew / r.spread, r
            increasing = True
        else:
            def g(r, beta):
                # d2H/dbeta2 = -Var - beta * dVar/dbeta
                return r.entropy - target, -beta * r.var, -r.var - beta * r.skew, r
            increasing = False

        def f(beta, zz=z, yy=y, dtype=np.float64):
            r = _pass(zz, yy, kind, beta, dtype, exponent)
            if zz is not zs and not (_finite(r) and abs(math.log2(r.spread / first.spread))
                                     <= SAMPLE_SCALE):
                raise _BeyondScale  # rows beyond the subsample's scale (and bracket)
            if not _finite(r):  # float32's range
                raise _Float32Overflow
            return g(r, beta)

        def start(dtype, first):
            """The root for the subsample (or every row) in ``dtype``; after a float32
            subsample, a Halley step from one float32 pass over every row."""
            beta0, _, _, passes, _ = safeguarded_newton(
                lambda beta: f(beta, zs, ys, dtype), lo, hi, 1.0, tol=START_TOL,
                max_passes=max_passes, increasing=increasing, first=first,
            )
            last_step, full = None, 0
            if dtype == np.float32 and zs is not z:
                full = 1
                value, deriv, second, _ = f(beta0, z, y, np.float32)
                beta1, newton = _next(beta0, value, deriv, second, lo, hi)
                if newton:  # (else the float64 passes start at the subsample's root)
                    beta0, last_step = beta1, abs(beta1 - beta0) / beta0
            return beta0, last_step, passes, full

        try:
            beta0, last_step, start_passes, float32_passes = start(
                start_dtype, g(first, 1.0))
        except _Float32Overflow:
            start_dtype = np.float64
            beta0, last_step, start_passes, float32_passes = start(np.float64, None)
        progress(0.2)
        beta, value, r, passes, reason = safeguarded_newton(
            f, lo, hi, beta0, tol=tol, max_passes=max_passes, increasing=increasing,
            last_step=last_step, extrapolate=_taylor,
        )
        if target is not None and reason == "bound" and abs(value) > 1e-6:
            raise CalibrationInputError(
                f"target_entropy {target!r} is not reachable: the mean entropy only goes down to "
                f"{r.entropy:.6g} nats (rows with tied top scores). Got {target!r}."
            )
        return beta, r, passes, reason, {
            "float32_passes": float32_passes,
            "start_rows": int(zs.shape[0]),
            "start_passes": start_passes,
            "start_dtype": np.dtype(start_dtype).name,
        }

    @staticmethod
    def _info(r: _Pass, beta, exponent, passes, reason, target, *, labelled: bool) -> dict:
        """fit_info_ from the last pass ``r`` at ``beta``, both for the logits times
        ``2**exponent``: the gradient and scale are given back in the logits' units.
        Without labels the NLL and its gradient are None (there is no NLL)."""
        scale = math.ldexp(r.spread, -exponent)
        info = {
            "objective": "nll" if target is None else "target_entropy",
            "passes": passes,
            "reason": "converged" if reason == "extrapolated" else reason,
            "extrapolated": reason == "extrapolated",
            "gradient": math.ldexp(r.grad, -exponent),
            "relative_gradient": r.grad / r.spread if r.spread else 0.0,
            "nll": r.nll,
            "entropy": r.entropy,
            "scale": scale,
            "temperature": 1.0 / math.ldexp(beta, exponent),
            "rescale_exponent": exponent,
        }
        if not labelled:
            info.update(gradient=None, relative_gradient=None, nll=None)
        return info
