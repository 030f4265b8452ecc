"""Accuracy and calibration metrics of a probability matrix against integer labels.

Every function takes ``probs``, an ndarray of shape (n_samples, n_classes) whose
rows sum to 1, and ``labels``, an ndarray of shape (n_samples,) of integers in
``[0, n_classes)``. Both go through :func:`calibrators.validation.as_scores`
(probabilities kind) and :func:`calibrators.validation.as_labels`, so bad input raises
:class:`~calibrators.validation.CalibrationInputError` with the same message as
everywhere else in the library. :func:`report` computes everything at once.

Names state the direction, as in scikit-learn: ``*_error`` and ``*_loss`` are
lower-is-better, ``*_score`` is higher-is-better. :func:`mean_entropy` has no
direction (it describes how spread the predictions are).

Conventions
-----------
Prediction and confidence
    The predicted class of a row is ``argmax`` as numpy defines it (the first
    maximum on ties); its confidence is the row maximum. A row is *correct* when
    the predicted class equals the label.
Bins
    Equal-width ("uniform") bins have the edges ``np.linspace(0, 1, n_bins + 1)``
    and are half-open, ``[e_b, e_{b+1})``, except the last, ``[e_{B-1}, 1]``: a
    confidence lying exactly on an interior edge goes in the bin *above* it, and a
    confidence of 1.0 goes in the last bin (the convention of ``np.histogram``,
    ``sklearn.calibration.calibration_curve`` and netcal). The comparison is in
    float64 against those float edges, so with ``n_bins=5`` the third edge is
    0.6000000000000001 and a confidence of 0.6 falls in bin 2, not 3.
    Confidences slightly above 1 (rows may sum to ``1 + ROW_SUM_TOLERANCE``) also
    go in the last bin. Equal-mass ("quantile") bins have the edges
    ``np.quantile(confidence, np.linspace(0, 1, n_bins + 1))`` (linear
    interpolation) with the first edge set to 0 and the last to 1, and the same
    half-open rule; with ties in the confidences some of those bins are empty.
Empty bins
    contribute nothing to ECE and are skipped by MCE; in the reliability-diagram
    bins their mean confidence and accuracy are ``None``.
Floors
    The NLL of a row clips the true-class probability at
    :data:`calibrators.validation.PROBABILITY_FLOOR` (``2**-149``), so a zero
    probability costs ``-log(2**-149) = 103.28`` nats instead of infinity.
    Entropy uses ``0 * log 0 = 0``.
Memory and time
    Element-wise work (Brier, entropy, classwise binning) runs over row chunks of
    about :data:`calibrators.numerics.CHUNK_ELEMENTS` entries with float64
    accumulators, so a large float32 input needs no full-size float64 temporary.
    The chunks are computed on a few threads and their sums added in chunk order
    (the figures do not depend on the number of threads). Classwise binning
    bins only the entries above the first bin (at most about ``n_bins`` a row)
    and takes bin 0's sums as column sums, so at a language model's K it costs a
    comparison and an addition per entry; the entropy of logits needs one log per
    row, not per entry (:func:`calibrators.numerics.softmax_entropy`).

Reliability-diagram bins
------------------------
:func:`reliability_bins`, ``report(...)["bins"]`` and
``ece_from_bin_statistics(...)["bins"]`` are a *dict of lists* (one column per
key, ready for a plot or a JSON response)::

    {"edges": [n_bins + 1 floats],
     "count": [n_bins ints],
     "mean_confidence": [n_bins floats, None for an empty bin],
     "accuracy": [n_bins floats, None for an empty bin]}

Sufficient statistics
---------------------
Top-label ECE, MCE and the bins only need, per bin, the number of rows, the sum
of their confidences and the number of correct rows. :func:`bin_statistics`
computes them and :func:`ece_from_bin_statistics` turns them into metrics; the
statistics of disjoint batches *add up* (for equal-width bins, whose edges do not
depend on the data), which is how the service keeps a live ECE without storing
rows. :func:`report` and :func:`expected_calibration_error` go through the same
two functions.

Calibration error with intervals
--------------------------------
The plain binned ECE of a calibrated model is positive (sampling noise in each bin's
accuracy) and shrinks only as n grows, so a number alone cannot tell a regression
from a small sample. Two estimators come with an interval at ``level`` (0.95):

* :func:`debiased_calibration_error` (Kumar, Liang and Ma, 2019): the L2 binned
  error with the noise term subtracted, and a normal interval on its square. It
  needs only the per-bin sums above (``count``, ``confidence_sum``,
  ``correct_count``): :func:`debiased_ece_from_bin_statistics` computes it for a
  live window.
* :func:`smooth_calibration_error` (Blasiok and Nakkiran, 2023): the kernel-smoothed
  ECE at its fixed-point bandwidth, with an interval from the simulated noise of a
  calibrated model. It needs the confidences and outcomes on a grid finer than the
  bandwidth (spacing under sigma / 20, at least 256 points), not the 15 bins.

Both intervals are clipped at 0 and can contain it: the true error of a calibrated
model is exactly 0, and the lower bound is 0 unless the data show more error than
a calibrated model's noise (a one-sided test at about ``(1 - level) / 2``), so it
is the figure to alert on. ``tests/calibrators/evaluation/test_metrics_intervals.py`` checks
the coverage by simulation.

Differences from netcal
-----------------------
netcal (``netcal.metrics.ECE`` / ``MCE`` / ``ACE``, version 1.4) is the test
oracle: ``tests/calibrators/evaluation/test_metrics.py`` compares the two on the shared
CIFAR files, where they agree to 1e-6. What differs, and why:

* Equal-width ECE and MCE: same edges, same half-open rule (numpy's
  ``histogramdd``, scipy's ``binned_statistic_dd``). netcal clips every
  confidence to ``[eps, 1 - eps]`` of the input dtype (``eps = 1.19e-7`` for
  float32) before binning, which moves rows of confidence 1.0 on float32 input;
  we use the confidences as given.
* Equal-mass ECE (``strategy="quantile"``, ``report(...)["ece_quantile"]``)
  uses the same edges as netcal's ``ECE(equal_intervals=False)``, so the two
  agree to rounding on float64 input. On float32 input netcal can differ
  because of an inconsistency of its own: the per-bin counts
  (``np.histogramdd``) compare against float64 edges but the per-bin means
  (``scipy.stats.binned_statistic_dd``) against edges cast to float32, so a
  row lying between an edge and its float32 rounding is counted in one bin and
  averaged in the other. We compare in float64 throughout. netcal also raises
  for tied quantile edges (scipy: "smallest edge difference is numerically 0");
  we keep the resulting empty bins.
* netcal's ``ACE`` is *not* an equal-mass ECE: it is the unweighted mean of
  ``|acc - conf|`` over the non-empty bins. Computed that way from our
  :func:`reliability_bins` it matches netcal (float64 input), but it is a
  different number from our ``ece_quantile``.
* netcal has no classwise ECE. Ours equals the mean over the classes of
  netcal's *binary* ECE on ``(probs[:, k], labels == k)`` (to rounding on
  float64 input; on float32 input the same clipping to ``eps`` applies).
* For two classes netcal's ECE measures the reliability of the positive-class
  column, not the top label; we always measure the top label (use
  :func:`classwise_calibration_error` for the per-column view).

References
----------
Guo, Pleiss, Sun and Weinberger, "On Calibration of Modern Neural Networks",
ICML 2017 (ECE, MCE, reliability diagrams). Kull, Perello-Nieto, Kängsepp,
Silva Filho, Song and Flach, "Beyond temperature scaling: Obtaining
well-calibrated multiclass probabilities with Dirichlet calibration", NeurIPS
2019 (classwise ECE).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from scipy.fft import irfft, next_fast_len, rfft
from scipy.optimize import brentq
from scipy.special import entr, ndtri

from calibrators import numerics
from calibrators.numerics import imap_chunks, row_chunks, softmax_entropy
from calibrators.validation import (
    INT64_MAX,
    MAX_BINS,
    MAX_RESAMPLES,
    CalibrationInputError,
    as_labels,
    as_scores,
    as_sequence_ids,
    check_integer,
    check_kind,
    probabilities_to_logits,
)

__all__ = [
    "DEFAULT_N_BINS",
    "INTERVAL_LEVEL",
    "STRATEGIES",
    "accuracy_score",
    "bin_edges",
    "bin_statistics",
    "brier_loss",
    "classwise_calibration_error",
    "debiased_calibration_error",
    "debiased_ece_from_bin_statistics",
    "ece_from_bin_statistics",
    "expected_calibration_error",
    "log_loss_summary",
    "maximum_calibration_error",
    "mean_entropy",
    "nll_loss",
    "nll_per_row",
    "reliability_bins",
    "report",
    "scores_report",
    "smooth_calibration_error",
    "smooth_ece_from_confidences",
]

DEFAULT_N_BINS = 15
STRATEGIES = ("uniform", "quantile")
#: Default confidence level of the intervals of the calibration errors.
INTERVAL_LEVEL = 0.95
#: Smallest bandwidth of the smooth ECE (its grid then has 32,768 intervals).
SMOOTH_MIN_BANDWIDTH = 1e-3
#: Tolerance on the smooth ECE's bandwidth (its fixed point).
SMOOTH_XTOL = 1e-7
#: Labels drawn per smooth ECE for its interval (the noise of a calibrated model).
SMOOTH_RESAMPLES = 400


# ---------------------------------------------------------------------------
# helpers


def _check_n_bins(n_bins) -> int:
    return check_integer("n_bins", n_bins, minimum=1, maximum=MAX_BINS)


def _check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise CalibrationInputError(
            f"strategy must be 'uniform' or 'quantile'. Got {strategy!r}."
        )
    return strategy


def _probs_and_labels(probs, labels):
    arr = as_scores(probs, "probabilities")
    return arr, as_labels(labels, arr.shape[0], arr.shape[1])


def _top_label(probs: np.ndarray, labels: np.ndarray):
    """Confidence (float64, shape (N,)) and correctness (bool, shape (N,))."""
    predicted = probs.argmax(axis=1)
    confidence = probs[np.arange(probs.shape[0]), predicted].astype(np.float64)  # the row max
    return confidence, predicted == labels


def _true_class_probability(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return probs[np.arange(probs.shape[0]), labels].astype(np.float64)


def _nll_rows(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return -probabilities_to_logits(_true_class_probability(probs, labels))


def _as_vector(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise CalibrationInputError(f"{name} must be a 1-D array. Got shape {arr.shape}.")
    return arr


# ---------------------------------------------------------------------------
# sufficient statistics of the top-label reliability diagram


def bin_edges(
    n_bins: int = DEFAULT_N_BINS, *, strategy: str = "uniform", confidence=None
) -> np.ndarray:
    """Edges of the confidence bins.

    Parameters
    ----------
    n_bins : int, default 15
    strategy : {"uniform", "quantile"}, default "uniform"
        ``"uniform"``: ``np.linspace(0, 1, n_bins + 1)``. ``"quantile"``: the
        ``np.quantile`` of the confidences at ``linspace(0, 1, n_bins + 1)``
        (equal-mass bins), clipped to [0, 1], first edge 0 and last edge 1.
    confidence : array-like of shape (n_samples,), optional
        The confidences; required by (and only used by) ``strategy="quantile"``.

    Returns
    -------
    ndarray of shape (n_bins + 1,), float64, non-decreasing.

    Examples
    --------
    >>> bin_edges(4).tolist()
    [0.0, 0.25, 0.5, 0.75, 1.0]
    >>> bin_edges(2, strategy="quantile", confidence=[0.25, 0.5, 0.75, 1.0]).tolist()
    [0.0, 0.625, 1.0]
    """
    n_bins = _check_n_bins(n_bins)
    _check_strategy(strategy)
    if strategy == "uniform":
        return np.linspace(0.0, 1.0, n_bins + 1)
    if confidence is None:
        raise CalibrationInputError(
            "strategy='quantile' needs the confidences to place the edges. Got None."
        )
    conf = _as_vector(confidence, "confidence").astype(np.float64, copy=False)
    if conf.size == 0:
        raise CalibrationInputError("confidence must have at least one entry. Got 0.")
    edges = np.clip(np.quantile(conf, np.linspace(0.0, 1.0, n_bins + 1)), 0.0, 1.0)
    edges[0], edges[-1] = 0.0, 1.0
    return edges


def _bin_statistics(confidence: np.ndarray, correct: np.ndarray, edges: np.ndarray) -> dict:
    n_bins = edges.shape[0] - 1
    index = np.searchsorted(edges[1:-1], confidence, side="right")
    return {
        "count": np.bincount(index, minlength=n_bins),
        "confidence_sum": np.bincount(index, weights=confidence, minlength=n_bins),
        "correct_count": np.bincount(index[correct], minlength=n_bins),
        "edges": edges,
    }


def _checked_confidence(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    """Confidences (float64, finite) and correctness (bool), validated."""
    conf = _as_vector(confidence, "confidence")
    ok = _as_vector(correct, "correct")
    if conf.shape != ok.shape:
        raise CalibrationInputError(
            f"confidence and correct must have the same length. Got {conf.shape[0]} "
            f"and {ok.shape[0]}."
        )
    if conf.size == 0:
        raise CalibrationInputError("confidence must have at least one entry. Got 0.")
    if conf.dtype == object or not (
        np.issubdtype(conf.dtype, np.floating) or np.issubdtype(conf.dtype, np.integer)
    ):
        raise CalibrationInputError(f"confidence must be numeric. Got dtype {conf.dtype}.")
    conf = conf.astype(np.float64, copy=False)
    if not np.isfinite(conf).all():
        row = int(np.flatnonzero(~np.isfinite(conf))[0])
        raise CalibrationInputError(
            f"confidence must be finite. Got {conf[row]} at row {row}."
        )
    if ok.dtype != np.bool_:
        if ok.dtype == object or not np.isin(ok, (0, 1)).all():
            raise CalibrationInputError(
                f"correct must be booleans (or 0/1). Got dtype {ok.dtype} with other values."
            )
        ok = ok.astype(np.bool_)
    return conf, ok


def bin_statistics(
    confidence, correct, n_bins: int = DEFAULT_N_BINS, *, strategy: str = "uniform"
) -> dict:
    """Per-bin sufficient statistics of the top-label reliability diagram.

    Row ``i`` falls in bin ``b`` when ``edges[b] <= confidence[i] < edges[b + 1]``;
    the last bin is closed (a confidence of 1.0, or slightly more, goes there).

    Parameters
    ----------
    confidence : array-like of shape (n_samples,)
        Confidence of each row (the maximum probability), finite.
    correct : array-like of shape (n_samples,)
        Whether each row's prediction was right (bool, or integers 0/1).
    n_bins : int, default 15
    strategy : {"uniform", "quantile"}, default "uniform"
        See :func:`bin_edges`. Only equal-width statistics can be summed across
        batches: quantile edges depend on the data.

    Returns
    -------
    dict
        ``count`` (int64, shape (n_bins,)): rows per bin;
        ``confidence_sum`` (float64, shape (n_bins,)): sum of their confidences;
        ``correct_count`` (int64, shape (n_bins,)): correct rows per bin;
        ``edges`` (float64, shape (n_bins + 1,)). The counts and sums of disjoint
        batches add up; pass the dict to :func:`ece_from_bin_statistics` with ``**``.

    Examples
    --------
    >>> stats = bin_statistics([0.7, 0.6, 0.5, 0.8], [True, False, True, True], 4)
    >>> stats["count"].tolist(), stats["correct_count"].tolist()
    ([0, 0, 3, 1], [0, 0, 2, 1])
    """
    conf, ok = _checked_confidence(confidence, correct)
    edges = bin_edges(n_bins, strategy=strategy, confidence=conf)
    return _bin_statistics(conf, ok, edges)


def _checked_bin_statistics(count, confidence_sum, correct_count):
    """The three per-bin arrays validated (count and correct_count as given, the sum as
    float64) and the number of rows, or CalibrationInputError."""
    count = _as_vector(count, "count")
    confidence_sum = _as_vector(confidence_sum, "confidence_sum").astype(np.float64)
    correct_count = _as_vector(correct_count, "correct_count")
    if (
        count.shape[0] == 0
        or confidence_sum.shape != count.shape
        or correct_count.shape != count.shape
    ):
        raise CalibrationInputError(
            "count, confidence_sum and correct_count must have the same positive length. "
            f"Got {count.shape[0]}, {confidence_sum.shape[0]} and {correct_count.shape[0]}."
        )
    if (count < 0).any() or (correct_count < 0).any() or (correct_count > count).any():
        raise CalibrationInputError(
            "bin counts must satisfy 0 <= correct_count <= count. "
            f"Got count {count.tolist()} and correct_count {correct_count.tolist()}."
        )
    total = int(count.sum())
    if total == 0:
        raise CalibrationInputError("the bins must hold at least one row. Got 0 rows.")
    return count, confidence_sum, correct_count, total


def ece_from_bin_statistics(count, confidence_sum, correct_count, edges=None) -> dict:
    """Top-label ECE, MCE and reliability-diagram bins from per-bin statistics.

    With :math:`n_b` rows, confidence sum :math:`s_b` and :math:`c_b` correct rows
    in bin :math:`b`, and :math:`N = \\sum_b n_b`:

    .. math::

        \\mathrm{ECE} = \\sum_b \\frac{n_b}{N} \\left|\\frac{c_b}{n_b} - \\frac{s_b}{n_b}\\right|
                      = \\frac{1}{N} \\sum_b |c_b - s_b|, \\qquad
        \\mathrm{MCE} = \\max_{b:\\, n_b > 0} \\left|\\frac{c_b - s_b}{n_b}\\right| .

    Parameters
    ----------
    count : array-like of shape (n_bins,)
        Rows per bin (non-negative, not all zero).
    confidence_sum : array-like of shape (n_bins,)
        Sum of the confidences per bin.
    correct_count : array-like of shape (n_bins,)
        Correct rows per bin, at most ``count``.
    edges : array-like of shape (n_bins + 1,), optional
        Bin edges, reported in ``bins``; default ``np.linspace(0, 1, n_bins + 1)``.

    Returns
    -------
    dict
        ``ece`` (float), ``mce`` (float), ``n`` (int, :math:`N`) and ``bins``
        (dict of lists, see the module docstring).

    Examples
    --------
    >>> out = ece_from_bin_statistics([0, 0, 3, 1], [0.0, 0.0, 1.8, 0.8], [0, 0, 2, 1])
    >>> round(out["ece"], 12), round(out["mce"], 12)
    (0.1, 0.2)
    """
    count, confidence_sum, correct_count, total = _checked_bin_statistics(
        count, confidence_sum, correct_count
    )
    n_bins = count.shape[0]
    if edges is None:
        edges = np.linspace(0.0, 1.0, n_bins + 1)
    edges = _as_vector(edges, "edges").astype(np.float64)
    if edges.shape[0] != n_bins + 1:
        raise CalibrationInputError(
            f"edges must have n_bins + 1 = {n_bins + 1} entries. Got {edges.shape[0]}."
        )
    gap = np.abs(correct_count.astype(np.float64) - confidence_sum)
    full = count > 0
    safe = np.where(full, count, 1).astype(np.float64)
    mean_confidence = confidence_sum / safe
    accuracy = correct_count / safe
    return {
        "ece": float(gap.sum() / total),
        "mce": float((gap[full] / safe[full]).max()),
        "n": total,
        "bins": {
            "edges": edges.tolist(),
            "count": [int(c) for c in count],
            "mean_confidence": [
                float(m) if f else None for m, f in zip(mean_confidence, full, strict=True)
            ],
            "accuracy": [float(a) if f else None for a, f in zip(accuracy, full, strict=True)],
        },
    }


def _calibration(probs, labels, n_bins, strategy) -> dict:
    confidence, correct = _top_label(probs, labels)
    edges = bin_edges(n_bins, strategy=strategy, confidence=confidence)
    return ece_from_bin_statistics(**_bin_statistics(confidence, correct, edges))


# ---------------------------------------------------------------------------
# top-label calibration


def expected_calibration_error(
    probs, labels, *, n_bins: int = DEFAULT_N_BINS, strategy: str = "uniform"
) -> float:
    """Top-label expected calibration error (lower is better).

    .. math::

        \\mathrm{ECE} = \\sum_{b=1}^{B} \\frac{n_b}{N}
                        \\left|\\mathrm{acc}(b) - \\mathrm{conf}(b)\\right|

    where bin :math:`b` holds the :math:`n_b` rows whose confidence (top
    probability) falls in it, :math:`\\mathrm{acc}(b)` is the fraction of them
    whose argmax equals the label and :math:`\\mathrm{conf}(b)` their mean
    confidence (Guo et al., 2017). Bin conventions: see the module docstring.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
        Probabilities, rows summing to 1.
    labels : array-like of shape (n_samples,)
        Integer class labels in ``[0, n_classes)``.
    n_bins : int, default 15
    strategy : {"uniform", "quantile"}, default "uniform"
        Equal-width bins, or equal-mass bins at the confidence quantiles.

    Returns
    -------
    float in [0, 1]

    Examples
    --------
    >>> probs = [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
    >>> round(expected_calibration_error(probs, [0, 1, 1, 2], n_bins=4), 12)
    0.1
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _calibration(probs, labels, _check_n_bins(n_bins), _check_strategy(strategy))["ece"]


def maximum_calibration_error(
    probs, labels, *, n_bins: int = DEFAULT_N_BINS, strategy: str = "uniform"
) -> float:
    """Top-label maximum calibration error (lower is better).

    .. math::

        \\mathrm{MCE} = \\max_{b:\\, n_b > 0} \\left|\\mathrm{acc}(b) - \\mathrm{conf}(b)\\right|

    over the non-empty bins; notation and parameters as in
    :func:`expected_calibration_error` (Guo et al., 2017).

    Returns
    -------
    float in [0, 1]

    Examples
    --------
    >>> probs = [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
    >>> round(maximum_calibration_error(probs, [0, 1, 1, 2], n_bins=4), 12)
    0.2
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _calibration(probs, labels, _check_n_bins(n_bins), _check_strategy(strategy))["mce"]


def reliability_bins(
    probs, labels, *, n_bins: int = DEFAULT_N_BINS, strategy: str = "uniform"
) -> dict:
    """Top-label reliability-diagram bins.

    Parameters as in :func:`expected_calibration_error`.

    Returns
    -------
    dict of lists
        ``edges`` (n_bins + 1 floats), ``count`` (n_bins ints), ``mean_confidence``
        and ``accuracy`` (n_bins floats, ``None`` for an empty bin). Plain Python
        types, JSON-serialisable.

    Examples
    --------
    >>> probs = [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
    >>> bins = reliability_bins(probs, [0, 1, 1, 2], n_bins=2)
    >>> bins["count"], bins["accuracy"]
    ([0, 4], [None, 0.75])
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _calibration(probs, labels, _check_n_bins(n_bins), _check_strategy(strategy))["bins"]


# ---------------------------------------------------------------------------
# classwise calibration


def _classwise_chunk(chunk: np.ndarray, inner: np.ndarray) -> tuple:
    """A row chunk's part of the per-(class, bin) probability sums, without binning
    every entry.

    An entry in a bin above the first is at least ``1 / n_bins`` and a row sums to
    about 1, so a row has at most about ``n_bins`` such entries: at a language
    model's K nearly every entry is in bin 0. Those few are found with one
    comparison and binned with ``searchsorted``; bin 0's sums are the chunk's column
    sums once they are set to 0. Each sum adds the same numbers in the same order as
    binning every entry with ``searchsorted`` + ``bincount`` would (row after row;
    adding 0.0 changes no float), so the sums are equal to the bit.

    Parameters
    ----------
    chunk : ndarray of shape (n_rows, K), float64
        Probabilities, the caller's scratch copy: its entries above bin 0 are
        overwritten with 0 (and a one-row chunk is returned as ``low``).
    inner : ndarray of shape (n_bins - 1,)
        The inner bin edges, ``bin_edges(n_bins)[1:-1]``.

    Returns
    -------
    low : ndarray of shape (K,)
        Per class, the sum of its entries in bin 0.
    slots, values : ndarray of shape (m,)
        The other entries: their flat (class, bin) index ``class * n_bins + bin``
        and value, in row order.
    """
    n_rows, k = chunk.shape
    flat = chunk.reshape(-1)
    upper = np.flatnonzero(flat >= inner[0]) if inner.size else np.empty(0, dtype=np.intp)
    values = flat[upper]
    flat[upper] = 0.0
    slots = (upper % k) * (inner.size + 1) + np.searchsorted(inner, values, side="right")
    # einsum adds the rows one after the other, as bincount did (and sum(axis=0) does,
    # several times slower on a narrow K)
    low = flat if n_rows == 1 else np.einsum("ij->j", flat.reshape(n_rows, k))
    return low, slots, values


class _ClasswiseSums:
    """Per-(class, bin) probability sums, added up from :func:`_classwise_chunk` parts
    in chunk order, and the classwise ECE they give.

    Bin 0 is a vector of K (a chunk's column sums add in one pass). The other bins
    hold a few entries a row at most: when K x ``n_bins`` is larger than a chunk,
    only the (class, bin) slots that hold entries are kept (sorted slots and their
    sums), so the memory is a few vectors of K, not K x ``n_bins`` float64 arrays (30 MiB
    each at K = 262,144); otherwise one dense array.
    """

    def __init__(self, k: int, n_bins: int):
        self.k, self.n_bins = k, n_bins
        self.low = np.zeros(k)
        self.upper = np.zeros(k * n_bins) if k * n_bins <= numerics.CHUNK_ELEMENTS else None
        self.slots = np.empty(0, dtype=np.intp)
        self.sums = np.empty(0)

    def add(self, part: tuple) -> None:
        low, slots, values = part
        self.low += low
        if self.upper is not None:
            self.upper += np.bincount(slots, weights=values, minlength=self.upper.size)
        elif slots.size:
            used, where = np.unique(slots, return_inverse=True)
            sums = np.bincount(where, weights=values)  # this chunk's, as bincount adds them
            at = np.searchsorted(self.slots, used)
            known = at < self.slots.size
            known[known] = self.slots[at[known]] == used[known]
            self.sums[at[known]] += sums[known]
            if not known.all():
                self.slots = np.insert(self.slots, at[~known], used[~known])
                self.sums = np.insert(self.sums, at[~known], sums[~known])

    def errors(self, true_probability: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """ECE of each class, shape (K,), given the true-class probability of each row.

        Per class, ``sum_b |positives_b - sums_b| / N`` over the bins, positives
        being the rows labelled with the class whose probability of it falls in
        ``b``: one row of ``n_bins`` gaps per class, summed. With only the slots
        kept, a class with nothing above bin 0 has one non-zero gap, and only the
        other classes get their row: the same arithmetic as the whole table. Called
        once: the dense table is overwritten with the gaps.
        """
        k, n_bins = self.k, self.n_bins
        true_bin = np.searchsorted(bin_edges(n_bins)[1:-1], true_probability, side="right")
        if self.upper is not None:  # the whole (K, n_bins) table, no larger than a chunk
            table = self.upper
            table[::n_bins] = self.low
            slot = labels * n_bins
            slot += true_bin
            gap = np.abs(np.subtract(np.bincount(slot, minlength=table.size), table, out=table))
            return gap.reshape(k, n_bins).sum(axis=1) / len(labels)
        above = true_bin > 0
        gap = np.abs(np.bincount(labels[~above], minlength=k) - self.low)  # bin 0
        positive = labels[above] * n_bins + true_bin[above]
        classes = np.union1d(self.slots // n_bins, positive // n_bins)
        if classes.size:
            counts = np.bincount(
                np.searchsorted(classes, positive // n_bins) * n_bins + positive % n_bins,
                minlength=classes.size * n_bins,
            ).reshape(classes.size, n_bins)
            sums = np.zeros((classes.size, n_bins))
            sums[np.searchsorted(classes, self.slots // n_bins), self.slots % n_bins] = self.sums
            table = np.abs(counts - sums)
            table[:, 0] = gap[classes]
            gap[classes] = table.sum(axis=1)
        return gap / len(labels)


def _classwise_errors(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each class column against its one-vs-rest indicator, shape (K,)."""
    n, k = probs.shape
    sums = _ClasswiseSums(k, n_bins)
    inner = bin_edges(n_bins)[1:-1]
    for part in imap_chunks(
        lambda rows: _classwise_chunk(probs[rows].astype(np.float64), inner), n, k
    ):
        sums.add(part)
    return sums.errors(_true_class_probability(probs, labels), labels)


def classwise_calibration_error(probs, labels, *, n_bins: int = DEFAULT_N_BINS) -> float:
    """Classwise expected calibration error (lower is better).

    The mean over the :math:`K` classes of the ECE of each probability column
    against the one-vs-rest indicator (Kull et al., 2019):

    .. math::

        \\mathrm{cwECE} = \\frac{1}{K} \\sum_{k=1}^{K} \\sum_{b=1}^{B}
            \\frac{|B_{kb}|}{N} \\left|\\bar y_k(B_{kb}) - \\bar p_k(B_{kb})\\right|

    where :math:`B_{kb}` holds the rows whose probability of class :math:`k`
    falls in equal-width bin :math:`b`, :math:`\\bar p_k` is their mean
    probability of class :math:`k` and :math:`\\bar y_k` the fraction of them
    labelled :math:`k`. Every class counts, including classes absent from
    ``labels``. Bin conventions as for the top label (module docstring).

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    labels : array-like of shape (n_samples,)
    n_bins : int, default 15

    Returns
    -------
    float in [0, 1]

    Examples
    --------
    >>> probs = [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
    >>> round(classwise_calibration_error(probs, [0, 1, 1, 2], n_bins=4), 12)
    0.233333333333
    """
    probs, labels = _probs_and_labels(probs, labels)
    return float(_classwise_errors(probs, labels, _check_n_bins(n_bins)).mean())


# ---------------------------------------------------------------------------
# calibration error with intervals


def check_level(level) -> float:
    """A confidence (or significance) level in (0, 1), as a float; CalibrationInputError
    otherwise."""
    if (
        isinstance(level, bool | np.bool_)
        or not isinstance(level, numbers.Real)
        or not 0.0 < float(level) < 1.0
    ):
        raise CalibrationInputError(f"level must be a number in (0, 1). Got {level!r}.")
    return float(level)


def _debiased_ece(count, confidence_sum, correct_count, level: float) -> dict:
    n = count.astype(np.float64)
    total = n.sum()
    weight = n / total
    pair = count >= 2
    safe = np.maximum(n, 2.0)
    accuracy = correct_count / safe
    gap = (correct_count - confidence_sum) / safe
    term = np.where(pair, gap**2 - accuracy * (1.0 - accuracy) / (safe - 1.0), 0.0)
    squared = float(weight @ term)
    # Variance of each bin's term, d^2 - v with d ~ N(delta, s2): 4 delta^2 s2 + 2 s2^2,
    # with s2 from the add-one accuracy (a bin of all-correct rows is not certain).
    smoothed = (correct_count + 1.0) / (n + 2.0)
    s2 = np.where(count > 0, smoothed * (1.0 - smoothed) / np.maximum(n, 1.0), 0.0)
    variance = float((weight**2) @ (4.0 * np.maximum(term, 0.0) * s2 + 2.0 * s2**2))
    half = float(ndtri(0.5 + level / 2.0)) * math.sqrt(variance)
    return {
        "estimate": math.sqrt(max(squared, 0.0)),
        "lower": math.sqrt(max(squared - half, 0.0)),
        "upper": min(math.sqrt(max(squared + half, 0.0)), 1.0),
        "squared": squared,
        "level": level,
    }


def debiased_ece_from_bin_statistics(
    count, confidence_sum, correct_count, *, level: float = INTERVAL_LEVEL
) -> dict:
    """Debiased L2 top-label calibration error with a confidence interval, from per-bin
    statistics (lower is better).

    The plug-in binned error is biased upwards: even for a calibrated model each bin's
    accuracy differs from its confidence by sampling noise, of variance about
    :math:`a_b(1 - a_b) / n_b`. Kumar, Liang and Ma (2019) remove that noise from the
    *squared* (L2) binned error, where it is additive: with :math:`n_b` rows,
    :math:`c_b` correct rows and confidence sum :math:`s_b` in bin :math:`b`,
    :math:`a_b = c_b / n_b`, :math:`d_b = (c_b - s_b) / n_b` and :math:`N = \\sum_b n_b`,

    .. math::

        \\widehat{T} = \\sum_{b:\\, n_b \\ge 2} \\frac{n_b}{N}
            \\left( d_b^2 - \\frac{a_b (1 - a_b)}{n_b - 1} \\right), \\qquad
        \\widehat{\\mathrm{ECE}}_2 = \\sqrt{\\max(\\widehat{T}, 0)} .

    :math:`a_b(1 - a_b)/(n_b - 1)` is the unbiased estimate of the variance of
    :math:`a_b` when a bin's rows share one probability of being right, so
    :math:`\\widehat T` is unbiased for :math:`T = \\sum_b \\frac{n_b}{N}\\delta_b^2`,
    :math:`\\delta_b` being the bin's expected accuracy minus its mean confidence
    (given the confidences). It can be negative; the estimate is clipped at 0. Bins of
    one row have no variance estimate and add nothing (as in the paper's code). This is
    the root-mean-square binned error, not the mean absolute one of
    :func:`expected_calibration_error`: it is at least as large for the same gaps.

    Interval. :math:`\\widehat T` is a sum of independent bin terms; each is
    :math:`d_b^2 - v_b` with :math:`d_b` about normal of mean :math:`\\delta_b` and
    variance :math:`\\sigma_b^2`, so its variance is
    :math:`4\\delta_b^2\\sigma_b^2 + 2\\sigma_b^4`, estimated with
    :math:`\\max(\\text{term}_b, 0)` for :math:`\\delta_b^2` and the add-one accuracy
    :math:`\\tilde a_b = (c_b + 1)/(n_b + 2)` in :math:`\\sigma_b^2 = \\tilde a_b(1 -
    \\tilde a_b)/n_b` (a bin of all-correct rows is not certain; bins of one row count
    here). With :math:`z` the normal quantile of ``(1 + level) / 2`` and
    :math:`h = z\\sqrt{\\sum_b (n_b/N)^2 \\widehat{\\mathrm{Var}}_b}`, the interval is
    :math:`[\\sqrt{\\max(\\widehat T - h, 0)},\\ \\min(\\sqrt{\\max(\\widehat T + h, 0)}, 1)]`.
    Clipping at 0 is what makes the interval honest for a calibrated model, whose
    true error is exactly 0: the lower bound is 0 unless :math:`\\widehat T` exceeds
    its noise, which a calibrated model does with probability about
    :math:`(1 - \\text{level}) / 2`, so an alert on the lower bound is a one-sided test
    of calibration. The interval is conditional on the confidences (the bins' weights
    and mean confidences are taken as fixed).

    Everything is a function of the three per-bin sums, which add up across batches:
    the service computes it for a live window without the rows. Cost: O(n_bins).

    Parameters
    ----------
    count, confidence_sum, correct_count : array-like of shape (n_bins,)
        As for :func:`ece_from_bin_statistics`.
    level : float, default 0.95
        Confidence level of the interval, in (0, 1).

    Returns
    -------
    dict
        ``estimate``, ``lower``, ``upper`` (floats in [0, 1]), ``squared``
        (:math:`\\widehat T`, may be negative) and ``level``.

    References
    ----------
    Kumar, Liang and Ma, "Verified Uncertainty Calibration", NeurIPS 2019 (section 5,
    the debiased estimator of the squared calibration error).

    Examples
    --------
    One bin of 10 rows, all correct, mean confidence 0.8 (no noise term: the accuracy
    estimate 1 has no variance), and a calibrated-looking bin:

    >>> out = debiased_ece_from_bin_statistics([0, 10, 10], [0.0, 8.0, 5.0], [0, 10, 5])
    >>> round(out["squared"], 6), out["lower"] < round(out["estimate"], 6) < out["upper"]
    (0.006111, True)
    """
    count, confidence_sum, correct_count, _ = _checked_bin_statistics(
        count, confidence_sum, correct_count
    )
    return _debiased_ece(count, confidence_sum, correct_count, check_level(level))


def debiased_calibration_error(
    probs, labels, *, n_bins: int = DEFAULT_N_BINS, level: float = INTERVAL_LEVEL
) -> dict:
    """Debiased L2 top-label calibration error over equal-width bins, with an interval.

    :func:`debiased_ece_from_bin_statistics` of :func:`bin_statistics` of the top
    label (see there for the formula, the interval and the reference).

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    labels : array-like of shape (n_samples,)
    n_bins : int, default 15
    level : float, default 0.95

    Returns
    -------
    dict
        ``estimate``, ``lower``, ``upper``, ``squared``, ``level``.

    Examples
    --------
    >>> probs = [[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.1, 0.9]] * 25
    >>> out = debiased_calibration_error(probs, [0, 1, 1, 1] * 25, n_bins=4)
    >>> out["lower"] <= out["estimate"] <= out["upper"]
    True
    """
    probs, labels = _probs_and_labels(probs, labels)
    level = check_level(level)
    confidence, correct = _top_label(probs, labels)
    stats = _bin_statistics(confidence, correct, bin_edges(_check_n_bins(n_bins)))
    return _debiased_ece(stats["count"], stats["confidence_sum"], stats["correct_count"], level)


def _grid_points(sigma: float) -> int:
    """Grid intervals for bandwidth ``sigma``: a power of two with spacing <= sigma / 20."""
    return 1 << max(8, math.ceil(math.log2(20.0 / sigma)))


def _on_grid(f: np.ndarray, values: np.ndarray, m: int) -> np.ndarray:
    """``values`` at ``f`` spread linearly onto the m + 1 points ``j / m`` (mass and first
    moment kept), shape (m + 1,)."""
    x = f * m
    left = np.minimum(x.astype(np.int64), m - 1)
    frac = x - left
    return np.bincount(left, values * (1.0 - frac), minlength=m + 1) + np.bincount(
        left + 1, values * frac, minlength=m + 1
    )


def _reflected_l1(cells: np.ndarray, sigma: float) -> np.ndarray:
    """``integral_0^1 |sum_j K(t, j / m) cells_j| dt`` with the reflected Gaussian kernel,
    along the last axis of ``cells`` (shape (..., m + 1)).

    The Gaussian is cut at 8 sigma (``w`` grid steps; the rest weighs under 1e-14 of
    it). Each grid mass is placed at its point and at its mirror images about 0 and 1
    that fall within ``w`` steps of [0, 1] (images further out weigh under
    ``phi(1 / sigma)``), convolved with the Gaussian density sampled on the grid (one
    real FFT for all rows) and the absolute value integrated by the trapezoidal rule.
    """
    m = cells.shape[-1] - 1
    w = min(m, math.ceil(8.0 * sigma * m))
    mirrored = np.concatenate(
        [cells[..., w:0:-1], cells, cells[..., m - 1 : m - w - 1 if w < m else None : -1]],
        axis=-1,
    )  # positions -w / m .. 1 + w / m
    mirrored[..., w] += cells[..., 0]
    mirrored[..., w + m] += cells[..., m]
    offsets = np.arange(-w, w + 1) / (m * sigma)
    kernel = np.exp(-0.5 * offsets**2) / (math.sqrt(2.0 * math.pi) * sigma)
    size = next_fast_len(mirrored.shape[-1] + 2 * w)
    product = rfft(mirrored, size, axis=-1) * rfft(kernel, size)
    smoothed = np.abs(irfft(product, size, axis=-1)[..., 2 * w : 2 * w + m + 1])
    return (smoothed.sum(axis=-1) - 0.5 * (smoothed[..., 0] + smoothed[..., -1])) / m


def _smooth_ece(confidence, correct, level, n_resamples, seed) -> dict:
    n = confidence.shape[0]
    f = np.clip(confidence, 0.0, 1.0)
    residual = correct - f
    grids: dict[int, np.ndarray] = {}

    def at(sigma: float) -> float:
        m = _grid_points(sigma)
        if m not in grids:
            grids[m] = _on_grid(f, residual, m) / n
        return float(_reflected_l1(grids[m], sigma))

    # smECE_sigma does not increase with sigma (Gaussian smoothing contracts the L1
    # norm), so sigma - smECE_sigma has one root on [floor, 1] (Brent's method).
    if at(SMOOTH_MIN_BANDWIDTH) <= SMOOTH_MIN_BANDWIDTH:
        sigma = SMOOTH_MIN_BANDWIDTH
    else:
        sigma = brentq(lambda s: at(s) - s, SMOOTH_MIN_BANDWIDTH, 1.0, xtol=SMOOTH_XTOL)
    estimate = at(sigma)
    # The noise field of a calibrated model with these confidences: labels drawn from
    # them, per grid cell (rows at their nearest point), binomial counts.
    m = _grid_points(sigma)
    cell = np.rint(f * m).astype(np.int64)
    rows = np.bincount(cell, minlength=m + 1)
    mean = np.bincount(cell, f, minlength=m + 1) / np.maximum(rows, 1)
    occupied = np.flatnonzero(rows * mean * (1.0 - mean) > 0)  # cells with any noise
    rng = np.random.default_rng(seed)
    noise = np.empty(n_resamples)
    block = max(1, (1 << 17) // m)  # about 131k grid values at a time: bounded memory
    for start in range(0, n_resamples if occupied.size else 0, block):
        size = min(block, n_resamples - start)
        draws = rng.binomial(rows[occupied], mean[occupied], size=(size, occupied.size))
        cells = np.zeros((size, m + 1))
        cells[:, occupied] = (draws - rows[occupied] * mean[occupied]) / n
        noise[start : start + size] = _reflected_l1(cells, sigma)
    quantile = float(np.quantile(noise, 0.5 + level / 2.0)) if occupied.size else 0.0
    return {
        "estimate": estimate,
        "lower": max(estimate - quantile, 0.0),
        "upper": min(estimate + quantile, 1.0),
        "bandwidth": sigma,
        "level": level,
    }


def smooth_ece_from_confidences(
    confidence,
    correct,
    *,
    level: float = INTERVAL_LEVEL,
    n_resamples: int = SMOOTH_RESAMPLES,
    seed: int = 0,
) -> dict:
    """Smooth ECE of confidences against outcomes, with a confidence interval (lower is
    better).

    The smooth ECE of Blasiok and Nakkiran (2023) replaces bins by a kernel. With
    confidences :math:`f_i \\in [0, 1]`, outcomes :math:`y_i \\in \\{0, 1\\}` and the
    reflected Gaussian kernel on [0, 1],
    :math:`\\tilde K_\\sigma(t, f) = \\sum_{m \\in \\mathbb Z} \\phi_\\sigma(t - f - 2m) +
    \\phi_\\sigma(t + f - 2m)` (:math:`\\phi_\\sigma` the normal density of standard
    deviation :math:`\\sigma`),

    .. math::

        \\mathrm{smECE}_\\sigma = \\int_0^1 \\Big| \\frac{1}{n} \\sum_{i=1}^{n}
            \\tilde K_\\sigma(t, f_i)\\,(y_i - f_i) \\Big|\\, dt ,

    the kernel-smoothed residual :math:`\\hat r_\\sigma(t)` weighted by the smoothed
    density :math:`\\hat\\delta_\\sigma(t)` (their product is the integrand). The
    bandwidth is the fixed point :math:`\\sigma^*` with
    :math:`\\mathrm{smECE}_{\\sigma^*} = \\sigma^*` (unique: the left side does not
    increase with :math:`\\sigma`), found by Brent's method on [0.001, 1] (as relplot's
    ``smECE``, 0.001 is a floor); the smooth ECE is :math:`\\mathrm{smECE}_{\\sigma^*}`.

    Computation: the residuals are spread linearly onto a grid of ``m + 1`` points
    (``m`` a power of two, spacing at most :math:`\\sigma / 20`, at least 256
    intervals), mirrored about 0 and 1, convolved with the sampled Gaussian by FFT and
    integrated by the trapezoidal rule. Cost: O(n) per grid size, plus
    O(m log m) per step of the root search (about ten), with
    the kernel cut at 8 sigma.

    Interval. The estimate is biased upwards (a calibrated model has a positive
    smooth ECE that shrinks like :math:`1/\\sqrt n`), and no resampling of the rows
    removes that, so the interval comes from the triangle inequality instead. At the
    chosen :math:`\\sigma`, the observed residual field is the expected one
    (:math:`a_i - f_i`, :math:`a_i` the true probability of being right) plus the
    noise of the outcomes (:math:`y_i - a_i`); the L1 norm obeys
    :math:`|\\,\\|r\\| - \\|E r\\|\\,| \\le \\|\\text{noise}\\|`. The noise norm is
    simulated ``n_resamples`` times with outcomes drawn from the confidences
    (binomial counts per grid point: a calibrated model's noise; for a miscalibrated
    one :math:`f(1 - f)` stands in for :math:`a(1 - a)`), and with :math:`q` its
    ``(1 + level) / 2`` quantile the interval is
    :math:`[\\max(\\mathrm{smECE} - q, 0),\\ \\min(\\mathrm{smECE} + q, 1)]`. It covers
    the smooth calibration error at :math:`\\sigma^*` of the expected residuals given
    the confidences, which is exactly 0 for a calibrated model: the lower bound is 0
    unless the estimate exceeds a calibrated model's noise, so an alert on it is a
    test of calibration at about ``(1 - level) / 2``. Cost:
    O(``n_resamples`` m log m), independent of n beyond the O(n) binning: largest
    when the bandwidth sits at its floor (m = 32,768, a model whose confidences and
    accuracy are all within a few thousandths of 1), a few seconds at the default
    400 resamples; with no outcome noise at all (every confidence 0 or 1) the
    interval is the estimate itself and nothing is simulated.

    Parameters
    ----------
    confidence : array-like of shape (n_samples,)
        Confidences in [0, 1] (values up to 1e-6 past either end are clipped).
    correct : array-like of shape (n_samples,)
        Outcomes (bool, or 0/1).
    level : float, default 0.95
        Confidence level of the interval, in (0, 1).
    n_resamples : int, default 400
        Simulated outcome draws for the interval.
    seed : int, default 0
        Seed of the simulation (the figures are reproducible).

    Returns
    -------
    dict
        ``estimate``, ``lower``, ``upper`` (floats in [0, 1]), ``bandwidth``
        (:math:`\\sigma^*`) and ``level``.

    relplot (1.0.3, the authors' code) gives the same figure to rounding when the
    confidences stay away from 0 and 1. With much mass at an end it differs: its
    grid mirrors an end point once instead of twice (a confidence of 1 keeps half
    its kernel) and it divides by the smoothed density's sum (the shared CIFAR-100
    outputs, a third of whose confidences exceed 0.99, show it). The tests check
    this function against the definition computed by quadrature.

    References
    ----------
    Blasiok and Nakkiran, "Smooth ECE: Principled Reliability Diagrams via Kernel
    Smoothing", ICLR 2024 (arXiv 2309.12236, 2023).

    Examples
    --------
    >>> f = np.linspace(0.05, 0.95, 200)
    >>> out = smooth_ece_from_confidences(f, f > 0.5)
    >>> round(out["bandwidth"], 3) == round(out["estimate"], 3), out["lower"] > 0
    (True, True)
    """
    conf, ok = _checked_confidence(confidence, correct)
    if conf.min() < -1e-6 or conf.max() > 1.0 + 1e-6:
        raise CalibrationInputError(
            f"confidence must lie in [0, 1]. Got values in [{conf.min()}, {conf.max()}]."
        )
    level = check_level(level)
    n_resamples = check_integer("n_resamples", n_resamples, minimum=1, maximum=MAX_RESAMPLES)
    seed = check_integer("seed", seed, minimum=0, maximum=INT64_MAX)
    return _smooth_ece(conf, ok, level, n_resamples, seed)


def smooth_calibration_error(
    probs,
    labels,
    *,
    level: float = INTERVAL_LEVEL,
    n_resamples: int = SMOOTH_RESAMPLES,
    seed: int = 0,
) -> dict:
    """Top-label smooth ECE with a confidence interval (lower is better).

    :func:`smooth_ece_from_confidences` of the top label: confidence the row maximum,
    outcome whether the first argmax equals the label (see there for the definition,
    the interval, the cost and the reference).

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    labels : array-like of shape (n_samples,)
    level, n_resamples, seed
        As for :func:`smooth_ece_from_confidences`.

    Returns
    -------
    dict
        ``estimate``, ``lower``, ``upper``, ``bandwidth``, ``level``.

    Examples
    --------
    >>> out = smooth_calibration_error([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]] * 20, [0, 1, 1] * 20)
    >>> out["lower"] <= out["estimate"] <= out["upper"]
    True
    """
    probs, labels = _probs_and_labels(probs, labels)
    level = check_level(level)
    n_resamples = check_integer("n_resamples", n_resamples, minimum=1, maximum=MAX_RESAMPLES)
    seed = check_integer("seed", seed, minimum=0, maximum=INT64_MAX)
    confidence, correct = _top_label(probs, labels)
    return _smooth_ece(confidence, correct, level, n_resamples, seed)


# ---------------------------------------------------------------------------
# proper scores, accuracy, entropy


def _log_loss_summary(probs: np.ndarray, labels: np.ndarray) -> dict:
    nll = _nll_rows(probs, labels)
    median, p95 = np.percentile(nll, [50.0, 95.0])
    return {"mean": float(nll.mean()), "median": float(median), "p95": float(p95)}


def log_loss_summary(probs, labels) -> dict:
    """Mean, median and 95th percentile of the per-row negative log-likelihood (nats).

    .. math::

        \\ell_i = -\\log \\max(p_{i, y_i}, 2^{-149})

    The floor (:data:`calibrators.validation.PROBABILITY_FLOOR`) keeps a row with
    :math:`p_{i,y_i} = 0` finite (103.28 nats). The mean alone hides what typical
    rows do: a few confidently wrong rows dominate it, the median does not.
    Percentiles use numpy's default linear interpolation. Lower is better.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    labels : array-like of shape (n_samples,)

    Returns
    -------
    dict
        ``mean``, ``median``, ``p95`` (floats).

    Examples
    --------
    >>> out = log_loss_summary([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]], [0, 2])
    >>> round(out["median"], 6)
    1.039721
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _log_loss_summary(probs, labels)


def sequence_nll_summary(probs, labels, sequences) -> dict:
    """The NLL per token and per sequence, for rows that are the tokens of texts.

    Tokens of one text are correlated, so the per-token figures alone overstate how
    much evidence there is, and one long text can dominate them; the mean NLL of each
    sequence, summarised over the sequences, weighs texts equally.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
    labels : array-like of shape (n_samples,)
    sequences : array-like of shape (n_samples,)
        The sequence (text) of each row: integers or strings.

    Returns
    -------
    dict
        ``tokens``: :func:`log_loss_summary` of the rows and their ``count``;
        ``sequences``: the ``median``, ``p95`` and ``mean`` of the per-sequence mean
        NLL, and their ``count``.

    Examples
    --------
    >>> p = [[0.5, 0.5], [0.5, 0.5], [0.9, 0.1]]
    >>> out = sequence_nll_summary(p, [0, 1, 0], ["a", "a", "b"])
    >>> out["sequences"]["count"], round(out["sequences"]["median"], 6)
    (2, 0.399254)
    """
    probs, labels = _probs_and_labels(probs, labels)
    return nll_rows_summary(_nll_rows(probs, labels), sequences)


def nll_rows_summary(nll: np.ndarray, sequences) -> dict:
    """:func:`sequence_nll_summary` of given per-row NLLs ``nll`` (n_samples,): for rows
    whose NLL is not that of an (N, K) probability matrix (top-k rows,
    :func:`calibrators.topk.report`)."""
    codes = as_sequence_ids(sequences, nll.shape[0])
    per_sequence = np.bincount(codes, weights=nll) / np.bincount(codes)
    token_median, token_p95 = np.percentile(nll, [50.0, 95.0])
    median, p95 = np.percentile(per_sequence, [50.0, 95.0])
    return {
        "tokens": {
            "mean": float(nll.mean()), "median": float(token_median), "p95": float(token_p95),
            "count": int(nll.size),
        },
        "sequences": {
            "median": float(median), "p95": float(p95), "mean": float(per_sequence.mean()),
            "count": int(per_sequence.size),
        },
    }


def nll_loss(probs, labels) -> float:
    """Mean negative log-likelihood in nats (lower is better).

    :math:`\\frac{1}{N}\\sum_i -\\log \\max(p_{i, y_i}, 2^{-149})`; see
    :func:`log_loss_summary` for the floor and the median/p95.

    Examples
    --------
    >>> round(nll_loss([[0.5, 0.25, 0.25]], [0]), 6)
    0.693147
    """
    probs, labels = _probs_and_labels(probs, labels)
    return float(_nll_rows(probs, labels).mean())


def nll_per_row(probs, labels) -> np.ndarray:
    """Each row's negative log-likelihood in nats, float64 of shape (n_samples,).

    :math:`-\\log \\max(p_{i, y_i}, 2^{-149})`, the terms whose mean is
    :func:`nll_loss`: what paired comparisons of two calibrations on the same rows
    need (the mean and standard error of the per-row differences).

    Examples
    --------
    >>> nll_per_row([[0.5, 0.5], [0.25, 0.75]], [0, 1]).round(4).tolist()
    [0.6931, 0.2877]
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _nll_rows(probs, labels)


def _brier_sum(chunk: np.ndarray, labels: np.ndarray, *, scratch: bool = False) -> float:
    """``sum_i sum_k (p_ik - [y_i = k])**2`` of a row chunk, in float64.

    With ``scratch`` the chunk (float64, the caller's copy) takes the ``- 1`` of the
    true classes in place and gets its entries back afterwards: the same numbers as
    on a copy, without the copy.
    """
    diff = chunk if scratch else chunk.astype(np.float64)
    true = (np.arange(diff.shape[0]), labels)
    kept = diff[true]
    diff[true] = kept - 1.0
    total = float(np.einsum("ij,ij->", diff, diff))
    diff[true] = kept
    return total


def _brier(probs: np.ndarray, labels: np.ndarray) -> float:
    n, k = probs.shape
    return sum(_brier_sum(probs[rows], labels[rows]) for rows in row_chunks(n, k)) / n


def brier_loss(probs, labels) -> float:
    """Multiclass Brier score (lower is better), in [0, 2].

    .. math::

        \\mathrm{BS} = \\frac{1}{N} \\sum_{i=1}^{N} \\sum_{k=1}^{K}
                       (p_{ik} - [y_i = k])^2

    Brier's original multiclass definition (Brier, 1950), summed over classes.
    It equals scikit-learn's ``brier_score_loss(..., scale_by_half=False)``;
    scikit-learn's default halves it when there are fewer than 3 classes.

    Examples
    --------
    >>> round(brier_loss([[0.5, 0.25, 0.25]], [0]), 6)
    0.375
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _brier(probs, labels)


def accuracy_score(probs, labels) -> float:
    """Fraction of rows whose argmax (first maximum on ties) is the label (higher is better).

    Examples
    --------
    >>> accuracy_score([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], [0, 1])
    0.5
    """
    probs, labels = _probs_and_labels(probs, labels)
    return float((probs.argmax(axis=1) == labels).mean())


def _mean_entropy(probs: np.ndarray) -> float:
    n, k = probs.shape
    total = 0.0
    for rows in row_chunks(n, k):
        total += float(entr(probs[rows].astype(np.float64)).sum())
    return total / n


def mean_entropy(probs, labels=None) -> float:
    """Mean Shannon entropy of the predicted distributions, in nats.

    .. math::

        H = \\frac{1}{N} \\sum_{i=1}^{N} -\\sum_{k=1}^{K} p_{ik} \\log p_{ik},
        \\qquad 0 \\log 0 = 0 .

    Between 0 (one-hot rows) and :math:`\\log K` (uniform rows); it has no
    direction. ``labels`` are not needed; they are accepted (and validated when
    given) so every metric takes ``(probs, labels)``.

    Examples
    --------
    >>> round(mean_entropy([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]), 6)
    0.346574
    """
    arr = as_scores(probs, "probabilities")
    if labels is not None:
        as_labels(labels, arr.shape[0], arr.shape[1])
    return _mean_entropy(arr)


# ---------------------------------------------------------------------------
# everything at once


def report(probs, labels, *, n_bins: int = DEFAULT_N_BINS, sequences=None) -> dict:
    """All metrics of this module in one JSON-serialisable dict.

    The input is validated once; the top-label ECE, MCE and bins come from
    :func:`bin_statistics` / :func:`ece_from_bin_statistics`.

    Parameters
    ----------
    probs : array-like of shape (n_samples, n_classes)
        Probabilities, rows summing to 1.
    labels : array-like of shape (n_samples,)
        Integer class labels in ``[0, n_classes)``.
    n_bins : int, default 15
        Bins of every binned metric, 1 to 10,000 (``calibrators.validation.MAX_BINS``,
        as for every ``n_bins`` here).
    sequences : array-like of shape (n_samples,), optional
        The sequence (text) of each row, when rows are tokens: adds ``sequences``.

    Returns
    -------
    dict
        Plain Python ints, floats, lists and dicts (``json.dumps`` works):

        - ``n``, ``n_classes``: shape of ``probs``;
        - ``accuracy``: :func:`accuracy_score`;
        - ``nll``, ``nll_median``, ``nll_p95``: :func:`log_loss_summary`;
        - ``brier``: :func:`brier_loss`;
        - ``entropy``: :func:`mean_entropy` (nats);
        - ``ece``, ``mce``: equal-width top-label ECE and MCE;
        - ``ece_quantile``: top-label ECE with equal-mass bins;
        - ``classwise_ece``: :func:`classwise_calibration_error`;
        - ``ece_debiased``, ``ece_debiased_lower``, ``ece_debiased_upper``:
          :func:`debiased_calibration_error` over the same equal-width bins (an L2
          error: compare it with itself, not with ``ece``);
        - ``smooth_ece``, ``smooth_ece_lower``, ``smooth_ece_upper``,
          ``smooth_ece_bandwidth``: :func:`smooth_calibration_error` (seed 0);
        - ``interval_level``: the level of both intervals (0.95);
        - ``n_bins``;
        - ``bins``: equal-width reliability-diagram bins, a dict of lists
          (``edges``, ``count``, ``mean_confidence``, ``accuracy``);
        - ``sequences``, with ``sequences`` only: :func:`sequence_nll_summary`.

    Examples
    --------
    >>> probs = [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]
    >>> out = report(probs, [0, 1, 1, 2], n_bins=4)
    >>> out["n"], out["accuracy"], round(out["brier"], 12), round(out["ece"], 12)
    (4, 0.75, 0.36, 0.1)
    """
    probs, labels = _probs_and_labels(probs, labels)
    return _report(
        _probability_block(probs), labels, *probs.shape, _check_n_bins(n_bins), sequences
    )


def scores_report(
    scores, labels, kind: str = "logits", *, n_bins: int = DEFAULT_N_BINS, sequences=None
) -> dict:
    """:func:`report` of the probabilities of ``scores`` (logits: their softmax), computed
    a row chunk at a time: the (N, K) probabilities are never held, only vectors of N
    and sums of K x ``n_bins`` (a dataset's metrics cost its scores' memory, not twice).

    Every figure equals :func:`report` of ``softmax(scores)`` to the bit except, for
    logits, ``entropy``: it comes from the logits without a log per entry
    (:func:`calibrators.numerics.softmax_entropy`), equal to rounding (1e-12 relative).

    Parameters
    ----------
    scores : array-like of shape (n_samples, n_classes)
        Logits or probabilities, as ``kind`` says.
    labels : array-like of shape (n_samples,)
        Integer class labels in ``[0, n_classes)``.
    kind : {"logits", "probabilities"}, default "logits"
    n_bins : int, default 15
    sequences : array-like of shape (n_samples,), optional
        As in :func:`report`.

    Examples
    --------
    >>> from calibrators.numerics import softmax
    >>> z = [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]
    >>> a = scores_report(z, [0, 1, 1])
    >>> b = report(softmax(np.array(z)), [0, 1, 1])
    >>> a["nll"] == b["nll"], a["classwise_ece"] == b["classwise_ece"], a["accuracy"]
    (True, True, 0.6666666666666666)
    >>> abs(a["entropy"] - b["entropy"]) < 1e-15
    True
    """
    check_kind(kind)
    arr = as_scores(scores, kind)
    labels = as_labels(labels, *arr.shape)
    if kind == "logits":
        def block(rows: slice) -> tuple[np.ndarray, float]:
            p, entropy = softmax_entropy(arr[rows].astype(np.float64))
            return p, float(entropy.sum())
    else:
        block = _probability_block(arr)
    return _report(block, labels, *arr.shape, _check_n_bins(n_bins), sequences)


def _probability_block(probs: np.ndarray):
    """``block`` of :func:`_report` for a probability matrix: a float64 copy of the rows
    and the sum of their entropies."""
    def block(rows: slice) -> tuple[np.ndarray, float]:
        chunk = probs[rows].astype(np.float64)
        return chunk, float(entr(chunk).sum())
    return block


def _report(block, labels: np.ndarray, n: int, k: int, n_bins: int, sequences=None) -> dict:
    """The figures of :func:`report`.

    ``block(rows)`` returns the probabilities of a row slice as a float64 array of
    the caller's own (used as scratch here) and the sum of their entropies. The row
    chunks of :func:`~calibrators.numerics.imap_chunks` are read once, on a few
    threads, and their sums added in chunk order: the figures do not depend on the
    number of threads. Memory: a few chunks, vectors of N, and K x ``n_bins`` sums.
    """
    confidence = np.empty(n)
    correct = np.empty(n, dtype=bool)
    true_probability = np.empty(n)
    inner = bin_edges(n_bins)[1:-1]

    def figures(rows: slice) -> tuple:
        chunk, entropy = block(rows)
        y = labels[rows]
        confidence[rows], correct[rows] = _top_label(chunk, y)
        true_probability[rows] = _true_class_probability(chunk, y)
        brier = _brier_sum(chunk, y, scratch=True)
        return brier, entropy, _classwise_chunk(chunk, inner)  # the last overwrites chunk

    classwise = _ClasswiseSums(k, n_bins)
    brier = entropy = 0.0
    for chunk_brier, chunk_entropy, part in imap_chunks(figures, n, k):
        brier += chunk_brier
        entropy += chunk_entropy
        classwise.add(part)
    quantile_edges = bin_edges(n_bins, strategy="quantile", confidence=confidence)
    uniform_statistics = _bin_statistics(confidence, correct, bin_edges(n_bins))
    uniform = ece_from_bin_statistics(**uniform_statistics)
    debiased = _debiased_ece(
        uniform_statistics["count"],
        uniform_statistics["confidence_sum"],
        uniform_statistics["correct_count"],
        INTERVAL_LEVEL,
    )
    smooth = _smooth_ece(confidence, correct, INTERVAL_LEVEL, SMOOTH_RESAMPLES, 0)
    quantile = ece_from_bin_statistics(**_bin_statistics(confidence, correct, quantile_edges))
    nll = -probabilities_to_logits(true_probability)
    median, p95 = np.percentile(nll, [50.0, 95.0])
    by_sequence = {} if sequences is None else {"sequences": nll_rows_summary(nll, sequences)}
    return {
        "n": int(n),
        "n_classes": int(k),
        "accuracy": float(correct.mean()),
        "nll": float(nll.mean()),
        "nll_median": float(median),
        "nll_p95": float(p95),
        "brier": brier / n,
        "entropy": entropy / n,
        "ece": uniform["ece"],
        "ece_quantile": quantile["ece"],
        "mce": uniform["mce"],
        "classwise_ece": float(classwise.errors(true_probability, labels).mean()),
        "ece_debiased": debiased["estimate"],
        "ece_debiased_lower": debiased["lower"],
        "ece_debiased_upper": debiased["upper"],
        "smooth_ece": smooth["estimate"],
        "smooth_ece_lower": smooth["lower"],
        "smooth_ece_upper": smooth["upper"],
        "smooth_ece_bandwidth": smooth["bandwidth"],
        "interval_level": INTERVAL_LEVEL,
        "n_bins": n_bins,
        "bins": uniform["bins"],
        **by_sequence,
    }
