"""Canonicalisation of user input: the one place that turns scores into logits.

Every public entry point (fit, predict_proba, metrics, checks) goes through
:func:`as_scores` / :func:`as_logits` and :func:`as_labels`, and every option
(of a calibrator, a metric, the drift test) through :func:`check_integer` or
:func:`check_positive`, so validation rules and messages are identical everywhere.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, get_args

import numpy as np

from calibrators.numerics import log_softmax, map_rows, row_chunks, softmax

Kind = Literal["logits", "probabilities"]
#: What a score matrix holds; every ``kind`` argument is one of these.
KINDS: tuple[str, ...] = get_args(Kind)

#: The smallest positive float32 (2**-149). Probabilities are clipped to it
#: before the log, so a zero probability becomes a finite, very negative logit
#: (log(2**-149) = -103.28) instead of -inf. The ONNX graphs apply the same rule
#: to a ``-inf`` fed to them, so numpy and ONNX agree on zero probabilities.
PROBABILITY_FLOOR = float(np.finfo(np.float32).smallest_subnormal)
LOG_FLOOR = float(np.log(PROBABILITY_FLOOR))

#: Rows of a probability matrix must sum to 1 within this tolerance.
ROW_SUM_TOLERANCE = 1e-3

#: Integer scores must lie in [-2**53, 2**53], where every integer is exact in
#: float64 (they are computed in float64): a uint64 or int64 beyond it would be
#: rounded silently.
MAX_EXACT_INTEGER = 2**53

#: numpy dtype kinds accepted as scores: real floats, signed and unsigned integers.
#: Refused: bool, complex, datetime64, timedelta64 (numpy counts it an integer),
#: strings, objects and structured records.
SCORE_DTYPE_KINDS = "fiu"


class CalibrationInputError(ValueError):
    """Input that the calibrators cannot use: wrong shape, NaN/Inf, bad labels...

    The message names the problem, the expected form, and the first offending
    row or value.
    """


class NotFittedError(CalibrationInputError):
    """A calibrator was used before :meth:`fit` (or :func:`from_params`)."""


class KindError(CalibrationInputError):
    """Scores of a kind the calibrator cannot give its one answer for.

    Only params of format ``welltempered.calibrator/1`` of vector and matrix scaling
    raise it: their map depends on the per-row constant of the logits, so it is
    served only for the kind they were fitted on (``needed``).
    """

    def __init__(self, message: str, needed: str):
        super().__init__(message)
        self.needed = needed


def _first_bad_row(mask: np.ndarray) -> int:
    """Index of the first row of a boolean (N,) or (N, K) mask that is True."""
    rows = mask if mask.ndim == 1 else mask.any(axis=1)
    return int(np.flatnonzero(rows)[0])


def check_kind(kind: str) -> None:
    """Raise CalibrationInputError unless ``kind`` is one of :data:`KINDS`."""
    if kind not in KINDS:
        expected = " or ".join(repr(k) for k in KINDS)
        raise CalibrationInputError(f"kind must be {expected}. Got {kind!r}.")


#: Ranges of the integer options, checked by :func:`check_integer` wherever an option
#: is given (``calibrators.create``, ``from_params``, the metrics, the drift test).
#: Each is far above any useful value and low enough that a typo or a hostile
#: ``10**400`` is refused with a message, not run as a loop, an allocation or an
#: overflow of that size.
#: ``max_iter``: iterations of one solver run (defaults 1,000 and 2,000).
MAX_ITERATIONS = 1_000_000
#: ``max_passes``: passes over the rows of temperature, ets and pts (defaults 50, 100).
MAX_PASSES = 10_000
#: ``n_folds``: cross-validation folds (defaults 3 and 4; leave-one-out up to 1,000 rows).
MAX_FOLDS = 1_000
#: ``n_top``: top logits of pts and iop, more than any vocabulary (a fit uses at
#: most ``K - 1``).
MAX_TOP = 1 << 20
#: ``n_bins`` of the metrics (default 15).
MAX_BINS = 10_000
#: ``n_resamples`` of the drift test (default 2,000).
MAX_RESAMPLES = 1_000_000
#: Seeds and counts: what an int64 holds.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_integer(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``, else
    CalibrationInputError.

    Parameters
    ----------
    name : str
        Used in the message.
    value : object
    minimum, maximum : int, optional
        Bounds, both included; None: no bound.

    Returns
    -------
    int
        ``value`` itself, or ``int(value)`` for a numpy integer.

    Examples
    --------
    >>> check_integer("n_folds", 3, minimum=2)
    3
    >>> check_integer("n_folds", True, minimum=2)
    Traceback (most recent call last):
    ...
    calibrators.validation.CalibrationInputError: n_folds must be an integer >= 2. Got True.
    >>> check_integer("max_iter", 10**400, minimum=1, maximum=MAX_ITERATIONS)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    calibrators.validation.CalibrationInputError: ... and <= 1000000. Got an integer of 401 digits.
    """
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Integral)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        bounds = [f">= {minimum}"] if minimum is not None else []
        bounds += [f"<= {maximum}"] if maximum is not None else []
        expected = " ".join(["an integer", " and ".join(bounds)]).strip()
        raise CalibrationInputError(f"{name} must be {expected}. Got {_shown(value)}.")
    return value if type(value) is int else int(value)


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, but an integer from ``2**100`` (31 digits) up by
    its length: Python refuses to print one of more than 4,300 digits."""
    if isinstance(value, int) and abs(value).bit_length() > 100:
        digits = int(abs(value).bit_length() * math.log10(2))  # the length, or one less
        digits += abs(value) >= 10**digits
        return f"an integer of {digits} digits"
    return repr(value)


def _finite_float(value: numbers.Real) -> bool:
    """``value`` is finite as a float64 (an int beyond 1.8e308 is not: OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_positive(
    name: str, value: Any, *, allow_zero: bool = False, allow_none: bool = False
) -> Any:
    """``value`` if it is a finite real number > 0 (not a bool), else CalibrationInputError.

    Parameters
    ----------
    name : str
        Used in the message.
    value : object
    allow_zero : bool, default False
        Accept 0 as well.
    allow_none : bool, default False
        Accept None as well.

    Returns
    -------
    int, float or None
        ``value`` itself (a Python int or float stays what it is), or
        ``float(value)`` for a numpy number.

    Examples
    --------
    >>> check_positive("tol", 1e-9)
    1e-09
    >>> check_positive("reg_mu", -1.0, allow_zero=True)
    Traceback (most recent call last):
    ...
    calibrators.validation.CalibrationInputError: reg_mu must be a finite number >= 0. Got -1.0.
    """
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Real)
        or not _finite_float(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        expected = "a finite number " + (">= 0" if allow_zero else "> 0")
        if allow_none:
            expected = "None or " + expected
        raise CalibrationInputError(f"{name} must be {expected}. Got {_shown(value)}.")
    return value if type(value) in (int, float) else float(value)


def as_scores(
    scores, kind: str = "logits", *, n_classes: int | None = None, assume_finite: bool = False
) -> np.ndarray:
    """Validate a score matrix and return it as a float array of shape (N, K).

    float32 input stays float32 (no copy when already contiguous), anything
    else becomes float64. Probabilities are *not* converted here; see
    :func:`as_logits`. Scores are real floats or integers (:data:`SCORE_DTYPE_KINDS`);
    integers must be exact in float64 (:data:`MAX_EXACT_INTEGER`). ``assume_finite``
    (as scikit-learn's configuration of that name): the caller knows every value is
    finite (parsed from JSON, which has no NaN or Infinity), so logits are not checked
    for it; probabilities are still checked (signs and sums).
    """
    check_kind(kind)
    try:
        arr = np.asarray(scores)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise CalibrationInputError(
            f"{kind} must be a rectangular array of shape (n_samples, n_classes). "
            f"Got an object numpy cannot make rectangular: {exc}."
        ) from None
    if arr.dtype.kind not in SCORE_DTYPE_KINDS:
        raise CalibrationInputError(
            f"{kind} must be a numeric array of real floats or integers (not bool, complex, "
            f"datetime or timedelta) of shape (n_samples, n_classes). Got dtype {arr.dtype}."
        )
    if arr.ndim != 2:
        raise CalibrationInputError(
            f"{kind} must be a 2-D array of shape (n_samples, n_classes). "
            f"Got {arr.ndim} dimension(s), shape {arr.shape}."
        )
    n, k = arr.shape
    if n == 0:
        raise CalibrationInputError(f"{kind} must have at least one row. Got shape {arr.shape}.")
    if k < 2:
        raise CalibrationInputError(
            f"{kind} must have at least 2 classes (columns). Got shape {arr.shape}."
        )
    if n_classes is not None and k != n_classes:
        raise CalibrationInputError(
            f"{kind} must have {n_classes} columns, the number of classes this calibrator "
            f"was fitted on. Got {k}."
        )
    if arr.dtype.kind in "iu" and arr.dtype.itemsize >= 8:
        for rows in row_chunks(n, k):
            _check_exact_integers(arr[rows], rows.start, kind)
    dtype = np.float32 if arr.dtype == np.float32 else np.float64
    arr = np.ascontiguousarray(arr, dtype=dtype)
    if assume_finite and kind != "probabilities":
        return arr
    # Checked in row blocks: no full-size boolean masks for big inputs.
    for rows in row_chunks(n, k):
        _check_block(arr[rows], rows.start, kind)
    return arr


def _check_exact_integers(block: np.ndarray, offset: int, kind: str) -> None:
    bad = (block > MAX_EXACT_INTEGER) | (block < -MAX_EXACT_INTEGER)
    if bad.any():
        row = _first_bad_row(bad)
        col = int(np.flatnonzero(bad[row])[0])
        raise CalibrationInputError(
            f"{kind} given as integers must lie in [-2**53, 2**53], where float64 is exact. "
            f"Got {block[row, col].item()!r} at row {offset + row}, column {col}."
        )


def _check_block(block: np.ndarray, offset: int, kind: str) -> None:
    finite = np.isfinite(block)
    if not finite.all():
        row = _first_bad_row(~finite)
        col = int(np.flatnonzero(~finite[row])[0])
        raise CalibrationInputError(
            f"{kind} must be finite (no NaN or Inf). Got {block[row, col]} at row "
            f"{offset + row}, column {col}."
        )
    if kind != "probabilities":
        return
    negative = block < 0
    if negative.any():
        row = _first_bad_row(negative)
        col = int(np.flatnonzero(negative[row])[0])
        raise CalibrationInputError(
            f"probabilities must be non-negative. Got {block[row, col]} at row "
            f"{offset + row}, column {col}."
        )
    sums = block.sum(axis=1, dtype=np.float64)
    off = np.abs(sums - 1.0) > ROW_SUM_TOLERANCE
    if off.any():
        row = _first_bad_row(off)
        raise CalibrationInputError(
            f"probabilities rows must sum to 1 (within {ROW_SUM_TOLERANCE:g}); pass "
            f"kind='logits' for unnormalised scores. Got a sum of {sums[row].item()!r} at row "
            f"{offset + row}."
        )


def probabilities_to_logits(probs: np.ndarray, out_dtype=np.float64,
                            out: np.ndarray | None = None) -> np.ndarray:
    """``log(max(p, 2**-149))``: finite logits for probabilities, zeros included (in
    ``out``, of ``probs``'s shape, when given; else a new array of ``out_dtype``)."""
    if out is None:
        return np.log(np.maximum(probs, PROBABILITY_FLOOR), dtype=out_dtype)
    np.maximum(probs, PROBABILITY_FLOOR, out=out)  # in probs' dtype, then cast, as above
    return np.log(out, out=out)


def as_logits(scores, kind: str = "logits", *, n_classes: int | None = None) -> np.ndarray:
    """Validated logits of shape (N, K); probabilities are turned into their log.

    Logits keep their dtype (float32 stays float32); the log of probabilities
    is taken in float64.
    """
    arr = as_scores(scores, kind, n_classes=n_classes)
    if kind == "probabilities":
        arr = probabilities_to_logits(arr)
    return arr


def logits64(block: np.ndarray, kind: str) -> np.ndarray:
    """A float64 copy of a block of validated scores, as logits.

    Used chunk by chunk, so a float32 input never needs a float64 copy of the
    whole array.
    """
    if kind == "probabilities":
        return probabilities_to_logits(block)
    return block.astype(np.float64)


def centred_log_ratio(z: np.ndarray) -> np.ndarray:
    """The canonical features of a float64 block of logits: one array per distribution.

    ``clr(max(log_softmax(z), LOG_FLOOR))``: the log-probabilities, floored at
    :data:`LOG_FLOOR` like a zero probability, minus their row mean. It depends only
    on the distribution ``softmax(z)``: logits with any per-row constant added and
    the log of the probabilities themselves (:func:`logits64`) give the same array,
    up to rounding. The floor makes a logit far below the rest and a probability
    that underflowed to 0 the same feature, and bounds the pull of one class on
    the row mean to ``|LOG_FLOOR| / K``.

    Parameters
    ----------
    z : ndarray of shape (n_rows, n_classes), float64
        Finite logits (or :func:`logits64` of probabilities).

    Returns
    -------
    ndarray of shape (n_rows, n_classes), float64
        Rows sum to 0 (up to rounding).

    Examples
    --------
    >>> a = centred_log_ratio(np.array([[0.0, 1.0, 3.0]]))
    >>> b = centred_log_ratio(np.array([[100.0, 101.0, 103.0]]))
    >>> bool(np.allclose(a, b, rtol=0, atol=1e-13)), a.round(4).tolist()
    (True, [[-1.3333, -0.3333, 1.6667]])
    """
    out = log_softmax(z)
    np.maximum(out, LOG_FLOOR, out=out)
    out -= out.mean(axis=1, keepdims=True)
    return out


def to_probabilities(scores: np.ndarray, kind: str) -> np.ndarray:
    """Probabilities (float64, shape (N, K)) of validated scores.

    The softmax of logits, computed in row chunks; probabilities are returned as
    float64 (no copy when they already are).
    """
    check_kind(kind)
    if kind == "probabilities":
        return np.asarray(scores, dtype=np.float64)
    return map_rows(lambda block: softmax(block.astype(np.float64)), scores)


def as_labels(labels, n_samples: int, n_classes: int) -> np.ndarray:
    """Validate integer class labels in [0, n_classes) and return them as int64.

    Labels may be any integer dtype, or floats whose every value is integral
    (``3.0``: many frameworks store labels as floats); ``3.5``, NaN, bool,
    complex, datetime and timedelta labels are refused.
    """
    try:
        arr = np.asarray(labels)
    except (ValueError, TypeError) as exc:
        raise CalibrationInputError(
            f"labels must be a 1-D array of integers. Got an unusable object: {exc}."
        ) from None
    if arr.ndim != 1:
        raise CalibrationInputError(
            f"labels must be a 1-D array of shape (n_samples,). Got shape {arr.shape}."
        )
    if arr.shape[0] != n_samples:
        raise CalibrationInputError(
            f"labels must have one entry per row of the scores ({n_samples}). "
            f"Got {arr.shape[0]}."
        )
    if arr.dtype.kind not in SCORE_DTYPE_KINDS:
        raise CalibrationInputError(
            f"labels must be integers in [0, {n_classes}) (integral floats such as 3.0 "
            f"are accepted; not bool, complex, datetime or timedelta). Got dtype {arr.dtype}."
        )
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            row = _first_bad_row(bad)
            raise CalibrationInputError(
                f"labels must be integers in [0, {n_classes}). "
                f"Got {arr[row].item()!r} at row {row}."
            )
    out_of_range = (arr < 0) | (arr >= n_classes)
    if out_of_range.any():
        row = _first_bad_row(out_of_range)
        raise CalibrationInputError(
            f"labels must be integers in [0, {n_classes}). Got {arr[row].item()!r} at row {row}."
        )
    return arr.astype(np.int64, copy=False)


def as_sequence_ids(groups, n: int) -> np.ndarray:
    """The sequence of each of ``n`` rows as integer codes ``0 .. n_sequences - 1``
    (``numpy.unique``'s order), or CalibrationInputError."""
    arr = np.asarray(groups)
    if arr.shape != (n,):
        raise CalibrationInputError(
            f"sequence ids must be one per row, shape ({n},). Got shape {arr.shape}."
        )
    values = arr.tolist() if arr.dtype.kind == "O" else []
    if arr.dtype.kind not in "iuUSO" or not (
        all(isinstance(g, str) for g in values)
        or all(isinstance(g, int) and not isinstance(g, bool) for g in values)
    ):
        raise CalibrationInputError(
            f"sequence ids must be all integers or all strings. Got dtype {arr.dtype}"
            + (f" holding {type(values[0]).__name__}" if values else "") + "."
        )
    return np.unique(arr, return_inverse=True)[1].reshape(n).astype(np.int64)


def as_scores_and_labels(scores, labels, kind: str = "logits"):
    """Validate a labelled score matrix; returns (scores (N, K), labels int64 (N,)).

    The scores are returned as given (validated, not log-transformed): convert
    blocks of them with :func:`logits64`.
    """
    arr = as_scores(scores, kind)
    return arr, as_labels(labels, arr.shape[0], arr.shape[1])
