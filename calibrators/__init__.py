"""welltempered.calibrators: exact post-hoc calibration of classifier scores.

Temperature, vector, matrix and Dirichlet scaling are one model,
``softmax(W * phi(z) + b)`` (see :mod:`calibrators.base`). Every calibrator
has ``fit``, ``predict_proba``, ``to_params``, ``to_onnx`` and
``preserves_argmax``; :func:`create` and :func:`from_params` build them.
"""

from __future__ import annotations

from typing import Any

from calibrators.base import PARAMS_FORMAT, Calibrator
from calibrators.linear import DirichletScaler, MatrixScaler, VectorScaler
from calibrators.temperature import TemperatureScaler
from calibrators.validation import CalibrationInputError, NotFittedError

_CLASSES: dict[str, type[Calibrator]] = {
    cls.method: cls for cls in (TemperatureScaler, VectorScaler, MatrixScaler, DirichletScaler)
}
#: The method names accepted by :func:`create`.
METHODS: tuple[str, ...] = tuple(_CLASSES)

__all__ = [
    "METHODS",
    "CalibrationInputError",
    "Calibrator",
    "DirichletScaler",
    "MatrixScaler",
    "NotFittedError",
    "TemperatureScaler",
    "VectorScaler",
    "create",
    "from_params",
]


def create(method: str, **options: Any) -> Calibrator:
    """A new, unfitted calibrator.

    Parameters
    ----------
    method : {"temperature", "vector", "matrix", "dirichlet"}
    **options
        Keyword options of the calibrator's class.

    Examples
    --------
    >>> create("temperature")
    TemperatureScaler(target_entropy=None, tol=1e-10, max_passes=50)
    """
    if method not in _CLASSES:
        raise CalibrationInputError(f"method must be one of {', '.join(METHODS)}. Got {method!r}.")
    try:
        return _CLASSES[method](**options)
    except TypeError as exc:
        raise CalibrationInputError(
            f"invalid options for {method}: {exc}. Got {options!r}."
        ) from None


def from_params(params: dict[str, Any]) -> Calibrator:
    """Rebuild a fitted calibrator from :meth:`Calibrator.to_params` output.

    The result predicts exactly (bit for bit) what the original predicted.
    """
    if not isinstance(params, dict):
        raise CalibrationInputError(f"params must be a dict. Got {type(params).__name__}.")
    fmt = params.get("format", PARAMS_FORMAT)
    if fmt != PARAMS_FORMAT:
        raise CalibrationInputError(f"params format must be {PARAMS_FORMAT!r}. Got {fmt!r}.")
    missing = {"method", "n_classes", "weight"} - params.keys()
    if missing:
        raise CalibrationInputError(
            f"params must have keys method, n_classes, weight. Got none for {sorted(missing)}."
        )
    cal = create(params["method"], **(params.get("options") or {}))
    cal._load_params(params)
    return cal
