"""What an entropy target did to a set of rows, without labels.

A label-free fit (temperature with ``target_entropy``, ``row-entropy``) has no NLL or
ECE to report: its figures are the entropies of the rows, before and after, and how
far the calibrated distribution ``q`` moved from the original ``p``,
``KL(q || p) = sum_j q_j (log q_j - log p_j)`` per row (in nats; tempering is the
closest ``q`` of a given entropy in this divergence). The mean entropy says whether
the target was hit; the spread (p5, median, p95) says how unequal the rows are, which
a single temperature keeps and a temperature per row removes; the median and p95 of
the KL say what happened to typical and to the most moved rows, which the mean hides.

Row chunks, float64 accumulators: the (N, K) log-probabilities are never held whole.
"""

from __future__ import annotations

import numpy as np

from calibrators.numerics import log_softmax, row_chunks
from calibrators.validation import as_scores, check_kind, logits64

#: The quantiles of every spread: p5, median, p95.
QUANTILES = {"p5": 0.05, "median": 0.5, "p95": 0.95}


def _spread(values: np.ndarray) -> dict[str, float]:
    """Mean and :data:`QUANTILES` of per-row values."""
    out = {"mean": float(np.mean(values))}
    out.update(zip(QUANTILES, np.quantile(values, list(QUANTILES.values())).tolist(),
                   strict=True))
    return out


def _entropy(log_p: np.ndarray) -> np.ndarray:
    p = np.exp(log_p)
    return -np.sum(p * log_p, axis=1)


def entropy_report(scores, kind: str = "logits") -> dict:
    """The spread of the rows' entropies (nats).

    Parameters
    ----------
    scores : array-like of shape (n_samples, n_classes)
        Logits or probabilities, as ``kind`` says.
    kind : {"logits", "probabilities"}, default "logits"

    Returns
    -------
    dict
        ``n`` and ``entropy`` (``mean``, ``p5``, ``median``, ``p95``).

    Examples
    --------
    >>> r = entropy_report([[0.0, 0.0], [0.0, 0.0]])
    >>> r["n"], round(r["entropy"]["median"], 6)
    (2, 0.693147)
    """
    check_kind(kind)
    x = as_scores(scores, kind)
    h = np.empty(x.shape[0])
    for rows in row_chunks(*x.shape):
        h[rows] = _entropy(log_softmax(logits64(x[rows], kind)))
    return {"n": int(x.shape[0]), "entropy": _spread(h)}


def tempering_report(scores, calibrated, kind: str = "logits") -> dict:
    """Entropies before and after, and ``KL(q || p)`` per row, summarised.

    Parameters
    ----------
    scores : array-like of shape (n_samples, n_classes)
        The original scores (``p``: their distributions).
    calibrated : ndarray of shape (n_samples, n_classes), or callable
        The calibrated probabilities ``q`` of the same rows, or a function that gives
        them for a block of rows of ``scores`` (so that they are never held whole:
        ``lambda block: cal.predict_proba(block, kind=kind)``).
    kind : {"logits", "probabilities"}, default "logits"

    Returns
    -------
    dict
        ``n``; ``entropy_before`` and ``entropy_after`` (``mean``, ``p5``, ``median``,
        ``p95``); ``kl`` (``mean``, ``p5``, ``median``, ``p95`` of ``KL(q || p)``).

    Examples
    --------
    >>> from calibrators.numerics import softmax
    >>> z = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]])
    >>> r = tempering_report(z, softmax(z))
    >>> r["kl"]["p95"] < 1e-15, round(r["entropy_after"]["mean"], 6)
    (True, 0.59492)
    """
    check_kind(kind)
    x = as_scores(scores, kind)
    q_all = None if callable(calibrated) else np.asarray(calibrated, dtype=np.float64)
    n = x.shape[0]
    before, after, kl = np.empty(n), np.empty(n), np.empty(n)
    for rows in row_chunks(*x.shape):
        log_p = log_softmax(logits64(x[rows], kind))
        q = np.asarray(calibrated(x[rows]) if q_all is None else q_all[rows], np.float64)
        log_q = np.log(np.where(q > 0, q, 1.0))
        before[rows] = _entropy(log_p)
        after[rows] = -np.sum(q * log_q, axis=1)
        kl[rows] = np.maximum(np.sum(q * (log_q - log_p), axis=1), 0.0)
    return {
        "n": int(n),
        "entropy_before": _spread(before),
        "entropy_after": _spread(after),
        "kl": _spread(kl),
    }
