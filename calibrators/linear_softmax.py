"""The ``softmax(W * phi(z) + b)`` family: temperature, vector, matrix, Dirichlet scaling.

One model; a subclass sets three class attributes (the structure of ``W``, whether
``b`` exists, the feature map ``phi``) and implements ``_fit``. The numpy map, the
ONNX subgraph and the fitted arrays (``weight``, ``bias``) follow from them.

============  ===========  ========  ====================  ===============
method        ``W``        ``b``     ``phi(z)``            keeps argmax
============  ===========  ========  ====================  ===============
temperature   scalar beta  no        z                     always
vector        diagonal     yes       z                     not guaranteed
matrix        full         yes       z                     not guaranteed
dirichlet     full         yes       log_softmax(z)        not guaranteed
============  ===========  ========  ====================  ===============

Examples
--------
>>> from calibrators import from_params
>>> cal = from_params({"method": "vector", "n_classes": 3,
...                    "weight": [1.0, 2.0, 1.0], "bias": [0.0, 0.0, -1.0]})
>>> cal.predict_proba([[0.0, 0.5, 1.0]]).round(4).tolist()
[[0.2119, 0.5761, 0.2119]]
>>> cal.preserves_argmax, type(cal).fitted_arrays
(False, {'weight': ('n_classes',), 'bias': ('n_classes',)})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

from calibrators.base import Calibrator
from calibrators.numerics import log_softmax

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
    feature : {"logits", "log_softmax"}, default "logits"
        ``phi``: the identity, or the row-wise log-softmax.

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
    onnx_graph_name = "linear_softmax"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if hasattr(cls, "structure") and hasattr(cls, "has_bias"):  # a concrete method
            cls.fitted_arrays = {
                "weight": WEIGHT_SHAPES[cls.structure],
                "bias": ("n_classes",) if cls.has_bias else None,
            }

    def _forward(self, z: np.ndarray) -> np.ndarray:
        x = log_softmax(z) if self.feature == "log_softmax" else z
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
