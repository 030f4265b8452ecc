"""Quantiles of the per-row NLL of labelled feedback, from a fixed histogram.

The mean NLL hides what happens to typical rows (for a language model, typical tokens):
the median and p95 track quality better (issue 22). Quantiles need the rows, which the
service never keeps, so each feedback post adds its rows' NLL to the counts of a fixed
log-spaced histogram per (version, time bucket) (``feedback_nll_bins``, added to like
``feedback_bins``), and a window's quantiles are read from the summed counts.

The bins: ``[0, 1e-4)``, then :data:`BINS_PER_DECADE` per decade from ``1e-4`` up to
past ``-log(2**-149) = 103.3`` nats, the largest NLL the service computes (a
probability floored at ``2**-149``): :data:`N_BINS` counts per (version, bucket),
whatever the rows. A quantile is interpolated geometrically inside the bin that holds
it, so it lies in the same bin as the true one (the order statistic of rank
``ceil(q n)``): at or above ``1e-4`` nats it is within a factor
``10 ** (1 / 32) = 1.075`` of it (7.5 %), below, within ``1e-4`` nats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: The histogram's resolution: a quantile is within a factor 10 ** (1 / this) of the truth.
BINS_PER_DECADE = 32
#: The smallest positive edge, nats: NLLs below it share the first bin.
SMALLEST = 1e-4
#: Bin edges, nats: 0, then SMALLEST * 10 ** (i / BINS_PER_DECADE) up to past 103.3.
NLL_EDGES = np.concatenate(([0.0], SMALLEST * 10.0 ** (np.arange(197) / BINS_PER_DECADE)))
N_BINS = NLL_EDGES.size - 1
#: The quantiles exported to Prometheus.
QUANTILES = (0.5, 0.95)


def nll_histogram(nll: np.ndarray) -> np.ndarray:
    """Rows per bin of :data:`NLL_EDGES` (half-open bins, the last closed; larger values
    in the last), int64 of shape (:data:`N_BINS`,).

    >>> h = nll_histogram(np.array([0.0, 1e-5, 1.0, 200.0]))
    >>> int(h[0]), int(h[129]), int(h[-1])
    (2, 1, 1)
    """
    index = np.searchsorted(NLL_EDGES[1:-1], np.asarray(nll, dtype=np.float64), side="right")
    return np.bincount(index, minlength=N_BINS).astype(np.int64)


def quantiles(counts: Sequence[int] | np.ndarray, qs: Sequence[float] = QUANTILES) -> list:
    """The ``qs`` quantiles of the rows counted in ``counts`` (per bin of
    :data:`NLL_EDGES`), or Nones without rows.

    The quantile ``q`` is in the bin where the cumulative count reaches ``ceil(q n)``
    (the inverted-CDF order statistic), interpolated by the rank inside it: linearly in
    the first bin (from 0), geometrically in the others (their width grows with them).

    >>> quantiles(nll_histogram(np.full(10, 2.0)))[0] / 2.0 < 10 ** (1 / 32)
    True
    """
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        return [None] * len(qs)
    cumulative = np.cumsum(counts)
    out = []
    for q in qs:
        rank = max(int(np.ceil(q * n)), 1)
        b = int(np.searchsorted(cumulative, rank, side="left"))
        before = int(cumulative[b - 1]) if b else 0
        fraction = (rank - before) / counts[b]
        lo, hi = NLL_EDGES[b], NLL_EDGES[b + 1]
        out.append(float(lo + fraction * (hi - lo) if b == 0 else lo * (hi / lo) ** fraction))
    return out
