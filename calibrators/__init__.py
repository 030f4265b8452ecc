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
from calibrators.cost import Cost, largest_classes
from calibrators.methods.dirichlet import DirichletScaler
from calibrators.methods.ets import EnsembleTemperatureScaler
from calibrators.methods.iop import IntraOrderPreserving
from calibrators.methods.matrix import MatrixScaler
from calibrators.methods.prior_shift import PriorShift
from calibrators.methods.pts import ParameterizedTemperatureScaler
from calibrators.methods.row_entropy import RowEntropyTemperature
from calibrators.methods.sms import StructuredMatrixScaler
from calibrators.methods.svs import StructuredVectorScaler
from calibrators.methods.temperature import TemperatureScaler
from calibrators.methods.vector import VectorScaler
from calibrators.validation import (
    CalibrationInputError,
    KindError,
    NotFittedError,
    check_integer,
)

#: The registry: method name -> calibrator class. A new method is one module and
#: one line here.
CALIBRATORS: dict[str, type[Calibrator]] = {
    cls.method: cls
    for cls in (
        TemperatureScaler,
        VectorScaler,
        MatrixScaler,
        DirichletScaler,
        StructuredVectorScaler, StructuredMatrixScaler,
        EnsembleTemperatureScaler,
        ParameterizedTemperatureScaler,
        IntraOrderPreserving,
        PriorShift,
        RowEntropyTemperature,
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
    "Cost",
    "DirichletScaler",
    "EnsembleTemperatureScaler",
    "IntraOrderPreserving",
    "KindError",
    "MatrixScaler",
    "NotFittedError",
    "ParameterizedTemperatureScaler",
    "PriorShift",
    "RowEntropyTemperature",
    "TemperatureScaler",
    "VectorScaler",
    "check_options",
    "create",
    "estimate_cost",
    "from_params",
    "max_classes",
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
        ones), or an invalid option value (see ``Calibrator.checked_options``).

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
    return _calibrator_class(method).with_options(options)


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
    return _calibrator_class(method).with_options(options).checked_options()


def from_params(params: dict[str, Any]) -> Calibrator:
    """Rebuild a fitted calibrator from :meth:`Calibrator.to_params` output.

    The result predicts exactly (bit for bit) what the original predicted.

    Parameters
    ----------
    params : dict
        ``format`` (optional, :data:`PARAMS_FORMAT`; format 1 is read too, see
        :class:`calibrators.base.Calibrator`), ``method``, ``n_classes``, ``kind``
        (optional: the kind of scores it was fitted on), ``options`` (optional), the
        method's fitted arrays (``weight`` and ``bias`` for the four scalers) and
        ``fit_info`` (optional).

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


def estimate_cost(
    method: str, n_samples: int, n_classes: int, options: Mapping[str, Any] | None = None,
    *, itemsize: int = 4,
) -> Cost:
    """What fitting ``method`` on N x K scores will cost, before fitting.

    Each class states its model as formulas in N, K and its options
    (``fit_cost``; see :mod:`calibrators.cost`).

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    n_samples : int
        N, the rows the fit gets (>= 1).
    n_classes : int
        K (>= 2).
    options : mapping of str to value, optional
        The method's options, as :func:`create` takes them.
    itemsize : int, default 4
        Bytes per score of the input (4: float32, 8: float64).

    Returns
    -------
    Cost
        ``bytes`` (working memory of the fit, beyond its input), ``input_bytes``
        (``N * K * itemsize``), ``total_bytes`` (their sum) and ``flops``.

    Raises
    ------
    CalibrationInputError
        As :func:`check_options`, or N, K or ``itemsize`` are not integers >= 1, 2, 1.

    Examples
    --------
    >>> cost = estimate_cost("temperature", 2_000, 262_144)
    >>> cost.input_bytes == 2_000 * 262_144 * 4, cost.bytes < cost.input_bytes // 50
    (True, True)
    """
    cls = _calibrator_class(method)
    options = cls.with_options(options or {}).checked_options()
    n = check_integer("n_samples", n_samples, minimum=1)
    k = check_integer("n_classes", n_classes, minimum=2)
    size = check_integer("itemsize", itemsize, minimum=1)
    cost = cls.fit_cost(n, k, options)
    return Cost(bytes=cost.bytes, flops=cost.flops, input_bytes=n * k * size)


def max_classes(
    method: str, n_samples: int, budget_bytes: int, options: Mapping[str, Any] | None = None,
    *, itemsize: int = 4,
) -> int:
    """The largest K for which fitting ``method`` on N rows fits in ``budget_bytes``.

    The input itself counts (``total_bytes`` of :func:`estimate_cost`).

    Parameters
    ----------
    method : str
    n_samples : int
    budget_bytes : int
        Memory available to the fit, input included.
    options : mapping of str to value, optional
    itemsize : int, default 4

    Returns
    -------
    int
        K >= 2, or 0 when not even two classes fit.

    Examples
    --------
    >>> k = max_classes("matrix", 500, 8 * 2**30, {"reg_lambda": 1.0, "reg_mu": 1.0})
    >>> estimate_cost("matrix", 500, k, {"reg_lambda": 1.0, "reg_mu": 1.0}).total_bytes <= 8 * 2**30
    True
    >>> max_classes("temperature", 10, 1000)
    0
    """
    cls = _calibrator_class(method)
    canonical = cls.with_options(options or {}).checked_options()
    n = check_integer("n_samples", n_samples, minimum=1)
    budget = check_integer("budget_bytes", budget_bytes, minimum=0)
    size = check_integer("itemsize", itemsize, minimum=1)

    def cost(k: int) -> Cost:
        c = cls.fit_cost(n, k, canonical)
        return Cost(bytes=c.bytes, flops=c.flops, input_bytes=n * k * size)

    return largest_classes(cost, budget)
