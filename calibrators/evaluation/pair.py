"""Is it just temperature? Two models' distributions on the same positions, compared.

A fine-tuned model against its base, a quantized model against full precision: is
the difference a temperature, or did the ranking of the classes change? With ``z``
the logits of model A and ``q`` the distribution of model B on the same rows, the
inverse temperature that brings A closest to B,

.. math::

    \\beta^* = \\arg\\min_{\\beta > 0} \\frac1N \\sum_n
        \\mathrm{KL}(q_n \\,\\|\\, \\mathrm{softmax}(\\beta z_n)),

solves a convex problem: up to a constant the objective is
``mean(logsumexp(beta z) - beta E_q[z])``, with derivative ``mean(E_p[z] - E_q[z])``
and second derivative ``mean(Var_p(z)) >= 0`` (``p = softmax(beta z)``), so the
root of the derivative is found by bracketing and safeguarded Newton steps.
What temperature explains is ``1 - KL(B || A_beta*) / KL(B || A)``: 1 when B is A
tempered. That share alone flatters a ranking change: flattening A towards the
uniform distribution ``U`` (``beta -> 0``) lowers the KL to any B, so a B that ranks
the classes at random still has much of its KL "explained". ``1 - KL(B || A_beta*) /
KL(B || U)`` (the gain over flattening alone) is 1 when B is A tempered and near 0
when only flattening helps: both are reported.

Beside it, what temperature cannot change: top-1 agreement, and within B's top-k
classes the share of pairs A orders the other way (its discordance; 0 when A and B
rank B's top-k alike), per row, summarised by median and p95.
"""

from __future__ import annotations

import math

import numpy as np

from calibrators.numerics import row_chunks
from calibrators.validation import CalibrationInputError, as_scores, logits64

#: Relative tolerance on beta (the derivative's root).
TOL = 1e-10
#: Newton and bisection steps at most.
MAX_STEPS = 200
#: The bracket's upper end grows by doubling up to this (beyond: beta = inf, B is
#: more peaked on A's top class than any temperature makes A).
MAX_BETA = 2.0**60


def _rows(z: np.ndarray, q: np.ndarray, beta: float) -> tuple[float, float, float]:
    """Sums over the rows of ``E_p[z] - E_q[z]``, ``Var_p(z)`` and the objective."""
    grad = curv = value = 0.0
    for rows in row_chunks(*z.shape):
        c = z[rows] - z[rows].max(axis=1, keepdims=True)
        e = np.exp(beta * c)
        total = e.sum(axis=1)
        p = e / total[:, None]
        mean_p = np.einsum("ij,ij->i", p, c)
        mean_q = np.einsum("ij,ij->i", q[rows], c)
        grad += float((mean_p - mean_q).sum())
        curv += float((np.einsum("ij,ij->i", p, c * c) - mean_p**2).clip(0).sum())
        value += float((np.log(total) - beta * mean_q).sum())
    return grad, curv, value


def closest_temperature(z: np.ndarray, q: np.ndarray) -> float:
    """``beta*`` of the module docstring for float64 logits ``z`` and distributions ``q``.

    Returns 0.0 when no ``beta > 0`` lowers the objective below its limit at 0 (B is
    as flat as A at infinite temperature, or flatter, on average), ``inf`` when the
    objective keeps falling past ``MAX_BETA``.
    """
    n = z.shape[0]
    if _rows(z, q, 0.0)[0] >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while True:
        grad, curv, _ = _rows(z, q, hi)
        # A zero derivative where softmax(hi z) has saturated (zero variance) is no
        # root: the objective is flat from there on, and every larger beta is as close.
        if grad > 0 or (grad == 0 and curv > 0):
            break
        lo, hi = hi, 2.0 * hi
        if hi > MAX_BETA:
            return math.inf
    beta = 0.5 * (lo + hi)
    for _ in range(MAX_STEPS):
        grad, curv, _ = _rows(z, q, beta)
        if grad < 0:
            lo = beta
        else:
            hi = beta
        step = beta - grad / curv if curv > 0 else math.nan
        nxt = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(nxt - beta) <= TOL * max(beta, 1e-300) or hi - lo <= TOL * hi:
            return nxt
        beta = nxt
    raise ArithmeticError(f"no convergence on N = {n} rows after {MAX_STEPS} steps")


