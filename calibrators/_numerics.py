"""Small numerical kernels shared by the calibrators: row chunking, stable
softmax/log-softmax, and a two-thread map over chunks.

Large inputs are processed in row chunks of about ``CHUNK_ELEMENTS`` entries,
converted to float64 one chunk at a time: peak extra memory is a few chunks,
not a float64 copy of the input.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Entries per chunk (2**18 float64 = 2 MiB per temporary: stays in L2/L3).
CHUNK_ELEMENTS = 1 << 18


def row_chunks(n_rows: int, n_cols: int, chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Consecutive row slices covering ``range(n_rows)``, each about ``chunk_elements``."""
    step = max(1, chunk_elements // max(1, n_cols))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def n_threads() -> int:
    """Threads for chunked numpy work (numpy releases the GIL in ufuncs)."""
    env = os.environ.get("WELLTEMPERED_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def map_chunks(fn: Callable[[slice], object], n_rows: int, n_cols: int) -> list:
    """``[fn(s) for s in row_chunks(...)]``, on a few threads when the input is big."""
    slices = list(row_chunks(n_rows, n_cols))
    workers = n_threads()
    if workers == 1 or len(slices) < 4:
        return [fn(s) for s in slices]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, slices))


def log_softmax(u: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of a float64 array, stable for any finite input."""
    out = u - u.max(axis=1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=1, keepdims=True))
    return out


def softmax(u: np.ndarray) -> np.ndarray:
    """Row-wise softmax of a float64 array; rows sum to 1, no NaN for finite input."""
    out = u - u.max(axis=1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out
