"""welltempered.calibrators: exact post-hoc calibration of classifier scores.

Every calibrator maps logits to calibrated logits and takes their softmax (see
:mod:`calibrators.base`); temperature, vector, matrix and Dirichlet scaling are
one family of them, ``softmax(W * phi(z) + b)`` (see
:mod:`calibrators.linear_softmax`). Every calibrator has ``fit``,
``predict_proba``, ``to_params``, ``to_onnx`` and ``preserves_argmax``, and is a
scikit-learn estimator (``get_params``, ``set_params``, ``clone``);
:func:`create` and :func:`from_params` build them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calibrators.base import PARAMS_FORMAT, Calibrator
from calibrators.linear import DirichletScaler, MatrixScaler, VectorScaler
from calibrators.temperature import TemperatureScaler
from calibrators.validation import CalibrationInputError, NotFittedError

#: The registry: method name -> calibrator class. A new method is one module and
#: one line here.
CALIBRATORS: dict[str, type[Calibrator]] = {
    cls.method: cls
    for cls in (
        TemperatureScaler,
        VectorScaler,
        MatrixScaler,
        DirichletScaler,
    )
}
#: The method names accepted by :func:`create`.
METHODS: tuple[str, ...] = tuple(CALIBRATORS)

__all__ = [
    "CALIBRATORS",
    "METHODS",
    "PARAMS_FORMAT",
    "CalibrationInputError",
    "Calibrator",
    "DirichletScaler",
    "MatrixScaler",
    "NotFittedError",
    "TemperatureScaler",
    "VectorScaler",
    "check_options",
    "create",
    "from_params",
]


def _calibrator_class(method: Any) -> type[Calibrator]:
    if not isinstance(method, str) or method not in CALIBRATORS:
        raise CalibrationInputError(
            f"method must be one of {', '.join(CALIBRATORS)}. Got {method!r}."
        )
    return CALIBRATORS[method]


def create(method: str, **options: Any) -> Calibrator:
    """A new, unfitted calibrator with checked options.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    **options
        Keyword options of the calibrator's class.

    Raises
    ------
    CalibrationInputError
        An unknown method, an unknown option name (the message lists the valid
        ones), or an invalid option value (see ``Calibrator.check_params``).

    Examples
    --------
    >>> create("temperature", tol=1e-8)
    TemperatureScaler(tol=1e-08)
    >>> create("temperature", reg_lambda=1.0)
    Traceback (most recent call last):
    ...
    calibrators.validation.CalibrationInputError: options of temperature must be among \
target_entropy, tol, max_passes. Got unknown 'reg_lambda'.
    """
    return _calibrator_class(method).from_options(options)


def check_options(method: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``method``, checked, as ``to_params()["options"]`` would store them.

    For a caller that holds options as data (a request body): a bad method, a
    bad option name or value raises here, before any fit.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    options : mapping of str to value

    Returns
    -------
    dict
        Every option of the method, defaults included, in canonical form.

    Raises
    ------
    CalibrationInputError
        As :func:`create`, or ``options`` is not a mapping.

    Examples
    --------
    >>> check_options("vector", {"grid": [1, 10, 10]})["grid"]
    [10.0, 1.0]
    """
    return _calibrator_class(method).from_options(options).get_options()


def from_params(params: dict[str, Any]) -> Calibrator:
    """Rebuild a fitted calibrator from :meth:`Calibrator.to_params` output.

    The result predicts exactly (bit for bit) what the original predicted.

    Parameters
    ----------
    params : dict
        ``format`` (optional, :data:`PARAMS_FORMAT`), ``method``, ``n_classes``,
        ``options`` (optional), the method's fitted arrays (``weight`` and
        ``bias`` for the four scalers) and ``fit_info`` (optional).

    Raises
    ------
    CalibrationInputError
        Anything missing, malformed or of the wrong shape.
    """
    if not isinstance(params, dict):
        raise CalibrationInputError(f"params must be a dict. Got {type(params).__name__}.")
    if "method" not in params:
        raise CalibrationInputError(f"params must have a method key. Got keys {list(params)}.")
    return _calibrator_class(params["method"]).from_params(params)
