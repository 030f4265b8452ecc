"""Entropy-targeted temperature per row: every row its own ``beta`` for one entropy.

Temperature scaling with a ``target_entropy`` gives every row the same ``beta``, so that
the *mean* entropy hits the target while single rows stay as peaked or as flat as they
were. This map gives each row ``i`` its own ``beta_i > 0``, so that *its* entropy is the
target: ``u_i = beta_i * z_i``. Each ``beta_i`` depends only on the row's distribution,
so it is computed again for every row served (the map is nonlinear), and since
``beta_i > 0`` the order of the classes within a row, hence every argmax, is kept.
Tempering is also the KL projection: among the distributions of a given entropy,
``softmax(beta * z)`` is the one closest to ``softmax(z)`` in ``KL(q || p)`` (Lagrange:
``log q = log p + lambda * log q + c`` gives ``q`` proportional to ``p**beta``).

The solve, per row, vectorised over rows. With ``x = (z - max z) / (max z - min z)``
(in ``[-1, 0]``, 0 for a constant row) and ``beta`` in the units of ``x``,

* ``H(beta) = log S - beta * E[x]``, ``S = sum exp(beta * x)``, the expectation under
  ``p = exp(beta * x) / S``; ``dH/dt = -beta**2 * Var[x]`` in ``t = log beta``, so ``H``
  falls strictly from ``log K`` (``beta -> 0``) to ``log m`` (``beta -> inf``; ``m`` the
  row's number of classes tied for first) wherever the row is not constant;
* ``Var[x] <= 1/4`` on an interval of width 1, so ``H(beta) >= log K - beta**2 / 8``:
  ``t_lo = log sqrt(8 (log K - h))`` is a proven lower end of the bracket of the root;
  the upper end starts at :data:`T_MAX` (``beta = e**48``: past the root of every row
  whose target is reachable, since the smallest gap between distinct entries of ``x``
  is about ``2**-54`` in float64);
* the start is the root of the small-``beta`` expansion ``H ~ log K - beta**2 Var_0 / 2``
  (``Var_0`` the variance of ``x`` over the classes), inside the bracket;
* :data:`STEPS` safeguarded Newton steps in ``t``: a step that leaves the bracket
  ``(lo, hi)`` becomes ``min((lo + hi) / 2, lo + JUMP)``: a bisection once ``hi`` is a
  point where the entropy is below the target, a jump of at most ``JUMP`` in ``t``
  while it is not.

The number of steps is fixed (the same in numpy, ONNX and torch, so the three paths
compute the same thing and the graph unrolls them): tests check that after
:data:`STEPS` steps every row whose target is reachable is within ``1e-9`` nats of it,
on profiles from near-uniform rows to gaps of ``1e-12`` between the top two classes
and a target ``1e-12`` below ``log K`` (``tests/calibrators/methods/test_row_entropy.py``).
A row whose entropy cannot fall to the target (its top ``m`` classes tied and the
target at most ``log m``, a constant row) ends at ``beta = e**T_MAX``: uniform over its
tied top classes, the nearest it can come. A target of at least ``log K`` gives
``beta = e**T_MIN``, uniform rows.

Every step is a few passes over the rows' K entries, all in float64 (the exponential
too: the root is float64's, 1e-9 nats needs more than float32's ``exp``), so this map
costs about ``6 * STEPS`` passes where temperature scaling costs one: it is for
distributions whose entropy matters (sampling, distillation), not a cheap calibrator.

The ONNX graph (and the torch module) run the same :data:`STEPS` steps in float64,
``Exp`` included, so their calibrated logits are the numpy path's up to rounding; the
graph promises what every graph here promises of its float32 outputs, agreement with
the numpy path to 1e-6, and so an ``entropy`` output within 1e-6 nats of the target
on every reachable row (tested, as the 1e-9 nats of the float64 path).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from calibrators.base import Calibrator, Progress
from calibrators.cost import FLOAT64, Cost, chunk_bytes
from calibrators.numerics import row_chunks, softmax
from calibrators.options import Positive
from calibrators.validation import CalibrationInputError, as_scores, logits64

if TYPE_CHECKING:
    from calibrators.onnx_export import GraphBuilder

#: Newton steps per row (unrolled in the ONNX graph).
STEPS = 32
#: Bounds of ``t = log beta`` (``beta`` in units of the row's spread).
T_MIN = -40.0
T_MAX = 48.0
#: The largest step in ``t`` while no upper end of the bracket is known.
JUMP = 6.0


def _entropy_terms(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(H, dH/dt)`` per row of ``x`` (max 0 per row) at ``beta = exp(t)`` (N,)."""
    beta = np.exp(t)[:, None]
    e = np.exp(beta * x)
    s = e.sum(axis=1)
    mean = (e * x).sum(axis=1) / s
    d = x - mean[:, None]
    var = (e * d * d).sum(axis=1) / s
    return np.log(s) - beta[:, 0] * mean, -np.exp(2 * t) * var


