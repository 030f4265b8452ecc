"""Dirichlet calibration: a full matrix and bias on the log-probabilities.

The fit, its penalty towards temperature scaling and its search are shared with
the other two of the family: :mod:`calibrators.methods._linear`.
"""

from __future__ import annotations

from calibrators.methods._linear import LinearScaler


class DirichletScaler(LinearScaler):
    """Dirichlet calibration: ``softmax(W log_softmax(z) + b)``, penalised towards
    temperature scaling (see :mod:`calibrators.methods._linear`)."""

    method = "dirichlet"
    structure = "full"
    feature = "log_softmax"
