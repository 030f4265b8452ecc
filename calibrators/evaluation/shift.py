"""Estimates from unlabelled rows: expected accuracy, and label shift.

Calibrated probabilities say how often their top label is right, so served rows
without labels already tell two things:

* **Expected accuracy** (:func:`expected_accuracy_from_sums`): the mean top-label
  confidence of a window, with a normal interval from the Poisson-binomial variance
  of the number of correct rows. It needs only the rows ``n``, the confidence sum
  and the sum of squared confidences: sums that add up across batches, workers and
  replicas, so a service can keep them per window without the rows.
* **Label shift** (Lipton, Wang and Smola 2018; Saerens, Latinne and Decaestecker
  2002): when the class frequencies change but each class looks the same
  (``p(x | y)`` fixed), the served predicted-class counts and the hold-out's joint
  confusion matrix of predicted against true class identify the new class priors
  (:func:`bbse`, black-box shift estimation: counts only); EM on calibrated
  probabilities (:func:`em_priors`) does it from the rows. :func:`shift_test` says
  whether the predicted-class frequencies moved at all, and :func:`correct_priors`
  gives the prior-corrected probabilities ``p'(y | x) ∝ p(y | x) w_y``.

Pure numpy and scipy; nothing here knows of HTTP or SQL.

References
----------
Lipton, Wang and Smola, "Detecting and Correcting for Label Shift with Black Box
Predictors", ICML 2018. Saerens, Latinne and Decaestecker, "Adjusting the Outputs of
a Classifier to New a Priori Probabilities: A Simple Procedure", Neural Computation
14(1), 2002.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from scipy.special import ndtri
from scipy.stats import chi2

from calibrators.evaluation.metrics import INTERVAL_LEVEL, check_level
from calibrators.numerics import row_chunks
from calibrators.validation import CalibrationInputError, as_labels, as_scores

#: The verdict's significance level (as the drift verdict's).
DEFAULT_ALPHA = 0.01
#: Fewer served rows than this give the verdict ``"insufficient_data"``.
DEFAULT_MIN_COUNT = 200
#: Smallest weight BBSE keeps: a class the solve sends negative is absent, not negative.
WEIGHT_FLOOR = 0.0


# ---------------------------------------------------------------------------
# expected accuracy


def _z(level: float) -> float:
    return float(ndtri(0.5 + check_level(level) / 2.0))


def expected_accuracy_from_sums(
    n: int, confidence_sum: float, confidence_sq_sum: float, *,
    holdout: Mapping[str, float] | None = None, level: float = INTERVAL_LEVEL,
) -> dict:
    """Expected accuracy of ``n`` calibrated rows, with a normal interval (higher is better).

    For calibrated rows the top label of row :math:`i` is right with probability
    :math:`c_i`, its confidence, so the number right is Poisson-binomial: mean
    :math:`\\sum_i c_i`, variance :math:`\\sum_i c_i (1 - c_i)`. The expected accuracy
    and its standard error are

    .. math::

        \\hat a = \\frac{1}{n}\\sum_i c_i, \\qquad
        \\sigma = \\frac{1}{n}\\sqrt{\\sum_i c_i - \\sum_i c_i^2},

    and the interval is :math:`\\hat a \\pm z\\sigma` clipped to [0, 1] (central limit
    theorem; :math:`z` the normal quantile of ``(1 + level) / 2``). It is an interval
    for the *realised* accuracy of these rows once their labels arrive, given their
    confidences, and it is only as right as the calibration: a drifted model misses
    it, which is the point of showing both. Three sums suffice (``n``,
    :math:`\\sum c`, :math:`\\sum c^2`), which add up across batches.

    With ``holdout`` (the calibrator's own hold-out: its rows :math:`m`, correct rows
    and confidence sum), the residual top-label bias it measured there,
    :math:`g = (\\text{correct} - \\sum c^H) / m`, is added to the estimate, and the
    variance of :math:`g`, bounded by :math:`a_H(1 - a_H)/m` (:math:`a_H` the hold-out
    accuracy; the Bernoulli variance is at least the Poisson-binomial one), to
    :math:`\\sigma^2`. A calibrator that minimised the NLL can leave a top-label bias
    of a point or two (temperature scaling on the CIFAR-100 outputs of ``../shared``:
    about -0.017), larger than the sampling interval of a few thousand rows; the
    hold-out measures it once, with its own noise counted.

    Parameters
    ----------
    n : int
        Rows (>= 0).
    confidence_sum : float
        :math:`\\sum_i c_i`.
    confidence_sq_sum : float
        :math:`\\sum_i c_i^2`.
    holdout : mapping, optional
        ``n`` (rows, >= 1), ``correct`` (rows whose top label was right) and
        ``confidence_sum`` of the calibrator's hold-out.
    level : float, default 0.95

    Returns
    -------
    dict
        ``estimate``, ``lower``, ``upper``, ``std`` (all None when ``n`` is 0),
        ``confidence`` (:math:`\\sum c / n`), ``holdout_gap`` (:math:`g`, or None), ``n``
        and ``level``.

    Examples
    --------
    >>> out = expected_accuracy_from_sums(100, 80.0, 66.0)
    >>> round(out["estimate"], 3), round(out["std"], 4), round(out["lower"], 3)
    (0.8, 0.0374, 0.727)
    """
    z = _z(level)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise CalibrationInputError(f"n must be an integer >= 0. Got {n!r}.")
    n = int(n)
    gap, gap_variance = _holdout_gap(holdout)
    out = {"n": n, "level": float(level), "holdout_gap": gap}
    if n == 0:
        return {**out, **dict.fromkeys(("estimate", "lower", "upper", "std", "confidence"))}
    s1, s2 = _checked_sums(n, confidence_sum, confidence_sq_sum)
    confidence = s1 / n
    estimate = min(max(confidence + (gap or 0.0), 0.0), 1.0)
    std = math.sqrt(max(s1 - s2, 0.0) / n**2 + gap_variance)
    return {
        **out,
        "estimate": estimate,
        "lower": max(estimate - z * std, 0.0),
        "upper": min(estimate + z * std, 1.0),
        "std": std,
        "confidence": confidence,
    }


def _checked_sums(n: int, confidence_sum, confidence_sq_sum) -> tuple[float, float]:
    s1, s2 = float(confidence_sum), float(confidence_sq_sum)
    # A little slack: float sums of float32 confidences may overshoot by rounding.
    slack = 1e-6 * n
    if not (math.isfinite(s1) and math.isfinite(s2)) or not (
        -slack <= s2 <= s1 + slack and s1 <= n + slack
    ):
        raise CalibrationInputError(
            "the sums must satisfy 0 <= sum c^2 <= sum c <= n (confidences in [0, 1]). "
            f"Got n={n}, sum c={s1!r}, sum c^2={s2!r}."
        )
    return s1, s2


def _holdout_gap(holdout: Mapping[str, float] | None) -> tuple[float | None, float]:
    """The hold-out's accuracy minus mean confidence, and its variance bound."""
    if holdout is None:
        return None, 0.0
    try:
        m, correct, total = (float(holdout[key]) for key in ("n", "correct", "confidence_sum"))
    except (KeyError, TypeError, ValueError):
        raise CalibrationInputError(
            f"holdout must have numbers n, correct and confidence_sum. Got {holdout!r}."
        ) from None
    if not (math.isfinite(m) and m >= 1 and 0 <= correct <= m and 0 <= total <= m):
        raise CalibrationInputError(
            "holdout must have n >= 1 and 0 <= correct, confidence_sum <= n. "
            f"Got {holdout!r}."
        )
    accuracy = correct / m
    return accuracy - total / m, accuracy * (1.0 - accuracy) / m


