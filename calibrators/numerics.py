"""Small numerical kernels, each written once for the library and the service:
row chunking, stable softmax/log-softmax and a few-thread map over chunks.

Large inputs are processed in row chunks of about ``CHUNK_ELEMENTS`` entries,
converted to float64 one chunk at a time: peak extra memory is a few chunks,
not a float64 copy of the input.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
from threadpoolctl import threadpool_limits

#: Entries per chunk (2**18 float64 = 2 MiB per temporary: stays in L2/L3).
CHUNK_ELEMENTS = 1 << 18


def row_chunks(n_rows: int, n_cols: int, chunk_elements: int | None = None) -> Iterator[slice]:
    """Consecutive row slices covering ``range(n_rows)``, each about ``chunk_elements``
    (default: ``CHUNK_ELEMENTS``) entries."""
    step = max(1, (chunk_elements or CHUNK_ELEMENTS) // max(1, n_cols))
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


_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None


@contextmanager
def single_threaded_blas():
    """Limit BLAS to one thread while any caller is inside this context.

    The products of the penalised fits are small (N x K by K x K); OpenBLAS's
    threads spin badly when another process or thread holds the other core
    (measured 20x slower under load), and our own fold threads already use
    the cores. The BLAS thread count is process-wide, so nested and
    concurrent users are reference-counted: the first sets the limit, the
    last restores it (a plain ``threadpool_limits`` per thread would restore
    it under the feet of a thread still running).
    """
    global _blas_users, _blas_limiter
    with _blas_lock:
        if _blas_users == 0:
            _blas_limiter = threadpool_limits(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None
