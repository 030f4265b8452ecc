"""Matrix scaling: a full matrix and bias on the centred log-ratio.

The fit, its penalty towards temperature scaling and its search are shared with
the other two of the family: :mod:`calibrators.methods._linear`.
"""

from __future__ import annotations

from calibrators.methods._linear import LinearScaler


class MatrixScaler(LinearScaler):
    """Matrix scaling: ``softmax(W clr(z) + b)`` with a full ``W``, penalised towards
    temperature scaling.

    ``clr(z)`` as for :class:`VectorScaler`. Parameters are those of the shared fit
    (see :mod:`calibrators.methods._linear`).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(200, 3))
    >>> y = (z.argmax(axis=1) + 1) % 3  # the model is always one class off
    >>> cal = MatrixScaler(reg_lambda=0.1, reg_mu=0.1).fit(z, y)
    >>> cal.weight_.shape, cal.fit_info_["converged"]
    ((3, 3), True)
    >>> float((cal.predict_proba(z).argmax(axis=1) == y).mean()) > 0.9
    True
    """

    method = "matrix"
    structure = "full"
    feature = "clr"
    format_1_feature = "logits"
