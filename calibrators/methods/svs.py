"""Structured vector scaling (SVS; Berta et al., 2025).

The robust features, the penalty rule and its search are shared with the other of
the pair: :mod:`calibrators.methods._structured`.
"""

from __future__ import annotations

from calibrators.methods._structured import StructuredScaler

#: svs's default multipliers of the paper's rule, strongest first (after the
#: infinite one, temperature scaling): factors of 8 from the rule itself, where
#: sms's :data:`calibrators.methods._structured.DEFAULT_GRID` has factors of 4 from
#: 4 times it. svs's CV curve is flat around its minimum, so the coarser grid
#: chooses the same penalty on the CIFAR-100 splits and no worse ones on CIFAR-10
#: (``bench/svs_splits.py``) with 4 candidates fitted per fold instead of 6 on
#: CIFAR-100: 15 % less of the fit's time (``bench/README.md``, issue 21's fit-time
#: goal). 4 times the rule, the old strongest point, was chosen on 1 of 10 splits,
#: by 0.00014 of CV NLL, and lost to the rule on its held-out half.
SVS_GRID = (1.0, 1 / 8, 1 / 64, 1 / 512)


class StructuredVectorScaler(StructuredScaler):
    """Structured vector scaling (SVS): ``softmax(w * x + b)`` on the robust features.

    Parameters are those of the shared fit (see :mod:`calibrators.methods._structured`)
    but for ``grid``, whose default is :data:`SVS_GRID`; ``reg_off_diagonal`` has no
    effect (there are no off-diagonal weights).

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

    def __init__(
        self,
        *,
        reg_off_diagonal: float | None = None,
        reg_diagonal: float | None = None,
        reg_intercept: float | None = None,
        grid=SVS_GRID,
        n_folds: int = 4,
        max_iter: int = 1000,
        tol: float = 1e-9,
    ):
        super().__init__(reg_off_diagonal=reg_off_diagonal, reg_diagonal=reg_diagonal,
                         reg_intercept=reg_intercept, grid=grid, n_folds=n_folds,
                         max_iter=max_iter, tol=tol)
