"""Per-row NLL of tempered softmaxes and its first two derivatives in the temperature.

``f(beta) = logsumexp(beta c) - beta c_y`` is convex in ``beta`` with ``f' = E_p[c] -
c_y`` and ``f'' = Var_p(c)``: the Newton steps of the parameterised and ensemble
temperature scalers (:mod:`calibrators.methods.pts`, :mod:`calibrators.methods.ets`)
are built on it.
"""

from __future__ import annotations

import numpy as np

from calibrators.numerics import map_chunks
from calibrators.validation import logits64


def nll_terms(x: np.ndarray, y: np.ndarray, kind: str, beta) -> np.ndarray:
    """Per row, ``f(beta_n) = logsumexp(beta_n c_n) - beta_n c_n,y`` and its two derivatives.

    One pass over the scores in row chunks (``c = z - max z``; float64
    temporaries of one chunk per thread).

    Parameters
    ----------
    x : ndarray of shape (n_samples, n_classes)
        Validated scores.
    y : ndarray of shape (n_samples,), int
    kind : {"logits", "probabilities"}
    beta : float or ndarray of shape (n_samples,)
        Inverse temperature, one for all rows or one per row (> 0).

    Returns
    -------
    ndarray of shape (n_samples, 3)
        ``f``, ``f' = E_p[c] - c_y`` and ``f'' = Var_p(c) >= 0``, with
        ``p = softmax(beta_n c_n)``; ``-f`` is the log-probability of the label.
    """
    per_row = np.ndim(beta) == 1

    def chunk(rows: slice) -> np.ndarray:
        c = logits64(x[rows], kind)
        c -= c.max(axis=1, keepdims=True)
        cy = np.take_along_axis(c, y[rows, None], axis=1)[:, 0]
        b = beta[rows] if per_row else np.full(c.shape[0], float(beta))
        e = np.multiply(c, b[:, None])
        np.exp(e, out=e)
        total = e.sum(axis=1)
        m1 = np.einsum("ij,ij->i", e, c) / total
        e *= c
        m2 = np.einsum("ij,ij->i", e, c) / total
        return np.stack([np.log(total) - b * cy, m1 - cy, np.maximum(m2 - m1 * m1, 0.0)], axis=1)

    return np.concatenate(map_chunks(chunk, *x.shape))