def confidence_sums(probs) -> tuple[int, float, float]:
    """``(n, sum c, sum c^2)`` of the top-label confidences of ``probs`` (row chunks,
    float64 sums): what :func:`expected_accuracy_from_sums` needs."""
    probs = as_scores(probs, "probabilities")
    n, k = probs.shape
    s1 = s2 = 0.0
    for rows in row_chunks(n, k):
        c = probs[rows].max(axis=1).astype(np.float64)
        s1 += float(c.sum())
        s2 += float(c @ c)
    return n, s1, s2


def expected_accuracy(
    probs, *, holdout: Mapping[str, float] | None = None, level: float = INTERVAL_LEVEL
) -> dict:
    """:func:`expected_accuracy_from_sums` of calibrated rows.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
        Calibrated probabilities.
    holdout : mapping, optional
        As for :func:`expected_accuracy_from_sums`: :func:`holdout_sums` of the
        calibrator's hold-out.
    level : float, default 0.95

    Examples
    --------
    >>> expected_accuracy([[0.9, 0.1], [0.3, 0.7]])["estimate"]
    0.8
    """
    return expected_accuracy_from_sums(*confidence_sums(probs), holdout=holdout, level=level)


def holdout_sums(probs, labels) -> dict:
    """``n``, ``correct`` and ``confidence_sum`` of labelled calibrated rows: the
    ``holdout`` argument of :func:`expected_accuracy_from_sums`.

    >>> holdout_sums([[0.9, 0.1], [0.3, 0.7]], [0, 0])
    {'n': 2, 'correct': 1, 'confidence_sum': 1.6}
    """
    probs = as_scores(probs, "probabilities")
    labels = as_labels(labels, probs.shape[0], probs.shape[1])
    n, total, _ = confidence_sums(probs)
    correct = int((probs.argmax(axis=1) == labels).sum())
    return {"n": n, "correct": correct, "confidence_sum": total}


