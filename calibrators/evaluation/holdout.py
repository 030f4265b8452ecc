"""The one hold-out split: which rows a calibrator is fitted on and which evaluate it.

The CLI (``welltempered fit``), the library's :func:`service.offline.compare`
and the service all call :func:`split_indices`, so the same ``(n, holdout, seed)``
always selects the same rows everywhere.

Rule: ``perm = numpy.random.default_rng(seed).permutation(n)``; the last
``n_holdout = round(n * holdout)`` entries of ``perm`` are held out (Python's
``round``, halves to even), the first ``n - n_holdout`` are fitted on.

Rows of one sequence (the tokens of one text, given as ``groups``) are correlated: a
split by rows puts some of a text's tokens on each side, and the held-out figures are
optimistic. With ``groups`` the split is by sequence: ``perm`` permutes the distinct
sequences (``numpy.unique`` order), and the whole sequences at the end of ``perm``
whose rows come nearest ``round(n * holdout)`` are held out (at least one; on a tie,
fewer): the held-out share is ``holdout`` to within one sequence. No sequence is on
both sides.
"""

from __future__ import annotations

import math

import numpy as np

from calibrators.validation import CalibrationInputError, as_sequence_ids

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
    n: int, holdout: float = DEFAULT_HOLDOUT, seed: int = 0, *, groups=None
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
    groups : array-like of shape (n,), optional
        The sequence of each row (integers or strings): the split is then by
        sequence (see the module docstring).

    Returns
    -------
    fit_idx : ndarray of shape (n - round(n * holdout),), int64
    holdout_idx : ndarray of shape (round(n * holdout),), int64
        Without ``groups``; with them, whole sequences, the held-out part the nearest
        to ``round(n * holdout)`` rows whole sequences allow, each part's rows in the order of
        their sequences in the permutation and then of the rows.

    Raises
    ------
    CalibrationInputError
        ``holdout`` outside (0, 1), or a part would be too small (by sequence: both
        parts need a sequence, and the fit part ``MIN_FIT_ROWS`` rows), or ``groups``
        not one id per row.

    Examples
    --------
    >>> fit_idx, test_idx = split_indices(10, 0.3, seed=0)
    >>> len(fit_idx), len(test_idx)
    (7, 3)
    >>> sorted(np.concatenate([fit_idx, test_idx]).tolist()) == list(range(10))
    True
    >>> fit_idx, test_idx = split_indices(6, 0.5, seed=0, groups=["a", "a", "b", "b", "c", "c"])
    >>> sorted(test_idx.tolist())
    [2, 3]
    """
    if groups is None:
        n_fit, _ = split_sizes(n, holdout)
        perm = np.random.default_rng(seed).permutation(n)
        return perm[:n_fit], perm[n_fit:]
    return _split_groups(n, check_holdout(holdout), seed, groups)


def _split_groups(n: int, holdout: float, seed: int, groups) -> tuple[np.ndarray, np.ndarray]:
    codes = as_sequence_ids(groups, n)
    n_groups = int(codes.max()) + 1 if n else 0
    sizes = np.bincount(codes, minlength=n_groups)
    perm = np.random.default_rng(seed).permutation(n_groups)
    want = round(n * holdout)
    # Held out: the tail of the permutation whose rows are nearest `want` (at least one
    # sequence; on a tie, the shorter tail).
    tail = np.cumsum(sizes[perm][::-1])
    n_held_groups = max(1, int(np.argmin(np.abs(tail - want))) + 1)
    n_fit_rows = n - int(tail[n_held_groups - 1])
    if n_held_groups < 1 or n_held_groups == n_groups or n_fit_rows < MIN_FIT_ROWS:
        raise CalibrationInputError(
            f"holdout={holdout:g} by sequence leaves {n_groups - n_held_groups} of "
            f"{n_groups} sequences ({n_fit_rows} rows) to fit on; both parts need a "
            f"sequence, and the fit part {MIN_FIT_ROWS} rows. Got {n} rows."
        )
    rank = np.empty(n_groups, dtype=np.int64)
    rank[perm] = np.arange(n_groups)
    order = np.lexsort((np.arange(n), rank[codes]))  # by sequence in perm, then by row
    split = n_fit_rows
    return order[:split], order[split:]


def fold_indices(
    n: int,
    holdout: float = DEFAULT_HOLDOUT,
    seed: int = 0,
    *,
    groups=None,
    max_folds: int = 5,
) -> list[np.ndarray]:
    """Disjoint held-out parts of the size of :func:`split_indices`' own, its first.

    The first part is ``split_indices(n, holdout, seed, groups=groups)[1]``; each next
    one is the tail of the rows fitted on so far (the permutation's order) of the same
    size, while that many rows remain and at most ``max_folds`` parts in all: so
    every part's complement, the rows a model is fitted on to score it, has as many
    rows as the first split's fit part. With ``groups`` the cuts fall between whole
    sequences, nearest the first part's size (on a tie, the smaller part).

    Parameters
    ----------
    n, holdout, seed, groups
        As :func:`split_indices`.
    max_folds : int, default=5
        The most parts returned (at least 1).

    Returns
    -------
    list of ndarray of int64
        Between 1 and ``max_folds`` disjoint parts; ``min(max_folds, n // n_holdout)``
        of them without ``groups`` (``n_holdout = round(n * holdout)``).

    Examples
    --------
    >>> parts = fold_indices(10, 0.3, seed=0)
    >>> [len(p) for p in parts]
    [3, 3, 3]
    >>> np.array_equal(parts[0], split_indices(10, 0.3, seed=0)[1])
    True
    >>> len(np.unique(np.concatenate(parts)))
    9
    """
    if isinstance(max_folds, bool) or not isinstance(max_folds, int) or max_folds < 1:
        raise CalibrationInputError(f"max_folds must be an integer >= 1. Got {max_folds!r}.")
    rest, first = split_indices(n, holdout, seed, groups=groups)
    parts = [first]
    size = len(first)
    codes = None if groups is None else as_sequence_ids(groups, n)
    while len(parts) < max_folds and len(rest) >= size:
        if codes is None:
            cut = len(rest) - size
        else:
            # Where a new sequence starts in `rest` (0 included): the cut nearest size rows
            # from the end, the later of two equally near (the smaller part).
            seq = codes[rest]
            starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
            tails = len(rest) - starts
            best = np.abs(tails - size)
            cut = int(starts[np.flatnonzero(best == best.min())[-1]])
        parts.append(rest[cut:])
        rest = rest[:cut]
    return parts
