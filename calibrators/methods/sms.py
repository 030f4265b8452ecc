"""Structured matrix scaling (SMS; Berta et al., 2025).

The robust features, the penalty rule and its search are shared with the other of
the pair: :mod:`calibrators.methods._structured`.
"""

from __future__ import annotations

from calibrators.methods._structured import StructuredScaler


class StructuredMatrixScaler(StructuredScaler):
    """Structured matrix scaling (SMS): ``softmax(W x + b)`` on the robust features.

    Parameters are those of the shared fit (see :mod:`calibrators.methods._structured`).

    Examples
    --------
    >>> import numpy as np
    >>> from calibrators.evaluation.metrics import nll_loss
    >>> from calibrators.numerics import softmax
    >>> rng = np.random.default_rng(0)
    >>> y = rng.integers(0, 3, 600)
    >>> z = 4.0 * rng.normal(size=(600, 3))
    >>> z[np.arange(600), y] += 4.0  # informative but over-confident logits
    >>> cal = StructuredMatrixScaler().fit(z, y)
    >>> cal.weight_.shape, cal.fit_info_["converged"]
    ((3, 3), True)
    >>> nll_loss(cal.predict_proba(z), y) < nll_loss(softmax(z), y)
    True
    """

    method = "sms"
    structure = "full"
