"""Checks on what a calibrator did to the predictions, measured rather than assumed.

Temperature scaling cannot change the predicted class; vector, matrix and
Dirichlet scaling can. :func:`argmax_report` counts how often they did, and how
far down the original ranking the new prediction came from. No calibrator is
guaranteed to lower the NLL of rows it was not fitted on: :func:`nll_report`
compares the calibrated and the raw scores row by row.
"""

from __future__ import annotations

import numpy as np

from calibrators.numerics import row_chunks
from calibrators.validation import (
    CalibrationInputError,
    as_labels,
    as_scores,
    probabilities_to_logits,
    to_probabilities,
)

__all__ = ["RANK_BUCKETS", "argmax_report", "nll_report"]

#: Keys of ``argmax_report(...)["changed_from_rank"]``, in order. Rank 1 only
#: happens when the new top class was *tied* for first in the original scores.
RANK_BUCKETS = ("1", "2", "3-10", ">10")
_BUCKET_STARTS = np.array([2, 3, 11])


def _original_ranks(scores: np.ndarray, rows: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``1 + #{j : scores[r, j] > scores[r, c]}`` for each pair ``(r, c)`` of (rows, classes)."""
    ranks = np.empty(rows.shape[0], dtype=np.int64)
    for part in row_chunks(rows.shape[0], scores.shape[1]):
        block = scores[rows[part]]
        reference = block[np.arange(block.shape[0]), classes[part]]
        ranks[part] = 1 + np.count_nonzero(block > reference[:, None], axis=1)
    return ranks


def argmax_report(scores_before, probs_after, *, kind: str = "logits") -> dict:
    """How many predicted classes a calibration changed, and where the new ones ranked.

    The predicted class of a row is its ``argmax`` as numpy defines it: the
    *first* maximum on ties, on both sides. For every row whose predicted class
    changed, the new class's rank in the original scores is

    .. math::

        r_i = 1 + \\#\\{j : s_{ij} > s_{i, \\hat y_i^{\\mathrm{after}}}\\}

    (1 = top; classes with an equal score do not push it down), compared on
    ``scores_before`` as given: logits as logits, probabilities as
    probabilities. Rank 1 for a changed row means the new class was tied for
    first with the old one. The work is vectorised over row chunks of about
    :data:`calibrators.numerics.CHUNK_ELEMENTS` entries, so a large K needs no
    full-size temporary.

    Parameters
    ----------
    scores_before : array-like of shape (n_samples, n_classes)
        Scores before calibration, logits or probabilities according to ``kind``.
    probs_after : array-like of shape (n_samples, n_classes)
        Calibrated probabilities, rows summing to 1.
    kind : {"logits", "probabilities"}, default "logits"
        What ``scores_before`` holds.

    Returns
    -------
    dict
        Plain Python types (JSON-serialisable):

        - ``n`` (int): rows;
        - ``agreement`` (float, higher is better): fraction of rows whose
          predicted class is unchanged;
        - ``changed`` (int): rows whose predicted class changed;
        - ``changed_from_rank`` (dict of int): those rows by original rank of the
          new class, keys ``"1"`` (tie), ``"2"``, ``"3-10"``, ``">10"``; the
          counts add up to ``changed``.

    Raises
    ------
    CalibrationInputError
        Invalid scores or probabilities, or arrays of different shapes.

    Examples
    --------
    >>> before = [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]
    >>> after = [[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6], [0.2, 0.2, 0.2, 0.4]]
    >>> out = argmax_report(before, after)
    >>> out["changed"], out["agreement"], out["changed_from_rank"]
    (2, 0.3333333333333333, {'1': 0, '2': 1, '3-10': 1, '>10': 0})
    """
    before = as_scores(scores_before, kind)
    after = as_scores(probs_after, "probabilities")
    if after.shape != before.shape:
        raise CalibrationInputError(
            f"probs_after must have the shape of scores_before, {before.shape}. "
            f"Got {after.shape}."
        )
    n = before.shape[0]
    top_after = after.argmax(axis=1)
    changed_rows = np.flatnonzero(before.argmax(axis=1) != top_after)
    ranks = _original_ranks(before, changed_rows, top_after[changed_rows])
    buckets = np.bincount(
        np.searchsorted(_BUCKET_STARTS, ranks, side="right"), minlength=len(RANK_BUCKETS)
    )
    changed = int(changed_rows.shape[0])
    return {
        "n": int(n),
        "agreement": float((n - changed) / n),
        "changed": changed,
        "changed_from_rank": {key: int(c) for key, c in zip(RANK_BUCKETS, buckets, strict=True)},
    }


def nll_report(scores_before, probs_after, labels, *, kind: str = "logits") -> dict:
    """The mean negative log-likelihood before and after a calibration, and how sure the
    difference is: the mean and standard error of the per-row differences.

    With :math:`\\ell_i = -\\log \\max(p_{i, y_i}, 2^{-149})` (the floor of
    :func:`calibrators.evaluation.metrics.log_loss_summary`) of the raw scores' probabilities
    (the softmax of logits) and :math:`\\ell'_i` of the calibrated ones, the paired
    differences :math:`d_i = \\ell'_i - \\ell_i` give

    .. math::

        \\bar d = \\frac{1}{N}\\sum_i d_i, \\qquad
        \\mathrm{se} = \\sqrt{\\frac{\\sum_i (d_i - \\bar d)^2}{N (N - 1)}}

    (positive :math:`\\bar d`: the calibration made the NLL worse). Pairing the rows
    removes what they share (how hard each row is), so the standard error is that of
    the calibration's effect alone. Computed a row chunk at a time: the raw
    probabilities are never held whole.

    Parameters
    ----------
    scores_before : array-like of shape (n_samples, n_classes)
        Scores before calibration, logits or probabilities according to ``kind``.
    probs_after : array-like of shape (n_samples, n_classes)
        Calibrated probabilities, rows summing to 1.
    labels : array-like of shape (n_samples,)
        Integer class labels in ``[0, n_classes)``.
    kind : {"logits", "probabilities"}, default "logits"
        What ``scores_before`` holds.

    Returns
    -------
    dict
        Plain Python types: ``n`` (int); ``before_loss`` and ``after_loss`` (mean NLL
        in nats, lower is better: :func:`calibrators.evaluation.metrics.nll_loss` of each, to
        rounding); ``difference`` (:math:`\\bar d`, ``after_loss - before_loss``);
        ``standard_error`` (se; None for a single row).

    Raises
    ------
    CalibrationInputError
        Invalid scores, probabilities or labels, or arrays of different shapes.

    Examples
    --------
    >>> before = [[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]
    >>> after = [[0.99, 0.01], [0.01, 0.99], [0.99, 0.01]]
    >>> out = nll_report(before, after, [0, 1, 1])
    >>> out["difference"] > 0, round(out["after_loss"], 4)
    (True, 1.5418)
    """
    before = as_scores(scores_before, kind)
    after = as_scores(probs_after, "probabilities")
    if after.shape != before.shape:
        raise CalibrationInputError(
            f"probs_after must have the shape of scores_before, {before.shape}. "
            f"Got {after.shape}."
        )
    labels = as_labels(labels, *before.shape)
    n = before.shape[0]
    diff = np.empty(n)
    before_sum = 0.0
    for part in row_chunks(n, before.shape[1]):
        picked = (np.arange(part.stop - part.start), labels[part])
        raw = -probabilities_to_logits(to_probabilities(before[part], kind)[picked])
        calibrated = -probabilities_to_logits(after[part][picked].astype(np.float64))
        diff[part] = calibrated - raw
        before_sum += float(raw.sum())
    return _paired(diff, before_sum / n)


def _paired(diff: np.ndarray, before_loss: float) -> dict:
    n = diff.shape[0]
    mean = float(diff.mean())
    return {
        "n": int(n),
        "before_loss": before_loss,
        "after_loss": before_loss + mean,
        "difference": mean,
        "standard_error": float(diff.std(ddof=1) / np.sqrt(n)) if n > 1 else None,
    }


def nll_rows_report(nll_before, nll_after) -> dict:
    """:func:`nll_report` from the per-row NLLs before and after (two arrays of shape
    (n_samples,)): for rows whose NLL is not read off an (N, K) probability matrix (top-k
    rows, :func:`calibrators.topk.nll_rows`).

    >>> out = nll_rows_report([1.0, 2.0, 3.0], [0.5, 2.0, 2.5])
    >>> out["difference"], out["after_loss"]
    (-0.3333333333333333, 1.6666666666666667)
    """
    before = np.asarray(nll_before, dtype=np.float64)
    after = np.asarray(nll_after, dtype=np.float64)
    if before.ndim != 1 or before.shape != after.shape or before.size == 0:
        raise CalibrationInputError(
            "nll_before and nll_after must be non-empty vectors of one shape. "
            f"Got {before.shape} and {after.shape}."
        )
    return _paired(after - before, float(before.mean()))
