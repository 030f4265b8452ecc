"""Has live calibration drifted from what was measured at fit time?

:func:`detect_drift` compares the top-label reliability of a *live* stream
(labelled feedback) with the *hold-out* reliability measured when the
calibrator was fitted, and says ``"ok"``, ``"drift"`` or ``"insufficient_data"``.
It needs only the equal-width bin statistics of both samples (see
:func:`calibrators.evaluation.metrics.bin_statistics`): no rows. Pure numpy; it knows
nothing of HTTP or SQL.

The test
--------
Write :math:`n_b`, :math:`s_b`, :math:`c_b` for the rows, confidence sum and
correct rows of bin :math:`b`, with a superscript :math:`H` (hold-out) or
:math:`L` (live), :math:`m_b = s_b / n_b` for the mean confidence and
:math:`\\mathrm{ECE} = \\sum_b |c_b - s_b| / N`.

Null hypothesis
    Live is calibrated as well as hold-out: in every bin both samples have the
    same calibration gap :math:`\\delta_b` (accuracy minus confidence), so a
    row of either sample in bin :math:`b` is correct with probability
    :math:`m_b + \\delta_b`. Only the *gap* is shared: the live stream may put
    its rows in other bins, or at other confidences within a bin, than the
    hold-out did (a change of the score distribution that calibration
    survives is not drift).
Statistic
    The excess :math:`T = \\mathrm{ECE}^L - \\mathrm{ECE}^H` (one-sided: only a
    *worse* live calibration is drift).
Null distribution (two-sample parametric bootstrap)
    The gap is estimated from both samples pooled, as a bootstrap under the
    null must: :math:`\\hat\\delta_b = (c^H_b + c^L_b - s^H_b - s^L_b) /
    (n^H_b + n^L_b)`. Each of ``n_resamples`` replicates draws
    :math:`c^{H*}_b \\sim \\mathrm{Binomial}(n^H_b, m^H_b + \\hat\\delta_b)`
    and :math:`c^{L*}_b \\sim \\mathrm{Binomial}(n^L_b, m^L_b + \\hat\\delta_b)`
    (probabilities clipped to [0, 1]) with the confidence sums kept, and
    computes :math:`T^*`. Resampling both samples accounts for the noise of
    the hold-out figure as well as the upward bias of a small live ECE.
Decision
    ``p_value`` is the Monte Carlo p-value :math:`(1 + \\#\\{T^* \\ge T\\}) /
    (B + 1)`. ``bound`` is the live ECE above which the verdict is
    ``"drift"``: :math:`\\mathrm{ECE}^H + T^*_{(k)}`, with :math:`T^*_{(k)}`
    the order statistic chosen so that ``live_ece > bound`` exactly when
    ``p_value < alpha`` (about the :math:`1 - \\alpha` quantile of
    :math:`T^*`). With fewer than ``min_count`` live rows the verdict is
    ``"insufficient_data"``: no guess, no bound.

Size: under the null the false-alarm rate is close to ``alpha`` for large live
windows and somewhat above it for small ones (the plug-in gap carries the
hold-out's noise). Resampling only the live sample against a fixed hold-out
ECE, the simpler alternative, is far too conservative. The simulated rates
are in ``bench/README.md``.

The random stream is ``numpy.random.default_rng(seed)``: the same inputs give
the same verdict, bound and p-value on every call, worker and replica.

References
----------
Efron and Tibshirani, "An Introduction to the Bootstrap", Chapman & Hall
1993, ch. 16 (bootstrap hypothesis tests: resample under the null, from the
pooled estimate). Guo, Pleiss, Sun and Weinberger, "On Calibration of Modern
Neural Networks", ICML 2017 (ECE).

Examples
--------
>>> hold = {"count": [0, 500, 500], "confidence_sum": [0.0, 300.0, 450.0],
...         "correct_count": [0, 300, 450]}
>>> live = {"count": [0, 400, 600], "confidence_sum": [0.0, 240.0, 560.0],
...         "correct_count": [0, 240, 420]}
>>> out = detect_drift(hold, live)
>>> out["verdict"], round(out["live_ece"], 6), out["p_value"] < 0.01
('drift', 0.14, True)
>>> detect_drift(hold, {"count": [0, 5, 5], "confidence_sum": [0.0, 3.0, 4.5],
...                     "correct_count": [0, 3, 4]})["verdict"]
'insufficient_data'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

import numpy as np

from calibrators.validation import (
    INT64_MAX,
    MAX_RESAMPLES,
    CalibrationInputError,
    check_integer,
)

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_MIN_COUNT",
    "DEFAULT_N_RESAMPLES",
    "METHOD",
    "VERDICTS",
    "as_bin_statistics",
    "detect_drift",
]

#: Possible values of ``detect_drift(...)["verdict"]``.
VERDICTS = ("ok", "drift", "insufficient_data")
#: Short name of the test, returned as ``method``.
METHOD = "parametric-bootstrap-ece-excess"
_DESCRIPTION = (
    "Two-sample parametric bootstrap of ECE(live) - ECE(hold-out) under the null "
    "hypothesis that both share the per-bin calibration gap (accuracy minus "
    "confidence), estimated from both samples pooled; correct counts per bin are "
    "drawn Binomial(n_b, mean confidence_b + gap_b). Verdict 'drift' when live_ece "
    "> bound, i.e. when p_value < alpha."
)
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_COUNT = 200
DEFAULT_N_RESAMPLES = 2000


def as_bin_statistics(bins: Mapping, name: str = "bins") -> dict:
    """Per-bin ``count``, ``confidence_sum`` and ``correct_count`` of either input form.

    Parameters
    ----------
    bins : mapping
        Either sufficient statistics (keys ``count``, ``confidence_sum``,
        ``correct_count``, as from :func:`calibrators.evaluation.metrics.bin_statistics`
        or summed over time buckets), or reliability-diagram bins (keys
        ``count``, ``mean_confidence``, ``accuracy``, ``None`` for an empty bin,
        as in ``calibrators.evaluation.metrics.report(...)["bins"]``). ``edges`` is
        optional in both.
    name : str
        Used in error messages.

    Returns
    -------
    dict
        ``count`` (int64), ``confidence_sum`` (float64), ``correct_count``
        (int64), each an ndarray of shape (n_bins,), and ``edges`` (float64
        ndarray of shape (n_bins + 1,), or None when not given). Correct
        counts recovered from ``accuracy`` are rounded to the nearest integer
        (exact: ``accuracy`` was ``correct / count``).

    Examples
    --------
    >>> stats = as_bin_statistics({"count": [0, 4], "mean_confidence": [None, 0.75],
    ...                            "accuracy": [None, 0.5]})
    >>> stats["confidence_sum"].tolist(), stats["correct_count"].tolist()
    ([0.0, 3.0], [0, 2])
    """
    if not isinstance(bins, Mapping):
        raise CalibrationInputError(f"{name} must be a mapping of per-bin lists. Got {bins!r}.")
    if "count" not in bins:
        raise CalibrationInputError(f"{name} must have a 'count' list. Got keys {sorted(bins)}.")
    count = np.asarray(bins["count"])
    if count.ndim != 1 or count.size == 0 or not np.issubdtype(count.dtype, np.integer):
        raise CalibrationInputError(
            f"{name}['count'] must be a non-empty list of integers. Got {bins['count']!r}."
        )
    if (count < 0).any():
        raise CalibrationInputError(f"{name}['count'] must be non-negative. Got {count.tolist()}.")
    count = count.astype(np.int64)

    def floats(key: str) -> np.ndarray:
        values = [0.0 if v is None else v for v in bins[key]]
        arr = np.asarray(values, dtype=np.float64)
        if arr.shape != count.shape or not np.isfinite(arr).all():
            raise CalibrationInputError(
                f"{name}[{key!r}] must have {count.size} finite entries (one per bin). "
                f"Got {bins[key]!r}."
            )
        return arr

    if "confidence_sum" in bins and "correct_count" in bins:
        confidence_sum = floats("confidence_sum")
        correct = floats("correct_count")
        if not np.array_equal(correct, np.round(correct)):
            raise CalibrationInputError(
                f"{name}['correct_count'] must be integers. Got {bins['correct_count']!r}."
            )
        correct_count = correct.astype(np.int64)
    elif "mean_confidence" in bins and "accuracy" in bins:
        confidence_sum = floats("mean_confidence") * count
        correct_count = np.rint(floats("accuracy") * count).astype(np.int64)
    else:
        raise CalibrationInputError(
            f"{name} must have either confidence_sum and correct_count, or mean_confidence "
            f"and accuracy. Got keys {sorted(bins)}."
        )
    if (correct_count < 0).any() or (correct_count > count).any():
        raise CalibrationInputError(
            f"{name}: correct counts must lie in [0, count] per bin. Got "
            f"{correct_count.tolist()} for counts {count.tolist()}."
        )
    slack = 1e-9 * np.maximum(count, 1)
    if (confidence_sum < -slack).any() or (confidence_sum > count * (1 + 1e-6) + slack).any():
        raise CalibrationInputError(
            f"{name}: confidence sums must lie in [0, count] per bin. Got "
            f"{confidence_sum.tolist()} for counts {count.tolist()}."
        )
    edges = None
    if bins.get("edges") is not None:
        edges = np.asarray(bins["edges"], dtype=np.float64)
        if edges.shape != (count.size + 1,):
            raise CalibrationInputError(
                f"{name}['edges'] must have n_bins + 1 = {count.size + 1} entries. "
                f"Got {edges.size}."
            )
    return {
        "count": count,
        "confidence_sum": confidence_sum,
        "correct_count": correct_count,
        "edges": edges,
    }


def _ece(count_total: int, correct, confidence_sum) -> np.ndarray:
    """ECE = sum_b |c_b - s_b| / N over the last axis."""
    return np.abs(correct - confidence_sum).sum(axis=-1) / count_total


def _critical_index(n_resamples: int, alpha: float) -> int:
    """Smallest k with  T > T*_(k)  <=>  (1 + #{T* >= T}) / (B + 1) < alpha.

    Exact rational arithmetic on the decimal value of ``alpha`` (0.05 is 1/20), so
    the bound and the p-value never disagree by one replicate at an integer edge.
    """
    level = Fraction(repr(float(alpha)))
    return math.floor(n_resamples - level * (n_resamples + 1)) + 1


def detect_drift(
    holdout: Mapping,
    live: Mapping,
    *,
    alpha: float = DEFAULT_ALPHA,
    min_count: int = DEFAULT_MIN_COUNT,
    n_resamples: int = DEFAULT_N_RESAMPLES,
    seed: int = 0,
) -> dict:
    """Verdict on live calibration against hold-out: ``"ok"``, ``"drift"`` or
    ``"insufficient_data"`` (the test is described in the module docstring).

    Parameters
    ----------
    holdout : mapping
        Equal-width bins of the hold-out sample measured at fit time: either
        ``calibrators.evaluation.metrics.report(...)["bins"]`` (``count``,
        ``mean_confidence``, ``accuracy``) or bin statistics (``count``,
        ``confidence_sum``, ``correct_count``); see :func:`as_bin_statistics`.
    live : mapping
        The same for the live (feedback) rows, usually bin statistics summed
        over the window's time buckets. Same number of bins (and the same
        ``edges``, when both give them) as ``holdout``.
    alpha : float, default 0.01
        Level of the one-sided test; more than ``1 / (n_resamples + 1)``.
    min_count : int, default 200
        Fewer live rows than this give ``"insufficient_data"``.
    n_resamples : int, default 2000
        Bootstrap replicates ``B``, 1 to 1,000,000 (``MAX_RESAMPLES``).
    seed : int, default 0
        Seed of ``numpy.random.default_rng``, 0 to ``2**63 - 1``.

    Returns
    -------
    dict
        JSON-serialisable (plain ints, floats, strings, ``None``):

        - ``verdict``: ``"ok"`` | ``"drift"`` | ``"insufficient_data"``;
        - ``method`` (short name, :data:`METHOD`) and ``description`` (one
          sentence); ``statistic``: ``"live_ece - holdout_ece"``;
        - ``alpha``, ``n_resamples``, ``seed``, ``min_count``, ``n_bins``;
        - ``live_ece`` (``None`` without live rows), ``holdout_ece``,
          ``n_live``, ``n_holdout``;
        - ``excess``: ``live_ece - holdout_ece`` (``None`` without live rows);
        - ``bound``: the live ECE above which the verdict is ``"drift"``;
        - ``p_value``: Monte Carlo p-value of the excess;
        - ``null_excess_mean``: mean of the excess under the null.

        ``bound``, ``p_value`` and ``null_excess_mean`` are ``None`` when the
        verdict is ``"insufficient_data"``.

    Raises
    ------
    CalibrationInputError
        Malformed bins, different numbers of bins or edges, an empty
        hold-out, or ``alpha`` outside ``(1 / (n_resamples + 1), 1)``.
    """
    min_count = check_integer("min_count", min_count, minimum=1, maximum=INT64_MAX)
    n_resamples = check_integer("n_resamples", n_resamples, minimum=1, maximum=MAX_RESAMPLES)
    seed = check_integer("seed", seed, minimum=0, maximum=INT64_MAX)
    if not (isinstance(alpha, float | int) and 1.0 / (n_resamples + 1) < alpha < 1.0):
        raise CalibrationInputError(
            f"alpha must lie in (1 / (n_resamples + 1), 1) = ({1.0 / (n_resamples + 1):.3g}, 1) "
            f"(a smaller alpha can never be reached with {n_resamples} resamples). Got {alpha!r}."
        )
    hold = as_bin_statistics(holdout, "holdout")
    liv = as_bin_statistics(live, "live")
    n_bins = hold["count"].size
    if liv["count"].size != n_bins:
        raise CalibrationInputError(
            f"holdout and live must have the same number of bins. Got {n_bins} and "
            f"{liv['count'].size}."
        )
    if (
        hold["edges"] is not None
        and liv["edges"] is not None
        and not np.allclose(hold["edges"], liv["edges"], rtol=0, atol=1e-12)
    ):
        raise CalibrationInputError(
            f"holdout and live must use the same bin edges. Got {hold['edges'].tolist()} and "
            f"{liv['edges'].tolist()}."
        )
    n_hold = int(hold["count"].sum())
    n_live = int(liv["count"].sum())
    if n_hold == 0:
        raise CalibrationInputError("holdout must have at least one row. Got 0.")

    holdout_ece = float(_ece(n_hold, hold["correct_count"], hold["confidence_sum"]))
    live_ece = float(_ece(n_live, liv["correct_count"], liv["confidence_sum"])) if n_live else None
    out = {
        "verdict": "insufficient_data",
        "method": METHOD,
        "description": _DESCRIPTION,
        "statistic": "live_ece - holdout_ece",
        "alpha": float(alpha),
        "n_resamples": n_resamples,
        "seed": int(seed),
        "min_count": int(min_count),
        "n_bins": int(n_bins),
        "live_ece": live_ece,
        "holdout_ece": holdout_ece,
        "n_live": n_live,
        "n_holdout": n_hold,
        "excess": None if live_ece is None else live_ece - holdout_ece,
        "bound": None,
        "p_value": None,
        "null_excess_mean": None,
    }
    if n_live < min_count:
        return out

    # Shared gap under the null, pooled over both samples (0 where neither has rows).
    pooled_n = hold["count"] + liv["count"]
    gap = np.divide(
        (hold["correct_count"] + liv["correct_count"])
        - (hold["confidence_sum"] + liv["confidence_sum"]),
        pooled_n,
        out=np.zeros(n_bins),
        where=pooled_n > 0,
    )

    def null_probability(stats: dict) -> np.ndarray:
        mean_conf = np.divide(
            stats["confidence_sum"],
            stats["count"],
            out=np.zeros(n_bins),
            where=stats["count"] > 0,
        )
        return np.clip(mean_conf + gap, 0.0, 1.0)

    rng = np.random.default_rng(seed)
    size = (n_resamples, n_bins)
    hold_star = rng.binomial(hold["count"], null_probability(hold), size=size)
    live_star = rng.binomial(liv["count"], null_probability(liv), size=size)
    excess_star = _ece(n_live, live_star, liv["confidence_sum"]) - _ece(
        n_hold, hold_star, hold["confidence_sum"]
    )
    excess = live_ece - holdout_ece
    critical = float(np.sort(excess_star)[_critical_index(n_resamples, alpha)])
    p_value = (1 + int(np.count_nonzero(excess_star >= excess))) / (n_resamples + 1)
    out.update(
        verdict="drift" if excess > critical else "ok",
        bound=holdout_ece + critical,
        p_value=p_value,
        null_excess_mean=float(excess_star.mean()),
    )
    return out
