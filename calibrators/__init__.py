"""welltempered.calibrators: exact post-hoc calibration of classifier scores.

Temperature, vector, matrix and Dirichlet scaling are one model,
``softmax(W * phi(z) + b)``; see :mod:`calibrators.scalers`.
"""

from calibrators._input import CalibrationInputError, NotFittedError

__all__ = [
    "CalibrationInputError",
    "NotFittedError",
]
