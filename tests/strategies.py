"""Shared hypothesis strategies: labelled logit matrices of awkward shapes."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@st.composite
def logits_and_labels(draw, *, min_rows=1, max_rows=40, min_classes=2, max_classes=12,
                      max_magnitude=50.0, dtype=np.float64):
    """(logits (N, K), labels (N,)) with finite entries of magnitude <= max_magnitude."""
    n = draw(st.integers(min_rows, max_rows))
    k = draw(st.integers(min_classes, max_classes))
    elements = st.floats(-max_magnitude, max_magnitude, allow_nan=False, width=32)
    z = draw(hnp.arrays(dtype, (n, k), elements=elements))
    y = draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, k - 1)))
    return z, y


@st.composite
def fitted_linear_params(draw, k: int, structure: str):
    """Random (weight, bias) of a given structure for K classes."""
    w_el = st.floats(-3, 3, allow_nan=False, width=32)
    if structure == "scalar":
        return draw(st.floats(0.05, 20.0)), None
    shape = (k,) if structure == "diagonal" else (k, k)
    weight = draw(hnp.arrays(np.float64, shape, elements=w_el))
    bias = draw(hnp.arrays(np.float64, (k,), elements=w_el))
    return weight, bias
