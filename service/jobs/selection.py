"""How an ``auto`` fit chooses its method: a race over folds, on paired per-row NLLs.

One hold-out of a few hundred or thousand rows is a noisy judge of methods whose
held-out NLLs differ by a few thousandths: on the shared lenet-5 outputs, 1,000
held-out rows chose matrix or Dirichlet scaling on 2 of 5 splits where structured
matrix scaling was better on the rows none of them was fitted on. Scoring every
candidate on every fold (cross-validation) fixes that at several times the cost of
the fit. The race spends the extra fits only where the choice is in doubt:

1. the first fold is the job's hold-out, where every candidate is already scored;
2. after each fold, the leader is the candidate with the lowest mean per-row NLL
   over the folds scored so far (the same rows for every candidate still running),
   and a candidate whose mean is above the leader's by more than
   :data:`DROP_STANDARD_ERRORS` standard errors of the paired per-row differences
   is dropped (pairing removes how hard each row is, so the noise is measured on
   these rows, not guessed);
3. the candidates left are fitted without the next fold and scored on it, until one
   is left or the folds run out (:func:`calibrators.evaluation.holdout.fold_indices`:
   at most :data:`MAX_FOLDS`, each the size of the job's hold-out); the leader then
   is the choice.

A candidate clearly worse on the first fold costs nothing more; close ones go on to
more rows. bench/search_splits.py measures it against one hold-out and full
cross-validation (bench/README.md, "How auto chooses").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: The most folds a race scores on (the job's hold-out is the first).
MAX_FOLDS = 5
#: A candidate is dropped when its mean per-row NLL is above the leader's by more than
#: this many standard errors of the paired differences. bench/README.md: at 2 the race
#: chose as 5-fold cross-validation on every split of both shared files, with 44% and
#: 11% of its extra fits; at 1, with the folds in another order, it dropped the best
#: method of lenet-5-cifar-10 on one split.
DROP_STANDARD_ERRORS = 2.0


def paired_difference(nll: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """The mean of ``nll - reference`` (per-row NLLs of the same rows) and its standard
    error, ``std(d, ddof=1) / sqrt(n)`` (0 for a single row)."""
    d = np.asarray(nll, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0
    return float(d.mean()), se


def race(
    first: Mapping[str, np.ndarray],
    score: Callable[[str, int], np.ndarray],
    n_folds: int,
    *,
    standard_errors: float = DROP_STANDARD_ERRORS,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """Choose among candidates by racing them over folds (see the module docstring).

    Parameters
    ----------
    first : mapping of str to ndarray of shape (n_0,)
        Each candidate's per-row NLL on the first fold, in the candidates' order
        (the first of equal means wins, as :func:`service.jobs.fitting.lowest_nll`).
    score : callable ``(candidate, fold) -> ndarray``
        The candidate fitted without fold ``fold`` (1 .. n_folds - 1), its per-row NLL
        on that fold (the same rows, in the same order, for every candidate).
    n_folds : int
        How many folds there are (the first included).
    standard_errors : float, default=DROP_STANDARD_ERRORS
        The drop threshold.

    Returns
    -------
    chosen : str
    selection : dict
        Per candidate: ``folds`` (how many it was scored on), ``nll`` (its mean per-row
        NLL over them), ``difference`` and ``standard_error`` (its paired mean
        difference from the leader over those rows, and the standard error of that;
        0 for the leader) and ``dropped`` (whether it left the race before the end).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> hard = rng.exponential(size=400)  # how hard each row is, shared by both
    >>> first = {"a": hard + 0.5, "b": hard + rng.normal(0, 0.05, 400)}
    >>> race(first, lambda m, f: None, 5)[0]  # "a" is far worse: dropped, no more folds
    'b'
    """
    rows = {m: [np.asarray(v, dtype=np.float64)] for m, v in first.items()}
    alive = list(first)
    selection: dict[str, dict[str, Any]] = {}
    folds = 1
    while True:
        pooled = {m: np.concatenate(rows[m]) for m in alive}
        leader = min(alive, key=lambda m: float(pooled[m].mean()))
        kept = []
        for m in alive:
            difference, se = paired_difference(pooled[m], pooled[leader])
            dropped = difference > standard_errors * se
            selection[m] = {
                "folds": folds,
                "nll": float(pooled[m].mean()),
                "difference": difference,
                "standard_error": se,
                "dropped": dropped,
            }
            if not dropped:
                kept.append(m)
        alive = kept
        if len(alive) == 1 or folds == n_folds:
            return leader, selection
        for m in alive:
            rows[m].append(np.asarray(score(m, folds), dtype=np.float64))
        folds += 1
