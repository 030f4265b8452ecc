"""The one hold-out split: which rows a calibrator is fitted on and which evaluate it.

The CLI (``welltempered fit``), the library's :func:`service.offline.compare`
and the service all call :func:`split_indices`, so the same ``(n, holdout, seed)``
always selects the same rows everywhere.

Rule: ``perm = numpy.random.default_rng(seed).permutation(n)``; the last
``n_holdout = round(n * holdout)`` entries of ``perm`` are held out (Python's
``round``, halves to even), the first ``n - n_holdout`` are fitted on.
"""

from __future__ import annotations

import math

import numpy as np

from calibrators.validation import CalibrationInputError

#: Fraction of rows held out when the caller does not say.
DEFAULT_HOLDOUT = 0.2
#: The fit part needs at least this many rows.
MIN_FIT_ROWS = 2


def check_holdout(holdout) -> float:
    """``holdout`` as a float in (0, 1), or CalibrationInputError."""
    if (
        isinstance(holdout, bool)
        or not isinstance(holdout, int | float)
        or not math.isfinite(holdout)
        or not 0 < holdout < 1
    ):
        raise CalibrationInputError(f"holdout must be a fraction in (0, 1). Got {holdout!r}.")
    return float(holdout)


def split_sizes(n: int, holdout: float = DEFAULT_HOLDOUT) -> tuple[int, int]:
    """``(n_fit, n_holdout)`` for ``n`` rows, or CalibrationInputError if a part is too small."""
    holdout = check_holdout(holdout)
    n_holdout = round(n * holdout)
    n_fit = n - n_holdout
    if n_holdout < 1 or n_fit < MIN_FIT_ROWS:
        raise CalibrationInputError(
            f"holdout={holdout:g} leaves {n_fit} rows to fit on and {n_holdout} to evaluate on; "
            f"both parts need rows (at least {MIN_FIT_ROWS} to fit). Got {n} rows."
        )
    return n_fit, n_holdout


def split_indices(
    n: int, holdout: float = DEFAULT_HOLDOUT, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the fit part and the held-out part.

    Parameters
    ----------
    n : int
        Number of rows.
    holdout : float, default=DEFAULT_HOLDOUT
        Fraction of rows held out, in (0, 1).
    seed : int, default=0
        Seed of the permutation.

    Returns
    -------
    fit_idx : ndarray of shape (n - round(n * holdout),), int64
    holdout_idx : ndarray of shape (round(n * holdout),), int64

    Raises
    ------
    CalibrationInputError
        ``holdout`` outside (0, 1), or a part would be too small.

    Examples
    --------
    >>> fit_idx, test_idx = split_indices(10, 0.3, seed=0)
    >>> len(fit_idx), len(test_idx)
    (7, 3)
    >>> sorted(np.concatenate([fit_idx, test_idx]).tolist()) == list(range(10))
    True
    """
    n_fit, _ = split_sizes(n, holdout)
    perm = np.random.default_rng(seed).permutation(n)
    return perm[:n_fit], perm[n_fit:]