def _kl_rows(z: np.ndarray, q: np.ndarray, beta: float) -> np.ndarray:
    """Per row, ``KL(q || softmax(beta z))`` (0 log 0 = 0)."""
    out = np.empty(z.shape[0])
    for rows in row_chunks(*z.shape):
        c = beta * (z[rows] - z[rows].max(axis=1, keepdims=True))
        log_p = c - np.log(np.exp(c).sum(axis=1, keepdims=True))
        qq = q[rows]
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(qq > 0, qq * (np.log(qq) - log_p), 0.0)
        out[rows] = terms.sum(axis=1)
    return np.maximum(out, 0.0)


def _discordance(z: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """Per row, the share of pairs among B's top-``k`` classes that A orders the other way."""
    top = np.argpartition(-q, k - 1, axis=1)[:, :k]
    top = np.take_along_axis(top, np.argsort(-np.take_along_axis(q, top, axis=1), axis=1), axis=1)
    a = np.take_along_axis(z, top, axis=1)  # A's scores on B's top-k, in B's order
    i, j = np.triu_indices(k, 1)
    return (a[:, i] < a[:, j]).mean(axis=1)  # B ranks i above j; A ranks it below


def _summary(values: np.ndarray) -> dict[str, float]:
    median, p95 = np.percentile(values, [50.0, 95.0])
    return {"mean": float(values.mean()), "median": float(median), "p95": float(p95)}


def temperature_explains(scores_a, scores_b, *, kind_a: str = "logits",
                         kind_b: str = "logits", top_k: int = 10) -> dict:
    """How much of model B's difference from model A one temperature explains.

    Parameters
    ----------
    scores_a, scores_b : array-like of shape (n_samples, n_classes)
        The two models' scores on the same rows, in the same class order.
    kind_a, kind_b : {"logits", "probabilities"}
    top_k : int, default 10
        Size of B's top classes the rank agreement looks at (at most K).

    Returns
    -------
    dict
        ``beta``: ``beta*`` (A tempered by it is the closest to B); ``kl_before`` and
        ``kl_after``: the per-row ``KL(B || A)`` and ``KL(B || A_beta*)`` (mean,
        median, p95); ``explained``: ``1 - kl_after / kl_before`` on the means (None
        when B equals A); ``explained_beyond_flat``: ``1 - kl_after / KL(B || U)``
        (None when B is uniform); both None when ``beta`` is infinite;
        ``top1_agreement``; ``discordance``: the per-row share of B's top-k pairs A
        orders the other way (mean, median, p95); ``top_k``, ``n``.

    Examples
    --------
    >>> z = np.random.default_rng(0).normal(size=(500, 8))
    >>> q = np.exp(2.5 * z) / np.exp(2.5 * z).sum(axis=1, keepdims=True)
    >>> out = temperature_explains(z, q, kind_b="probabilities", top_k=4)
    >>> round(out["beta"], 8), round(out["explained"], 8), out["discordance"]["p95"]
    (2.5, 1.0, 0.0)
    """
    a = as_scores(scores_a, kind_a)
    b = as_scores(scores_b, kind_b, n_classes=a.shape[1])
    if b.shape != a.shape:
        raise CalibrationInputError(
            f"the two models' scores must have the same shape. Got {a.shape} and {b.shape}."
        )
    k = a.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or not 2 <= top_k <= k:
        raise CalibrationInputError(f"top_k must be an integer in [2, {k}]. Got {top_k!r}.")
    z = logits64(a, kind_a)
    zb = logits64(b, kind_b)
    zb = zb - zb.max(axis=1, keepdims=True)
    q = np.exp(zb)
    q /= q.sum(axis=1, keepdims=True)
    beta = closest_temperature(z, q)
    before = _kl_rows(z, q, 1.0)
    flat = _kl_rows(z, q, 0.0)  # KL(B || U)
    after = _kl_rows(z, q, beta) if math.isfinite(beta) else None
    explained = beyond_flat = None
    if after is not None and before.mean() > 0:
        explained = 1.0 - float(after.mean() / before.mean())
    if after is not None and flat.mean() > 0:
        beyond_flat = 1.0 - float(after.mean() / flat.mean())
    return {
        "n": int(z.shape[0]),
        "beta": beta,
        "kl_before": _summary(before),
        "kl_after": None if after is None else _summary(after),
        "explained": explained,
        "explained_beyond_flat": beyond_flat,
        "top1_agreement": float((z.argmax(axis=1) == q.argmax(axis=1)).mean()),
        "top_k": int(top_k),
        "discordance": _summary(_discordance(z, q, int(top_k))),
    }
