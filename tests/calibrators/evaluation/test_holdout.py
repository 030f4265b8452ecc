"""fold_indices: disjoint hold-outs of the size of split_indices' own, its first."""

from __future__ import annotations

import numpy as np
import pytest

from calibrators import CalibrationInputError
from calibrators.evaluation.holdout import fold_indices, split_indices


@pytest.mark.parametrize(("n", "holdout", "sizes"), [
    (5000, 0.2, [1000] * 5),
    (5000, 0.5, [2500] * 2),
    (5000, 0.3, [1500] * 3),  # 500 rows are in no part
    (5000, 0.1, [500] * 5),  # at most max_folds parts
    (10, 0.7, [7]),
])
def test_parts_are_disjoint_of_one_size_and_the_first_is_the_split(n, holdout, sizes):
    parts = fold_indices(n, holdout, seed=3)
    assert [len(p) for p in parts] == sizes
    assert np.array_equal(parts[0], split_indices(n, holdout, seed=3)[1])
    rows = np.concatenate(parts)
    assert len(np.unique(rows)) == len(rows)
    assert rows.min() >= 0 and rows.max() < n


def test_max_folds():
    assert len(fold_indices(100, 0.2, seed=0, max_folds=2)) == 2
    assert len(fold_indices(100, 0.2, seed=0, max_folds=1)) == 1
    for bad in (0, 1.5, True):
        with pytest.raises(CalibrationInputError, match="max_folds"):
            fold_indices(100, 0.2, seed=0, max_folds=bad)


def test_by_sequence_no_sequence_is_cut_and_the_parts_are_near_the_size():
    rng = np.random.default_rng(1)
    groups = np.repeat(rng.permutation(120), rng.integers(1, 30, 120))
    n = len(groups)
    parts = fold_indices(n, 0.2, seed=2, groups=groups)
    assert np.array_equal(parts[0], split_indices(n, 0.2, seed=2, groups=groups)[1])
    assert 4 <= len(parts) <= 5  # the parts before may leave a little less than one
    seen = [set(groups[p].tolist()) for p in parts]
    for i, a in enumerate(seen):
        for b in seen[i + 1:]:
            assert not a & b
    for p in parts:  # a whole sequence on each side of a cut: within the longest one
        assert abs(len(p) - round(0.2 * n)) < 30
    held = np.zeros(n, dtype=bool)
    for p in parts:
        held[p] = True
    for g in np.unique(groups):  # every sequence wholly in a part, or in none
        assert len(set(held[groups == g].tolist())) == 1
