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
def calibrator_params(draw, cls, *, min_classes=3, max_classes=8):
    """``to_params()``-shaped params of calibrator class ``cls`` with random fitted arrays.

    Arrays follow ``cls.fitted_arrays``: a float (shape ``()``) in [0.05, 20], other
    shapes with entries in [-3, 3], absent ones None. Default options.
    """
    k = draw(st.integers(min_classes, max_classes))
    sizes = {"n_classes": k, **cls().get_options()}
    params = {"method": cls.method, "n_classes": k}
    for name, shape in cls.fitted_arrays.items():
        if shape is None:
            params[name] = None
        elif shape == ():
            params[name] = draw(st.floats(0.05, 20.0))
        else:
            dims = tuple(sizes[d] if isinstance(d, str) else d for d in shape)
            elements = st.floats(-3, 3, allow_nan=False, width=32)
            params[name] = draw(hnp.arrays(np.float64, dims, elements=elements)).tolist()
    return params
