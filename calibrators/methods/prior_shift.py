"""Prior-shift correction: a base calibrator's map plus a log-weight per class.

Under label shift (the class frequencies change, each class looks the same) the
calibrated probabilities of the new population are
``p'(y | x) ∝ p(y | x) w_y``, ``w_y`` the new prior of class ``y`` over the old
(Saerens et al. 2002). On calibrated logits that is one addition,
``u'(z) = u(z) + log w``, so the corrected version is any fitted calibrator
(:attr:`PriorShift.base_`) followed by a constant shift: it serves through ONNX
like any version (the constant is added to the base graph's calibrated logits),
and it can change the argmax (a heavier class wins ties it did not), so the argmax
policy applies to it.

The weights come from production, not from a labelled fit:
:func:`calibrators.evaluation.shift.bbse` estimates them from served
predicted-class counts, and :meth:`PriorShift.from_base` builds the corrected
version from a fitted base. :meth:`~calibrators.base.Calibrator.fit` on labelled
rows fits the base and sets every weight to 1 (no shift is known from rows whose
priors are the training ones), so the registry's contract holds; ``auto`` does not
try it (``learns_from_labels``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from calibrators.base import Calibrator
from calibrators.cost import Cost
from calibrators.validation import CalibrationInputError

if TYPE_CHECKING:
    from calibrators.onnx_export import GraphBuilder

#: The base a fit uses unless told.
DEFAULT_BASE = "temperature"


def _registry() -> dict[str, type[Calibrator]]:
    # The registry imports this module: read it when called, not at import.
    import calibrators

    return calibrators.CALIBRATORS


def check_base(name: str, value: Any) -> str:
    """A registered method other than prior-shift itself."""
    methods = [m for m in _registry() if m != PriorShift.method]
    if not isinstance(value, str) or value not in methods:
        raise CalibrationInputError(
            f"{name} must be one of {', '.join(methods)}. Got {value!r}."
        )
    return value


class PriorShift(Calibrator):
    """A fitted base calibrator with class log-weights added to its calibrated logits.

    Parameters
    ----------
    base : str, default "temperature"
        The method a :meth:`fit` fits as the base (:data:`calibrators.METHODS`, not
        this one).

    Attributes
    ----------
    base_ : Calibrator
        The fitted base; ``to_params()["base"]`` holds its params.
    log_weight_ : ndarray of shape (n_classes,)
        ``log w``: new class priors over the base's training priors.

    Examples
    --------
    >>> import numpy as np
    >>> from calibrators import create
    >>> z = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.0, 2.0]] * 20)
    >>> base = create("temperature").fit(z, [0, 1, 2] * 20)
    >>> shifted = PriorShift.from_base(base, [3.0, 1.0, 1.0])
    >>> p, q = base.predict_proba(z[:1]), shifted.predict_proba(z[:1])
    >>> bool(np.allclose(q, p * [3, 1, 1] / (p @ [3, 1, 1])))
    True
    """

    method = "prior-shift"
    option_checks: ClassVar[dict] = {"base": check_base}
    #: A fit on labelled rows is its base's, with every weight 1: ``auto`` would fit
    #: the base twice.
    learns_from_labels = False
    fitted_arrays: ClassVar[dict] = {"log_weight": ("n_classes",)}
    onnx_graph_name = "prior_shift"

    def __init__(self, *, base: str = DEFAULT_BASE):
        self.base = base

    @classmethod
    def fit_cost(cls, n_samples: int, n_classes: int, options: Mapping[str, Any]) -> Cost:
        """The base's fit (the weights cost nothing)."""
        base = _registry()[options["base"]]
        return base.fit_cost(n_samples, n_classes, base.with_options({}).checked_options())

    @classmethod
    def from_base(cls, base: Calibrator, weights) -> Self:
        """The prior-corrected version of a fitted ``base``.

        Parameters
        ----------
        base : Calibrator
            Fitted; not itself a PriorShift (weights compose: multiply them).
        weights : array-like of shape (n_classes,)
            Positive: new priors over the base's training priors (the ``weights`` of
            :func:`calibrators.evaluation.shift.bbse`).
        """
        if isinstance(base, PriorShift):
            raise CalibrationInputError(
                "base must not be a prior-shift calibrator: multiply the weights instead. "
                "Got a PriorShift."
            )
        base._check_fitted()
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (base.n_classes_,) or not (np.isfinite(w).all() and (w > 0).all()):
            raise CalibrationInputError(
                f"weights must be {base.n_classes_} positive finite numbers. Got {weights!r}."
            )
        cal = cls(base=base.method)
        cal.base_ = base
        cal.log_weight_ = np.log(w)
        cal.fit_info_ = {"base_fit_info": base.fit_info_}
        cal.kind_ = base.kind_
        cal.n_classes_ = base.n_classes_
        return cal

    def _fit(self, x, y, *, kind, options, progress) -> dict[str, Any]:
        base = _registry()[options["base"]]()
        self.base_ = base.fit(x, y, kind=kind, progress=progress)
        self.log_weight_ = np.zeros(x.shape[1])
        return {"base_fit_info": self.base_.fit_info_}

    @property
    def input_kinds(self) -> tuple[str, ...]:
        return self.base_.input_kinds

    def _forward(self, z: np.ndarray) -> np.ndarray:
        return self.base_._forward(z) + self.log_weight_

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        u = self.base_._onnx_forward(graph, z)
        return graph.node("Add", [u, graph.constant(self.log_weight_, "log_weight")], "shifted")

    def to_params(self) -> dict[str, Any]:
        """The base's params under ``base``, beside ``log_weight``."""
        return {**super().to_params(), "base": self.base_.to_params()}

    def _load_params(self, params: Mapping[str, Any]) -> None:
        base = params.get("base")
        if not isinstance(base, Mapping):
            raise CalibrationInputError(
                f"params base for {self.method} must be a base calibrator's params. "
                f"Got {base!r}."
            )
        loaded = _registry()[check_base("params base method", base.get("method"))]
        fitted = loaded.from_params(base)
        if fitted.method != self.base:
            raise CalibrationInputError(
                f"params base is a {fitted.method} calibrator, options base says "
                f"{self.base!r}. Got both."
            )
        super()._load_params(params)
        if self.n_classes_ != fitted.n_classes_:
            raise CalibrationInputError(
                f"params base has {fitted.n_classes_} classes, the weights {self.n_classes_}. "
                "Got both."
            )
        self.base_ = fitted