def _scaled(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, width)``: float64 logits shifted to max 0 and divided by their spread."""
    c = z - z.max(axis=1, keepdims=True)
    spread = -c.min(axis=1)
    width = np.where(spread > 0, spread, 1.0)
    return c / width[:, None], width


def _start(x: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(t, lo)``: the start and the proven lower end of the bracket (module docstring)."""
    k = x.shape[1]
    gap = np.maximum(math.log(k) - target, 0.0)
    lo = np.clip(0.5 * np.log(8.0 * np.maximum(gap, 1e-300)), T_MIN, T_MAX)
    var0 = x.var(axis=1)
    with np.errstate(divide="ignore"):
        t = 0.5 * np.log(2.0 * gap / np.where(var0 > 0, var0, np.inf))
    return np.clip(np.nan_to_num(t, nan=T_MIN, neginf=T_MIN), lo, T_MAX), lo


def _step(x, target, t, lo, hi, n_lo, n_hi):
    """One safeguarded Newton step in ``t``: ``(t, lo, hi, n_lo, n_hi)``, ``n_lo`` and
    ``n_hi`` the Newton points from the bracket's ends (module docstring)."""
    h, dh = _entropy_terms(x, t)
    f = h - target
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        newton = t - f / dh
    above = f > 0
    lo, n_lo = np.where(above, t, lo), np.where(above, newton, n_lo)
    hi, n_hi = np.where(above, hi, t), np.where(above, n_hi, newton)
    other = np.where(above, n_hi, n_lo)
    fallback = np.minimum(0.5 * (lo + hi), lo + JUMP)
    # The other end's Newton point strictly inside (it may be where t already is); the
    # fresh one in the closed bracket (a converged row's is its own t, now an end).
    t = np.where((other > lo) & (other < hi), other, fallback)
    return np.where((newton >= lo) & (newton <= hi), newton, t), lo, hi, n_lo, n_hi


def row_log_betas(z: np.ndarray, target) -> np.ndarray:
    """``log beta_i`` per row of float64 logits ``z`` (in units of the row's spread),
    after :data:`STEPS` steps, for ``target`` (a float, or one per row)."""
    x, _ = _scaled(z)
    target = np.broadcast_to(np.asarray(target, dtype=np.float64), (z.shape[0],))
    t, lo = _start(x, target)
    state = [t, lo, np.full_like(t, T_MAX), np.full_like(t, np.nan), np.full_like(t, np.nan)]
    # A row whose step leaves t where it was is at a fixed point of the step (it would
    # evaluate the same t again, and set the same ends): it leaves the loop with the t
    # every later step would give it, so the graph's unrolled steps agree exactly.
    rows = np.arange(z.shape[0])
    for _ in range(STEPS):
        if rows.size == 0:
            break
        before = state[0][rows]
        moved = _step(x[rows], target[rows], before, *(v[rows] for v in state[1:]))
        for v, new in zip(state, moved, strict=True):
            v[rows] = new
        rows = rows[moved[0] != before]
    return state[0]


def row_tempered_logits(z: np.ndarray, target) -> np.ndarray:
    """``beta_i * (z_i - max z_i)`` per row of float64 logits ``z``: the calibrated logits
    whose row entropies are ``target`` (a float, or one per row)."""
    x, _ = _scaled(z)
    return np.exp(row_log_betas(z, target))[:, None] * x


