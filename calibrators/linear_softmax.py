"""The ``softmax(W * phi(z) + b)`` family: temperature, vector, matrix, Dirichlet scaling.

One model; a subclass sets three class attributes (the structure of ``W``, whether
``b`` exists, the feature map ``phi``) and implements ``_fit``. The numpy map, the
ONNX subgraph and the fitted arrays (``weight``, ``bias``) follow from them.

============  ===========  ========  ====================  ===============
method        ``W``        ``b``     ``phi(z)``            keeps argmax
============  ===========  ========  ====================  ===============
temperature   scalar beta  no        z                     always
vector        diagonal     yes       clr(z)                not guaranteed
matrix        full         yes       clr(z)                not guaranteed
dirichlet     full         yes       log_softmax(z)        not guaranteed
============  ===========  ========  ====================  ===============

Every ``phi`` gives one answer per distribution: ``beta z`` moves by a per-row
constant when ``z`` does (softmax ignores it), and ``clr(z)`` (the centred
log-ratio of :func:`calibrators.validation.centred_log_ratio`) and
``log_softmax(z)`` do not move at all. Params of format 1 of vector and matrix
scaling used ``phi(z) = z``, whose answer moves with that constant; they are still
read, and keep that map (:meth:`LinearSoftmax.input_kinds`).

Examples
--------
>>> from calibrators import from_params
>>> cal = from_params({"method": "vector", "n_classes": 3,
...                    "weight": [1.0, 2.0, 1.0], "bias": [0.0, 0.0, -1.0]})
>>> cal.predict_proba([[0.0, 0.5, 1.0]]).round(4).tolist()
[[0.2741, 0.4519, 0.2741]]
>>> cal.predict_proba([[10.0, 10.5, 11.0]]).round(4).tolist()
[[0.2741, 0.4519, 0.2741]]
>>> cal.preserves_argmax, type(cal).fitted_arrays
(False, {'weight': ('n_classes',), 'bias': ('n_classes',)})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

from calibrators.base import PARAMS_FORMAT, PARAMS_FORMAT_1, Calibrator
from calibrators.numerics import log_softmax
from calibrators.validation import KINDS, centred_log_ratio

if TYPE_CHECKING:  # ONNX is imported by to_onnx only, not with the package
    from calibrators.onnx_export import Feature, GraphBuilder

Structure = Literal["scalar", "diagonal", "full"]
#: Shape of ``W`` for each structure (``n_classes`` is K).
WEIGHT_SHAPES: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "diagonal": ("n_classes",),
    "full": ("n_classes", "n_classes"),
}


class LinearSoftmax(Calibrator):
    """Base class of the ``softmax(W * phi(z) + b)`` family.

    Class attributes of a subclass
    ------------------------------
    structure : {"scalar", "diagonal", "full"}
        ``W`` is a float, an ndarray of shape (K,) or of shape (K, K).
    has_bias : bool
        Whether ``b``, an ndarray of shape (K,), exists.
    feature : {"logits", "clr", "log_softmax"}, default "logits"
        ``phi``: the identity, the centred log-ratio
        (:func:`calibrators.validation.centred_log_ratio`) or the row-wise
        log-softmax. A calibrator read from params of format 1 has the feature of
        that format (``format_1_feature``) as an instance attribute.
    format_1_feature : str or None
        ``phi`` in params of format 1, when it differs (vector, matrix: ``"logits"``).

    Attributes set by :meth:`fit`
    -----------------------------
    weight_ : float or ndarray of shape (K,) or (K, K)
    bias_ : ndarray of shape (K,) or None
    n_classes_ : int
    fit_info_ : dict
    """

    structure: ClassVar[Structure]
    has_bias: ClassVar[bool]
    feature: ClassVar[Feature] = "logits"
    format_1_feature: ClassVar[Feature | None] = None
    onnx_graph_name = "linear_softmax"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if hasattr(cls, "structure") and hasattr(cls, "has_bias"):  # a concrete method
            cls.fitted_arrays = {
                "weight": WEIGHT_SHAPES[cls.structure],
                "bias": ("n_classes",) if cls.has_bias else None,
            }

    def _load_format(self, fmt: str) -> None:
        if fmt == PARAMS_FORMAT_1 and self.format_1_feature is not None:
            self.feature = self.format_1_feature

    def _params_format(self) -> str:
        return PARAMS_FORMAT_1 if self.feature != type(self).feature else PARAMS_FORMAT

    @property
    def input_kinds(self) -> tuple[str, ...]:
        """Both kinds, except for a map on the raw logits with a bias or a per-class
        weight (vector and matrix scaling read from params of format 1): its answer
        moves with the per-row constant of the logits, so it is given only for the
        kind it was fitted on (both when the params do not say, as format 1 did)."""
        shift_free = self.feature != "logits" or (self.structure == "scalar"
                                                  and not self.has_bias)
        if shift_free or self.kind_ is None:
            return KINDS
        return (self.kind_,)

    def _phi(self, z: np.ndarray) -> np.ndarray:
        """The features ``phi(z)`` of a float64 block of logits (``z`` itself for the
        identity)."""
        if self.feature == "log_softmax":
            return log_softmax(z)
        if self.feature == "clr":
            return centred_log_ratio(z)
        return z

    def _forward(self, z: np.ndarray) -> np.ndarray:
        x = self._phi(z)
        if self.structure == "scalar":
            return x * self.weight_
        if self.structure == "diagonal":
            return x * self.weight_ + self.bias_
        return x @ self.weight_.T + self.bias_

    def _onnx_forward(self, graph: GraphBuilder, z: str) -> str:
        from calibrators.onnx_export import linear_subgraph

        return linear_subgraph(
            graph, z, weight=self.weight_, bias=self.bias_, feature=self.feature
        )
