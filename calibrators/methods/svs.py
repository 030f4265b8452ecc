"""Structured vector scaling (SVS; Berta et al., 2025).

The robust features, the penalty rule and its search are shared with the other of
the pair: :mod:`calibrators.methods._structured`.
"""

from __future__ import annotations

from calibrators.methods._structured import StructuredScaler


class StructuredVectorScaler(StructuredScaler):
    """Structured vector scaling (SVS): ``softmax(w * x + b)`` on the robust features.

    Parameters are those of the shared fit (see :mod:`calibrators.methods._structured`);
    ``reg_off_diagonal`` has no effect (there are no off-diagonal weights).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> y = rng.integers(0, 3, 600)
    >>> z = 4.0 * rng.normal(size=(600, 3))
    >>> z[np.arange(600), y] += 4.0  # informative but over-confident logits
    >>> cal = StructuredVectorScaler().fit(z, y)
    >>> cal.weight_.shape, cal.fit_info_["converged"], 0 < cal.beta_ < 1
    ((3,), True, True)
    """

    method = "svs"
    structure = "diagonal"
