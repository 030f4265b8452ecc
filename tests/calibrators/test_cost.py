"""The cost model: the public entry points, the shape of every method's formulas, and
the formulas against peaks measured with tracemalloc (at two sizes: the estimate must
bound the measured peak, and its ratio between the sizes must follow the measured
ratio, loosely). No timing is asserted."""

from __future__ import annotations

import gc
from itertools import pairwise

import numpy as np
import pytest

import calibrators
from calibrators import CALIBRATORS, METHODS, CalibrationInputError, Cost
from calibrators.base import Calibrator
from calibrators.cost import conservative_cost, largest_classes, lbfgs_bytes
from tests.oracles import traced_peak


# -- the entry points ------------------------------------------------------------
def test_estimate_cost_adds_the_input_and_canonicalises_options():
    cost = calibrators.estimate_cost("pts", 1000, 50, {"n_top": 4}, itemsize=8)
    assert isinstance(cost, Cost)
    assert cost.input_bytes == 1000 * 50 * 8
    assert cost.total_bytes == cost.bytes + cost.input_bytes
    assert cost.bytes > 0 and cost.flops > 0
    assert cost == calibrators.estimate_cost("pts", 1000, 50, {"n_top": 4, "reg": None},
                                             itemsize=8)
    assert calibrators.estimate_cost("pts", 1000, 50).bytes > cost.bytes  # n_top=10


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: calibrators.estimate_cost("platt", 10, 3), "method must be one of"),
        (lambda: calibrators.estimate_cost("pts", 10, 3, {"lambda": 1}), "must be among"),
        (lambda: calibrators.estimate_cost("pts", 10, 3, {"n_top": 0}), "n_top"),
        (lambda: calibrators.estimate_cost("pts", 0, 3), "n_samples must be an integer >= 1"),
        (lambda: calibrators.estimate_cost("pts", 10, 1), "n_classes must be an integer >= 2"),
        (lambda: calibrators.estimate_cost("pts", 10, 3.0), "n_classes"),
        (lambda: calibrators.estimate_cost("pts", 10, 3, itemsize=True), "itemsize"),
        (lambda: calibrators.max_classes("pts", 10, -1), "budget_bytes"),
        (lambda: calibrators.max_classes("pts", 10, 1e9), "budget_bytes"),
    ],
)
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(CalibrationInputError, match=message):
        call()


@pytest.mark.parametrize("method", METHODS)
def test_every_model_is_positive_and_non_decreasing_in_n_and_k(method):
    options = calibrators.check_options(method, {})
    sizes = [2, 3, 10, 100, 129, 1000, 2**18 - 1, 2**18, 2**18 + 1, 10**6]
    for n in (1, 100, 10_000, 10**6):
        costs = [CALIBRATORS[method].fit_cost(n, k, options) for k in sizes]
        assert all(c.bytes > 0 and c.flops > 0 for c in costs)
        assert all(a.bytes <= b.bytes for a, b in pairwise(costs))
    for k in (2, 100, 10**5):
        costs = [CALIBRATORS[method].fit_cost(n, k, options) for n in (1, 10, 10**4, 10**6)]
        assert all(a.bytes <= b.bytes for a, b in pairwise(costs))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [2**20, 2**26, 2**33])
def test_max_classes_is_the_largest_k_that_fits(method, budget):
    n = 500
    k = calibrators.max_classes(method, n, budget)
    if k == 0:
        assert calibrators.estimate_cost(method, n, 2).total_bytes > budget
        return
    assert calibrators.estimate_cost(method, n, k).total_bytes <= budget
    assert calibrators.estimate_cost(method, n, k + 1).total_bytes > budget


def test_largest_classes_on_a_known_function():
    def cost(k):
        return Cost(bytes=10 * k, flops=1.0)

    assert largest_classes(cost, 1234) == 123
    assert largest_classes(cost, 19) == 0
    assert largest_classes(cost, 20) == 2
    assert largest_classes(cost, 10**12, upper=1000) == 1000


def test_methods_linear_in_k_cost_a_chunk_at_language_model_scale():
    n, k = 2_000, 262_144
    for method in ("temperature", "ets", "pts"):
        cost = calibrators.estimate_cost(method, n, k)
        assert cost.input_bytes == n * k * 4  # 1.95 GiB of float32
        assert cost.bytes < 64 * 2**20, method  # a few 2 MiB rows per thread, not 2 GiB


def test_the_default_is_the_conservative_dense_model():
    assert Calibrator.fit_cost(100, 10, {}) == conservative_cost(100, 10)
    dense = conservative_cost(500, 10_000)
    assert dense.bytes >= 2 * lbfgs_bytes(10_000**2, 20)  # the matrix fit of issue 11: >8 GB


# -- the formulas against measured peaks ---------------------------------------------
def _measured_peak(method: str, options: dict, n: int, k: int) -> int:
    rng = np.random.default_rng(k)
    y = rng.integers(0, k, n)
    z = rng.standard_normal((n, k), dtype=np.float32) * 2
    z[np.arange(n), y] += 3.0
    gc.collect()
    return traced_peak(lambda: calibrators.create(method, **options).fit(z, y))[1]


#: (method, options, (N, K) small, (N, K) large): the two sizes of each check.
MEASURED = [
    ("temperature", {}, (4, 2**18), (4, 2**19)),
    ("temperature", {}, (40_000, 50), (80_000, 50)),
    ("ets", {}, (4, 2**18), (4, 2**19)),
    ("pts", {"reg": 0.1}, (4, 2**18), (4, 2**19)),
    ("pts", {"reg": 0.1}, (20_000, 20), (80_000, 20)),
    ("vector", {"reg_mu": 1.0}, (2_000, 100), (4_000, 100)),
    ("vector", {"grid": [10.0, 1.0]}, (1_000, 50), (1_000, 100)),
    ("matrix", {"reg_lambda": 1.0, "reg_mu": 1.0}, (1_000, 40), (1_000, 80)),
    pytest.param("matrix", {"reg_lambda": 1.0, "reg_mu": 1.0}, (300, 300), (300, 400),
                 marks=pytest.mark.slow),  # rank-1 whitening, K > MAX_BLOCK_CLASSES
    ("dirichlet", {"grid": [10.0, 1.0]}, (1_000, 20), (1_000, 40)),
    ("row-entropy", {"target_entropy": 0.5}, (4, 2**18), (4, 2**19)),
    ("row-entropy", {"target_entropy": 0.5}, (20_000, 20), (80_000, 20)),
]


def _case_id(case) -> str:
    method, _, small, large = case.values if hasattr(case, "values") else case
    return f"{method}-{small[0]}x{small[1]}-{large[0]}x{large[1]}"


@pytest.mark.parametrize(
    ("method", "options", "small", "large"), MEASURED, ids=[_case_id(c) for c in MEASURED]
)
def test_estimates_bound_and_follow_the_measured_peaks(method, options, small, large):
    measured = [_measured_peak(method, options, *size) for size in (small, large)]
    estimated = [calibrators.estimate_cost(method, *size, options).bytes
                 for size in (small, large)]
    for got, bound in zip(measured, estimated, strict=True):
        assert got <= bound, (got, bound)  # an upper bound...
        assert bound <= 4 * got, (got, bound)  # ...within a small factor
    ratio = (estimated[1] / estimated[0]) / (measured[1] / measured[0])
    assert 0.5 <= ratio <= 2.0, (measured, estimated)
