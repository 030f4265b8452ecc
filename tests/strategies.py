"""Shared hypothesis strategies: labelled logit matrices of awkward shapes, logits
with ties and extreme values, random fitted params, any JSON value."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import calibrators


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
def same_distribution(draw, *, min_classes=3, max_classes=6):
    """(fit logits (N, K), labels (N,), logits z (M, K), z + c): one distribution per
    row of ``z`` in two representations, ``c`` a random per-row constant.

    Random rows from a drawn seed, sizes and scales, N != K, K >= 3. Entries of ``z``
    are multiples of 2**-10 in [-24, 24] and ``c`` multiples of 2**-4 in [-100, 100],
    so ``z + c`` is exact in float32 too: a float32 copy is the same distribution, and
    a difference in the answer is the calibrator's, not the input's rounding. The
    spread keeps every probability far above float64's smallest.
    """
    k = draw(st.integers(min_classes, max_classes))
    n = draw(st.integers(30, 60).filter(lambda n: n != k))
    m = draw(st.integers(1, 20))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))
    shift = draw(st.sampled_from([1.0, 30.0, 100.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    labels = rng.integers(0, k, n)
    fit = rng.normal(size=(n, k)) * scale
    fit[np.arange(n), labels] += scale  # some signal to calibrate
    z = np.round(np.clip(rng.normal(size=(m, k)) * scale, -24, 24) * 1024) / 1024
    c = np.round(rng.uniform(-shift, shift, size=(m, 1)) * 16) / 16
    return fit, labels, z, z + c


@st.composite
def tied_extreme_logits(draw):
    """Logits (N, K), N != K, K in 2..50, with ties, +-1e4 and a constant row.

    Entries are multiples of 1/64 (exact in float32) from a small pool per matrix,
    so ties are common and distinct entries differ by at least 1/64, a gap float64
    resolves (a gap below float64 rounding is lost by any softmax, temperature
    scaling's included). For the order-preservation properties of the
    accuracy-preserving calibrators.
    """
    k = draw(st.integers(2, 50))
    n = draw(st.integers(1, 30).filter(lambda n: n != k))
    pool = draw(st.lists(st.integers(-640_000, 640_000), min_size=1, max_size=6))
    pool = [v / 64 for v in pool] + [1e4, -1e4, 0.0]
    z = draw(hnp.arrays(np.float64, (n, k), elements=st.sampled_from(pool)))
    constant = draw(st.integers(0, n - 1))
    z[constant] = z[constant, 0]  # one constant row
    return z


@st.composite
def calibrator_params(draw, cls, *, min_classes=3, max_classes=8):
    """``to_params()``-shaped params of calibrator class ``cls`` with random fitted arrays.

    Arrays follow ``cls.fitted_arrays``: a float (shape ``()``) in [0.05, 20] (a
    ``target`` entropy in [0.05, log K)), other
    shapes with entries in [-3, 3], absent ones None. Default options. A class with a
    ``base`` option (a wrapper) gets a fitted base method's ``to_params()`` under
    ``base``.
    """
    k = draw(st.integers(min_classes, max_classes))
    sizes = {"n_classes": k, **cls().checked_options()}
    params = {"method": cls.method, "n_classes": k}
    for name, shape in cls.fitted_arrays.items():
        if shape is None:
            params[name] = None
        elif shape == () and name == "target":  # an entropy (row-entropy): below log K
            params[name] = draw(st.floats(0.05, math.log(k), exclude_max=True))
        elif shape == ():
            params[name] = draw(st.floats(0.05, 20.0))
        else:
            dims = tuple(sizes[d] if isinstance(d, str) else d for d in shape)
            elements = st.floats(-3, 3, allow_nan=False, width=32)
            params[name] = draw(hnp.arrays(np.float64, dims, elements=elements)).tolist()
    if "base" in sizes:  # a wrapper (prior-shift): the params of its base method too
        base = calibrators.CALIBRATORS[sizes["base"]]
        drawn = draw(calibrator_params(base, min_classes=k, max_classes=k))
        params["base"] = calibrators.from_params(drawn).to_params()
    return params


#: Any JSON value, as a client may post it where params belong: nested lists and
#: objects of null, booleans, integers beyond float64's range, finite floats and short
#: strings.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=20,
)


#: Characters stored text (a class name, a description) may hold, stated independently
#: of service.vocabulary: any letter, mark (combining or not), number, punctuation,
#: symbol (emoji), space, private-use or unassigned code point, and the zero-width
#: non-joiner and joiner that some scripts and emoji sequences need.
STORED_TEXT_CHARACTERS = st.characters(
    exclude_categories=("Cc", "Cf", "Cs", "Zl", "Zp")
) | st.sampled_from("\u200c\u200d")
#: Characters no stored text may hold: controls, line and paragraph separators, lone
#: surrogates and every other format character (bidirectional overrides among them).
REFUSED_TEXT_CHARACTERS = st.characters(categories=("Cc", "Cf", "Cs", "Zl", "Zp")).filter(
    lambda c: c not in "\u200c\u200d"
)


@st.composite
def stored_names(draw, max_chars: int = 128) -> str:
    """A name that may be stored: 1 to ``max_chars`` characters of
    :data:`STORED_TEXT_CHARACTERS`, with no whitespace at either end."""
    return draw(st.text(STORED_TEXT_CHARACTERS, min_size=1, max_size=max_chars).filter(
        lambda s: s == s.strip()
    ))
