"""What a fit will cost, in memory and work, before it runs: formulas in N and K.

Every calibrator class states its own model in :meth:`Calibrator.fit_cost
<calibrators.base.Calibrator.fit_cost>`: the peak memory its ``fit`` allocates on top
of the scores it is given, and an order of magnitude of its floating-point
operations, as formulas in N (rows), K (classes) and its options. A caller that
must refuse a fit before it starts (the service, at submission) uses the two
entry points of the package:

* :func:`calibrators.estimate_cost` ``(method, n_samples, n_classes, options)`` ->
  :class:`Cost`;
* :func:`calibrators.max_classes` ``(method, n_samples, budget_bytes, options)`` ->
  the largest K whose total (input + working memory) fits the budget.

The building blocks below are the few shapes every formula is made of: float64
temporaries of one row chunk per thread (:func:`chunk_bytes`), float64 arrays of
N x K (:data:`FLOAT64` ``* n * k``), the workspace of scipy's L-BFGS-B
(:func:`lbfgs_bytes`). The formulas are upper bounds on what tracemalloc sees
(numpy and scipy allocations; BLAS buffers and the interpreter are not counted);
``tests/calibrators/test_cost.py`` compares them with measured peaks at two sizes.

Examples
--------
>>> cost = Cost(bytes=3 * 2**20, flops=1e9, input_bytes=2**20)
>>> cost.total_bytes
4194304
>>> chunk_bytes(2, n_classes=10, threads=1)  # two float64 arrays of one 2**18-entry chunk
4194304
"""

from __future__ import annotations

from dataclasses import dataclass

from calibrators.numerics import CHUNK_ELEMENTS, n_threads

#: Bytes per float64 entry.
FLOAT64 = 8
#: Floating-point operations charged per entry and pass of a chunked softmax
#: sweep (subtract the row max, scale, exp, a few fused sums): a model constant
#: for orders of magnitude, not a measurement.
SWEEP_FLOPS = 30


@dataclass(frozen=True)
class Cost:
    """Predicted peak memory and work of one fit.

    Attributes
    ----------
    bytes : int
        Peak memory the fit allocates on top of its input (its working memory).
    flops : float
        Floating-point operations, an order of magnitude (the number of solver
        iterations or passes in it is typical, not a bound).
    input_bytes : int
        The scores themselves, ``N * K * itemsize``, held by the caller.
    """

    bytes: int
    flops: float
    input_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Input plus working memory: what a worker needs for the fit."""
        return self.bytes + self.input_bytes


def chunk_elements(n_classes: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Entries of one row chunk (:func:`calibrators.numerics.row_chunks`), bounded above.

    ``max(elements, K)``: a chunk holds ``max(1, elements // K)`` whole rows (``elements``:
    the chunks' target size, default ``CHUNK_ELEMENTS``). The bound is non-decreasing
    in K (the exact size is not), so that :func:`largest_classes` can bisect.
    """
    return max(elements, n_classes)


def chunk_bytes(arrays: float, *, n_classes: int, threads: int | None = None,
                elements: int = CHUNK_ELEMENTS) -> int:
    """``arrays`` float64 temporaries of one row chunk (of about ``elements`` entries)
    in each of ``threads`` threads.

    ``threads`` defaults to :func:`calibrators.numerics.n_threads`, the number of
    chunks :func:`calibrators.numerics.map_chunks` works on at once.
    """
    workers = n_threads() if threads is None else threads
    return int(arrays * FLOAT64 * chunk_elements(n_classes, elements) * workers)


def lbfgs_bytes(n_params: int, history: int = 10) -> int:
    """The workspace of scipy's L-BFGS-B for ``n_params`` variables.

    ``(2 m n + 5 n + 11 m**2 + 8 m)`` float64 and ``3 n`` int32, with ``m`` the
    number of correction pairs kept (``maxcor``).
    """
    m, n = history, n_params
    return FLOAT64 * (2 * m * n + 5 * n + 11 * m * m + 8 * m) + 4 * 3 * n


def conservative_cost(n_samples: int, n_classes: int) -> Cost:
    """The default model of :meth:`Calibrator.fit_cost`: a dense fit of K x K parameters.

    For a method that states no model of its own: four float64 copies of the N x K
    scores, ``K**2 + K`` parameters with an L-BFGS-B history of 20 pairs, twice
    (two solves alive at once), and 20 parameter-sized temporaries; 200 solver
    iterations of ``4 N K**2 + SWEEP_FLOPS * N K`` operations each. It bounds
    what matrix scaling with a fixed penalty allocates, so it overestimates
    methods linear in K by far: such a method should state its own model.
    """
    n, k = n_samples, n_classes
    params = k * k + k
    memory = 4 * FLOAT64 * n * k + 2 * lbfgs_bytes(params, 20) + 20 * FLOAT64 * params
    flops = 200.0 * (4.0 * n * k * k + SWEEP_FLOPS * n * k)
    return Cost(bytes=int(memory), flops=flops)


def largest_classes(cost, budget_bytes: int, *, upper: int = 1 << 31) -> int:
    """The largest K in ``[2, upper]`` with ``cost(K).total_bytes <= budget_bytes``, or 0.

    ``cost`` maps K to a :class:`Cost` and must be non-decreasing in K (every
    model of the package is). Doubling, then bisection: ``O(log K)`` calls.
    """
    def fits(k: int) -> bool:
        return cost(k).total_bytes <= budget_bytes

    if not fits(2):
        return 0
    lo, hi = 2, 4  # lo fits; hi is the next candidate
    while True:
        if hi >= upper:
            if fits(upper):
                return upper
            hi = upper
            break
        if not fits(hi):
            break
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