def row_temperatures(scores, target, *, kind: str = "logits") -> np.ndarray:
    """The temperature ``1 / beta_i`` of each row for which its entropy is ``target``.

    Parameters
    ----------
    scores : array-like of shape (n_samples, n_classes)
        Logits, or probabilities with ``kind="probabilities"``.
    target : float or array-like of shape (n_samples,)
        Entropy in nats, one for every row or one per row (a teacher softened to a
        different entropy per position, for example).
    kind : {"logits", "probabilities"}

    Returns
    -------
    ndarray of shape (n_samples,)
        Temperatures of the logits as given (``softmax(z_i / T_i)`` has entropy
        ``target_i``); ``inf`` where the target is at least ``log K``, 0 where the row
        cannot reach it (see the module docstring).

    Examples
    --------
    >>> z = np.array([[2.0, 1.0, 0.0], [5.0, 0.0, 0.0]])
    >>> t = row_temperatures(z, 0.5)
    >>> from calibrators.numerics import softmax
    >>> p = softmax(z / t[:, None])
    >>> np.round(-(p * np.log(p)).sum(axis=1), 12).tolist()
    [0.5, 0.5]
    """
    x = as_scores(scores, kind)
    z = logits64(x, kind)
    target = np.asarray(target, dtype=np.float64)
    if target.ndim not in (0, 1) or (target.ndim == 1 and target.shape != (z.shape[0],)):
        raise CalibrationInputError(
            f"target must be a float or one float per row ({z.shape[0]}). "
            f"Got shape {target.shape}."
        )
    if not np.all(np.isfinite(target) & (target > 0)):
        raise CalibrationInputError("target must be positive and finite (nats). Got others.")
    _, width = _scaled(z)
    t = row_log_betas(z, target)
    with np.errstate(over="ignore"):
        temperature = width * np.exp(-t)
    reached = np.where(t >= T_MAX, 0.0, temperature)
    return np.where(t <= T_MIN, np.inf, reached)


