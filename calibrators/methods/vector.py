"""Vector scaling: a per-class scale and bias on the centred log-ratio.

The fit, its penalty towards temperature scaling and its search are shared with
the other two of the family: :mod:`calibrators.methods._linear`.
"""

from __future__ import annotations

from calibrators.methods._linear import LinearScaler


class VectorScaler(LinearScaler):
    """Vector scaling: ``softmax(w * clr(z) + b)`` with a per-class scale and bias.

    ``clr(z)`` is the centred log-ratio of the logits
    (:func:`calibrators.validation.centred_log_ratio`), so logits with any per-row
    constant and the probabilities of the same distribution get one answer.
    Parameters are those of the shared fit (see :mod:`calibrators.methods._linear`);
    ``reg_lambda`` weighs the scales' distance from temperature scaling's ``beta``.
    """

    method = "vector"
    structure = "diagonal"
    feature = "clr"
    format_1_feature = "logits"