# ---------------------------------------------------------------------------
# counts


def predicted_counts(probs, n_classes: int | None = None) -> np.ndarray:
    """Rows per predicted class (first argmax), int64 of shape (n_classes,)."""
    probs = as_scores(probs, "probabilities", n_classes=n_classes)
    n, k = probs.shape
    counts = np.zeros(k, dtype=np.int64)
    for rows in row_chunks(n, k):
        counts += np.bincount(probs[rows].argmax(axis=1), minlength=k)
    return counts


def confusion_counts(probs, labels) -> np.ndarray:
    """Rows per (predicted class, true class): int64 of shape (n_classes, n_classes),
    rows indexed by the prediction (first argmax), columns by the label.

    Examples
    --------
    >>> confusion_counts([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]], [0, 1, 1]).tolist()
    [[1, 1], [0, 1]]
    """
    probs = as_scores(probs, "probabilities")
    labels = as_labels(labels, probs.shape[0], probs.shape[1])
    k = probs.shape[1]
    flat = probs.argmax(axis=1) * k + labels
    return np.bincount(flat, minlength=k * k).reshape(k, k).astype(np.int64)


def _counts(name: str, value, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim or arr.size == 0 or not np.issubdtype(arr.dtype, np.number):
        raise CalibrationInputError(f"{name} must be a {ndim}-d array of counts. Got {value!r}.")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise CalibrationInputError(f"{name} must be finite and >= 0. Got {value!r}.")
    return arr


# ---------------------------------------------------------------------------
# black-box shift estimation


def bbse(confusion, served_counts, *, level: float = INTERVAL_LEVEL) -> dict:
    """Class priors of the served rows by black-box shift estimation, with an interval.

    Write :math:`C_{ij}` for the hold-out's joint frequency of predicting :math:`i`
    when the class is :math:`j` (``confusion / m``, :math:`m` hold-out rows),
    :math:`p_j = \\sum_i C_{ij}` for the hold-out's class priors and
    :math:`\\hat\\mu_i` for the served frequency of predicting :math:`i` (``n``
    served rows). Under label shift :math:`\\mu = C w` with :math:`w_j = q_j / p_j`
    the ratio of the new priors :math:`q` to the old, so (Lipton et al. 2018)

    .. math::  \\hat w = C^{-1}\\hat\\mu, \\qquad \\hat q_j \\propto \\max(\\hat w_j, 0)\\, p_j .

    Negative weights (noise, for rare classes) are clipped to 0 and the priors
    normalised to sum 1. The weights returned, for :func:`correct_priors`, are those of
    the add-one smoothed priors :math:`(n\\hat q_j + 1)/(n + K)` over :math:`p`: never 0,
    so a class wrongly estimated absent keeps its rows finite (on the CIFAR outputs,
    the unsmoothed weights made the corrected NLL 2 to 20 times the uncorrected; the
    smoothed ones lower it: ``bench/label_shift.py``). Classes never
    seen on the hold-out have :math:`p_j = 0` and get weight 1 and prior 0 (nothing
    identifies them); :math:`C` restricted to the rest must be invertible (a
    classifier that never predicts a class, or confuses two entirely, does not
    identify their priors), else CalibrationInputError.

    Interval: the delta method, with both sources of noise. From
    :math:`\\hat w - w \\approx C^{-1}\\{(\\hat\\mu - \\mu) - (\\hat C - C) w\\}`, with
    :math:`\\hat\\mu` multinomial over the ``n`` served rows and :math:`\\hat C` over the
    ``m`` hold-out rows,

    .. math::

        \\operatorname{Cov}(\\hat w) \\approx C^{-1}\\left[
            \\frac{\\operatorname{diag}(\\mu) - \\mu\\mu^\\top}{n}
            + \\frac{\\operatorname{diag}(C w^{2}) - \\mu\\mu^\\top}{m}\\right] C^{-\\top},

    (:math:`w^2` elementwise, :math:`\\mu = Cw`), and :math:`\\hat q_j = p_j \\hat w_j`
    has standard error :math:`p_j \\operatorname{sd}(\\hat w_j)` (the normalisation and
    the hold-out's own :math:`p` are left out: second order). Each prior's interval is
    :math:`\\hat q_j \\pm z\\,\\mathrm{se}_j` clipped to [0, 1]. Cost: one K x K solve
    and inverse, O(K^3): milliseconds at K = 100, about a second at K = 1,000.

    Parameters
    ----------
    confusion : array-like of shape (n_classes, n_classes)
        Hold-out counts (or frequencies times ``m``) per (predicted, true) class:
        :func:`confusion_counts`.
    served_counts : array-like of shape (n_classes,)
        Served rows per predicted class: :func:`predicted_counts`.
    level : float, default 0.95

    Returns
    -------
    dict
        ``priors``, ``lower``, ``upper``, ``std`` (lists over classes),
        ``weights`` (smoothed :math:`\\hat q / p`), ``source_priors`` (:math:`p`), ``n``, ``m``
        and ``level``.

    Raises
    ------
    CalibrationInputError
        Shapes that disagree, negative or non-finite counts, no served rows, or a
        singular confusion matrix.

    Examples
    --------
    A classifier right 80 % of the time on two balanced classes, served rows predicted
    70:30:

    >>> out = bbse([[40, 10], [10, 40]], [70, 30])
    >>> [round(q, 4) for q in out["priors"]]
    [0.8333, 0.1667]
    """
    z = _z(level)
    joint = _counts("confusion", confusion, 2)
    served = _counts("served_counts", served_counts, 1)
    k = served.size
    if joint.shape != (k, k):
        raise CalibrationInputError(
            f"confusion must be of shape ({k}, {k}) for {k} served counts. Got {joint.shape}."
        )
    m, n = float(joint.sum()), float(served.sum())
    if n == 0 or m == 0:
        raise CalibrationInputError(f"bbse needs served and hold-out rows. Got n={n}, m={m}.")
    c = joint / m
    source = c.sum(axis=0)
    seen = source > 0
    mu = served / n
    sub = c[np.ix_(seen, seen)]
    try:
        inverse = np.linalg.inv(sub)
    except np.linalg.LinAlgError:
        inverse = None
    if inverse is None or np.linalg.cond(sub) > 1e12:
        raise CalibrationInputError(
            "the hold-out's confusion matrix is singular: some class is never predicted, or "
            "two classes are confused entirely, so their priors are not identified. Got "
            f"rank {np.linalg.matrix_rank(sub)} of {int(seen.sum())}."
        )
    # Served predictions of a class unseen on the hold-out carry no information.
    w_seen = inverse @ mu[seen]
    mu_model = sub @ w_seen
    cov_mu = (np.diag(mu[seen]) - np.outer(mu[seen], mu[seen])) / n
    cov_c = (np.diag(sub @ w_seen**2) - np.outer(mu_model, mu_model)) / m
    cov_w = inverse @ (cov_mu + cov_c) @ inverse.T
    priors = np.zeros(k)
    priors[seen] = np.maximum(w_seen, WEIGHT_FLOOR) * source[seen]
    priors /= priors.sum()
    std = np.zeros(k)
    std[seen] = source[seen] * np.sqrt(np.maximum(np.diag(cov_w), 0.0))
    # The correction's weights: add-one smoothed priors, so a class the estimate sends
    # to 0 while it is still served keeps a finite log-weight (a wrong 0 costs infinite
    # NLL on its rows).
    smoothed = (priors * n + 1.0) / (n + k)
    weights = np.ones(k)
    weights[seen] = smoothed[seen] / source[seen]
    return {
        "priors": priors.tolist(),
        "lower": np.clip(priors - z * std, 0.0, 1.0).tolist(),
        "upper": np.clip(priors + z * std, 0.0, 1.0).tolist(),
        "std": std.tolist(),
        "weights": weights.tolist(),
        "source_priors": source.tolist(),
        "n": round(n),
        "m": round(m),
        "level": float(level),
    }


def shift_test(
    holdout_counts, served_counts, *, alpha: float = DEFAULT_ALPHA,
    min_count: int = DEFAULT_MIN_COUNT,
) -> dict:
    """Have the predicted-class frequencies moved? Pearson's chi-square test of
    homogeneity of the served counts against the hold-out's.

    The 2 x K table of predicted-class counts (hold-out, served) is tested for one
    shared distribution; classes predicted in neither are dropped, and the degrees of
    freedom are the classes left minus one. Testing against the hold-out's *counts*
    rather than its frequencies counts the hold-out's own noise. Under label shift
    with an invertible confusion matrix the predicted frequencies move exactly when
    the priors do; a change of ``p(x | y)`` moves them too, so ``"shift"`` says the
    predictions' mix changed, and :func:`bbse` says which priors would explain it.

    Parameters
    ----------
    holdout_counts, served_counts : array-like of shape (n_classes,)
        Rows per predicted class.
    alpha : float, default 0.01
    min_count : int, default 200
        Fewer served rows give ``"insufficient_data"`` (no statistic).

    Returns
    -------
    dict
        ``verdict`` (``"shift"``, ``"no_shift"`` or ``"insufficient_data"``),
        ``statistic``, ``df``, ``p_value``, ``alpha``, ``n``.

    Examples
    --------
    >>> shift_test([500, 500], [700, 300])["verdict"]
    'shift'
    >>> shift_test([500, 500], [510, 490])["verdict"]
    'no_shift'
    """
    hold = _counts("holdout_counts", holdout_counts, 1)
    served = _counts("served_counts", served_counts, 1)
    if hold.shape != served.shape:
        raise CalibrationInputError(
            f"holdout_counts and served_counts must have one count per class. Got "
            f"{hold.size} and {served.size}."
        )
    alpha = check_level(alpha)
    n = round(served.sum())
    out = {"alpha": alpha, "n": n, "statistic": None, "df": None, "p_value": None}
    if n < min_count or hold.sum() == 0:
        return {**out, "verdict": "insufficient_data"}
    table = np.stack([hold, served])
    table = table[:, table.sum(axis=0) > 0]
    expected = np.outer(table.sum(axis=1), table.sum(axis=0)) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    p_value = float(chi2.sf(statistic, df)) if df > 0 else 1.0
    verdict = "shift" if p_value < alpha else "no_shift"
    return {**out, "verdict": verdict, "statistic": statistic, "df": df, "p_value": p_value}


# ---------------------------------------------------------------------------
# EM on the rows, and the correction


def correct_priors(probs, weights) -> np.ndarray:
    """Prior-corrected probabilities :math:`p'(y|x) = p(y|x) w_y / \\sum_k p(k|x) w_k`.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
        Calibrated probabilities under the hold-out's priors.
    weights : array-like of shape (n_classes,)
        New priors over old, >= 0 with some positive.

    Returns
    -------
    ndarray of shape (n_samples, n_classes), float64

    Examples
    --------
    >>> correct_priors([[0.5, 0.5]], [3.0, 1.0]).tolist()
    [[0.75, 0.25]]
    """
    probs = as_scores(probs, "probabilities")
    w = _counts("weights", weights, 1)
    if w.size != probs.shape[1] or not (w > 0).any():
        raise CalibrationInputError(
            f"weights must be {probs.shape[1]} numbers >= 0, some positive. Got {weights!r}."
        )
    out = probs.astype(np.float64) * w
    total = out.sum(axis=1, keepdims=True)
    # A row whose every probability sits on weight-0 classes keeps its own answer.
    empty = total[:, 0] <= 0
    out[empty] = probs[empty]
    out[~empty] /= total[~empty]
    return out


def em_priors(probs, source_priors, *, tol: float = 1e-8, max_iter: int = 1000) -> dict:
    """Class priors of unlabelled rows by EM on calibrated probabilities (Saerens et al.
    2002).

    With :math:`p` the priors the probabilities were calibrated under, iterate
    :math:`q \\leftarrow \\frac{1}{n}\\sum_i p'_q(\\cdot | x_i)` where
    :math:`p'_q` is :func:`correct_priors` with weights :math:`q / p`: each step
    cannot decrease the likelihood of the rows under the shifted model. Stops when no
    prior moves by more than ``tol``. It needs every row's probabilities (the E-step
    reweights each row), so a service that keeps only counts uses :func:`bbse`. It
    relies on calibration more than BBSE does: miscalibration shows up as a shift.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    source_priors : array-like of shape (n_classes,)
        Positive; normalised here.
    tol : float, default 1e-8
    max_iter : int, default 1000

    Returns
    -------
    dict
        ``priors`` and ``weights`` (lists), ``iterations``, ``converged``.

    Examples
    --------
    >>> out = em_priors([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.6, 0.4]], [0.5, 0.5])
    >>> [round(q, 3) for q in out["priors"]], out["converged"]
    ([0.838, 0.162], True)
    """
    probs = as_scores(probs, "probabilities").astype(np.float64)
    p = _counts("source_priors", source_priors, 1)
    if p.size != probs.shape[1] or not (p > 0).all():
        raise CalibrationInputError(
            f"source_priors must be {probs.shape[1]} positive numbers. Got {source_priors!r}."
        )
    p = p / p.sum()
    q = p.copy()
    for iteration in range(1, max_iter + 1):
        new = correct_priors(probs, q / p).mean(axis=0)
        moved = float(np.abs(new - q).max())
        q = new
        if moved <= tol:
            return _em_result(q, p, iteration, True)
    return _em_result(q, p, max_iter, False)


def _em_result(q: np.ndarray, p: np.ndarray, iterations: int, converged: bool) -> dict:
    return {
        "priors": q.tolist(),
        "weights": (q / p).tolist(),
        "iterations": iterations,
        "converged": converged,
    }


def prior_l1_error(estimate, truth) -> float:
    """:math:`\\sum_j |\\hat q_j - q_j|` (lower is better; at most 2).

    >>> prior_l1_error([0.5, 0.5], [0.75, 0.25])
    0.5
    """
    a, b = np.asarray(estimate, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    return float(np.abs(a - b).sum())