class RowEntropyTemperature(Calibrator):
    """A temperature per row, chosen so that every row's entropy is one target.

    ``u_i = beta_i * z_i`` with ``beta_i > 0`` solving ``H(softmax(beta_i z_i)) = h``
    (module docstring): an order-preserving, nonlinear map that learns nothing from
    labels. Where temperature scaling with ``target_entropy`` fixes the mean entropy,
    this fixes every row's: the diversity of sampling at every position, or a
    distillation teacher softened to the same entropy everywhere.

    Parameters
    ----------
    target_entropy : float, optional
        The entropy of every row, in nats, in ``(0, log K)``. None: the fit takes the
        mean entropy of the rows it is given (every row then has the average entropy
        of the data).

    Attributes
    ----------
    target_ : float
        The target used (the option, or the fit rows' mean entropy).
    fit_info_ : dict
        ``target``; the fit rows' entropy before (``entropy_before``: mean, p5,
        median, p95); after, the largest distance to the target (``max_error``) over
        the rows that can reach it, and the number that cannot (``unreachable_rows``:
        their top classes tied, the target at most the log of their number).

    Notes
    -----
    One target for all rows, not one per row: a served calibrator maps rows it has not
    seen, so a per-row target would have to come with every request. Per-row targets
    are :func:`row_temperatures`. The same target for every row is also what the two
    uses need: a fixed diversity of sampling, a teacher of a fixed entropy.

    Examples
    --------
    >>> z = np.array([[4.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    >>> cal = RowEntropyTemperature(target_entropy=0.6).fit(z)
    >>> cal.fit_info_["unreachable_rows"]  # the last: two classes tied for first, 0.6 < log 2
    1
    >>> p = cal.predict_proba(z[:3])
    >>> np.round(-(p * np.log(p)).sum(axis=1), 12).tolist()
    [0.6, 0.6, 0.6]
    >>> (p.argmax(axis=1) == z[:3].argmax(axis=1)).all()
    np.True_
    """

    method = "row-entropy"
    preserves_argmax = True
    learns_from_labels = False
    onnx_graph_name = "row_entropy_temperature"
    option_checks: ClassVar[dict] = {"target_entropy": Positive(allow_none=True)}
    fitted_arrays: ClassVar[dict] = {"target": ()}

    def __init__(self, *, target_entropy: float | None = None):
        self.target_entropy = target_entropy

    @classmethod
    def needs_labels(cls, options) -> bool:
        """Never: the target is an entropy, a property of the scores."""
        return False

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options) -> Cost:
        """Memory and work of the fit: the per-row solve on row chunks, one at a time.

        * bytes = ``chunk_bytes(10, K, threads=1)`` (a chunk's logits, scaled logits and
          the step's temporaries, in float64) ``+ 32 N`` (per-row entropies and flags).
        * flops = ``12 * (STEPS + 2) * N * K`` (an exponential and five products or
          sums per entry and step, twice: the entropies after, and the step's).
        """
        return Cost(
            bytes=chunk_bytes(10, n_classes=n_classes, threads=1) + 4 * FLOAT64 * n_samples,
            flops=12.0 * (STEPS + 2) * n_samples * n_classes,
        )

    def _fit(self, x, y, *, kind: str, options: dict, progress: Progress) -> dict:
        k = x.shape[1]
        before = _entropies(x, lambda block: logits64(block, kind))
        target = options["target_entropy"]
        if target is None:
            target = float(before.mean())
        if not 0 < target < math.log(k):
            raise CalibrationInputError(
                f"target_entropy must lie in (0, log K) = (0, {math.log(k):.6g}) nats for "
                f"K = {k}. Got {target!r}."
            )
        self.target_ = float(target)
        after = _entropies(x, lambda block: self._forward(logits64(block, kind)))
        reachable = _reachable(x, kind, self.target_)
        progress(1.0)
        p5, median, p95 = np.quantile(before, [0.05, 0.5, 0.95]).tolist()
        return {
            "target": self.target_,
            "entropy_before": {"mean": float(before.mean()), "p5": p5, "median": median,
                               "p95": p95},
            "max_error": float(np.max(np.abs(after - self.target_)[reachable], initial=0.0)),
            "unreachable_rows": int(np.count_nonzero(~reachable)),
        }

    def _load_params(self, params) -> None:
        super()._load_params(params)
        if not 0 < self.target_ < math.log(self.n_classes_):
            raise CalibrationInputError(
                f"params target for {self.method} must lie in (0, log K) = "
                f"(0, {math.log(self.n_classes_):.6g}) nats. Got {self.target_!r}."
            )

    def _forward(self, z: np.ndarray) -> np.ndarray:
        return row_tempered_logits(z, self.target_)

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        """The steps of :func:`row_log_betas`, unrolled (:data:`STEPS` of them)."""
        k = graph.n_classes
        axis = graph.constant(np.array([1], dtype=np.int64), "rows_axis")

        def node(op, *inputs, hint=None, **attributes):
            return graph.node(op, list(inputs), hint, **attributes)

        def const(value, hint):
            return graph.constant(value, hint)

        def row_sum(v, hint):
            return node("ReduceSum", v, axis, hint=hint, keepdims=0)

        def column(v, hint):
            return node("Unsqueeze", v, axis, hint=hint)

        # x = (z - max z) / width, width = the spread (1 for a constant row).
        c = node("Sub", z, node("ReduceMax", z, hint="z_max", axes=[1], keepdims=1), hint="c")
        spread = node("Neg", node("ReduceMin", c, hint="c_min", axes=[1], keepdims=1),
                      hint="spread")
        zero, one = const(0.0, "zero"), const(1.0, "one")
        width = node("Where", node("Greater", spread, zero, hint="varies"), spread, one,
                     hint="width")
        x = node("Div", c, width, hint="x")
        target = const(self.target_, "target")
        # The start and the bracket's proven lower end (see _start).
        gap = node("Max", node("Sub", const(math.log(k), "log_k"), target, hint="gap_raw"),
                   zero, hint="gap")
        half = const(0.5, "half")
        t_min, t_max = const(T_MIN, "t_min"), const(T_MAX, "t_max")
        lo = node("Mul", half, node("Log", node("Mul", const(8.0, "eight"), node(
            "Max", gap, const(1e-300, "tiny"), hint="gap_pos"), hint="gap_8"), hint="log_8gap"),
            hint="lo_raw")
        lo = node("Min", node("Max", lo, t_min, hint="lo_low"), t_max, hint="lo")
        x_mean = node("ReduceMean", x, hint="x_mean", axes=[1], keepdims=1)
        x_dev = node("Sub", x, x_mean, hint="x_dev")
        var0 = node("ReduceMean", node("Mul", x_dev, x_dev, hint="x_dev2"), hint="var0",
                    axes=[1], keepdims=0)
        # log(2 gap / var0), with var0 = 0 (a constant row) and gap = 0 giving t_min.
        ratio = node("Div", node("Mul", const(2.0, "two"), gap, hint="gap_2"),
                     node("Where", node("Greater", var0, zero, hint="var0_pos"), var0,
                          const(np.inf, "inf"), hint="var0_safe"), hint="ratio")
        t = node("Mul", half, node("Log", node("Max", ratio, const(1e-300, "tiny_ratio"),
                                               hint="ratio_pos"), hint="log_ratio"),
                 hint="t_raw")
        t = node("Min", node("Max", t, lo, hint="t_low"), t_max, hint="t0")
        t_zero = node("Mul", t, zero, hint="t_zero")
        hi = node("Add", t_zero, t_max, hint="hi0")
        n_lo = n_hi = node("Add", t_zero, const(np.nan, "nan"), hint="n0")
        jump = const(JUMP, "jump")

        def inside(v, lo, hi, closed):
            past, before = ("GreaterOrEqual", "LessOrEqual") if closed else ("Greater", "Less")
            return node("And", node(past, v, lo, hint="past_lo"),
                        node(before, v, hi, hint="before_hi"), hint="inside")

        for _ in range(STEPS):
            beta = node("Exp", t, hint="beta")
            e = node("Exp", node("Mul", x, column(beta, "beta_col"), hint="bx"), hint="e")
            s = row_sum(e, "s")
            mean = node("Div", row_sum(node("Mul", e, x, hint="ex"), "sum_ex"), s, hint="mean")
            d = node("Sub", x, column(mean, "mean_col"), hint="d")
            var = node("Div", row_sum(node("Mul", e, node("Mul", d, d, hint="d2"), hint="ed2"),
                                      "sum_ed2"), s, hint="var")
            h = node("Sub", node("Log", s, hint="log_s"), node("Mul", beta, mean, hint="bm"),
                     hint="h")
            f = node("Sub", h, target, hint="f")
            dh = node("Neg", node("Mul", node("Mul", beta, beta, hint="b2"), var, hint="b2v"),
                      hint="dh")
            newton = node("Sub", t, node("Div", f, dh, hint="f_dh"), hint="newton")
            above = node("Greater", f, zero, hint="above")
            lo, n_lo = node("Where", above, t, lo, hint="lo"), node(
                "Where", above, newton, n_lo, hint="n_lo")
            hi, n_hi = node("Where", above, hi, t, hint="hi"), node(
                "Where", above, n_hi, newton, hint="n_hi")
            other = node("Where", above, n_hi, n_lo, hint="other")
            fallback = node("Min", node("Mul", half, node("Add", lo, hi, hint="lo_hi"),
                                        hint="mid"), node("Add", lo, jump, hint="lo_jump"),
                            hint="fallback")
            t = node("Where", inside(other, lo, hi, False), other, fallback, hint="t_other")
            t = node("Where", inside(newton, lo, hi, True), newton, t, hint="t")
        return node("Mul", x, column(node("Exp", t, hint="beta"), "beta_col"), hint="u")



def _reachable(x: np.ndarray, kind: str, target: float) -> np.ndarray:
    """Whether each row's entropy can fall to ``target``: above ``log m``, ``m`` the
    number of classes tied for its first place."""
    out = np.empty(x.shape[0], dtype=bool)
    for rows in row_chunks(*x.shape):
        z = logits64(x[rows], kind)
        ties = np.count_nonzero(z == z.max(axis=1, keepdims=True), axis=1)
        out[rows] = target > np.log(ties)
    return out


def _entropies(x: np.ndarray, logits) -> np.ndarray:
    """The entropy (nats) of ``softmax(logits(block))`` for each row of ``x``."""
    out = np.empty(x.shape[0])
    for rows in row_chunks(*x.shape):
        p = softmax(logits(x[rows]))
        out[rows] = -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=1)
    return out
