"""Small numerical kernels, each written once for the library and the service:
row chunking, stable softmax/log-softmax and a few-thread map over chunks.

Large inputs are processed in row chunks of about ``CHUNK_ELEMENTS`` entries,
converted to float64 one chunk at a time: peak extra memory is a few chunks,
not a float64 copy of the input.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
from scipy.special import entr
from threadpoolctl import ThreadpoolController

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


def map_rows(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``fn`` applied to row chunks of ``x``, gathered into a float64 array of ``x``'s shape.

    Parameters
    ----------
    fn : callable
        Maps a block of rows, ndarray of shape (n_block, n_cols), to an array of
        the same shape.
    x : ndarray of shape (n_rows, n_cols)

    Returns
    -------
    ndarray of shape (n_rows, n_cols), float64

    Examples
    --------
    >>> map_rows(lambda block: 2.0 * block, np.ones((3, 2))).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """
    out = np.empty(x.shape, dtype=np.float64)
    for rows in row_chunks(*x.shape):
        out[rows] = fn(x[rows])
    return out


def map_chunks(fn: Callable[[slice], object], n_rows: int, n_cols: int,
               chunk_elements: int | None = None) -> list:
    """``[fn(s) for s in row_chunks(...)]``, on a few threads when there are several chunks."""
    return list(imap_chunks(fn, n_rows, n_cols, chunk_elements))


def imap_chunks(fn: Callable[[slice], object], n_rows: int, n_cols: int,
                chunk_elements: int | None = None) -> Iterator:
    """``fn(s)`` for each ``s`` of :func:`row_chunks` (of about ``chunk_elements``
    entries), in order, computed ahead on :func:`n_threads` threads with at most two
    chunks per thread in flight.

    Results come in chunk order, so a caller that adds them up as they come gets the
    same sums, to the bit, with any number of threads. At most ``2 * n_threads()``
    chunks are in flight: a result of an (n_cols,) vector per chunk costs a few
    vectors, not one per chunk (:func:`map_chunks` keeps them all).

    Examples
    --------
    >>> [s.start for s in imap_chunks(lambda rows: rows, 5, 1 << 17)]
    [0, 2, 4]
    """
    slices = list(row_chunks(n_rows, n_cols, chunk_elements))
    workers = n_threads()
    if workers == 1 or len(slices) < 2:
        yield from map(fn, slices)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for rows in slices:
            pending.append(pool.submit(fn, rows))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def log_softmax(u: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of a float64 array, stable for any finite input."""
    out = u - u.max(axis=1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=1, keepdims=True))
    return out


def softmax(u: np.ndarray) -> np.ndarray:
    """Row-wise softmax of a float64 array; rows sum to 1, no NaN for finite input.

    Parameters
    ----------
    u : ndarray of shape (n_rows, n_cols), float64

    Returns
    -------
    ndarray of shape (n_rows, n_cols), float64

    Examples
    --------
    >>> softmax(np.array([[0.0, 0.0], [1000.0, 1000.0 + np.log(3.0)]])).round(12).tolist()
    [[0.5, 0.5], [0.25, 0.75]]
    """
    return _normalised_exp(u)[0]


def softmax_terms(
    u: np.ndarray, *, overwrite: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`softmax` of a float64 array with the two per-row numbers that normalise it.

    ``p = exp(u - row_max) / exp(log_total)``, with ``log_total = log(sum(exp(u -
    row_max)))``: a loss needs ``log_total - (u_y - row_max)``, the NLL of class
    ``y``, next to ``p`` for its gradient.

    Parameters
    ----------
    u : ndarray of shape (n_rows, n_cols), float64
    overwrite : bool, default False
        Compute ``p`` in the memory of ``u`` (no second (n_rows, n_cols) array).

    Returns
    -------
    p : ndarray of shape (n_rows, n_cols), float64
        Exactly ``softmax(u)``; ``u`` itself when ``overwrite``.
    row_max : ndarray of shape (n_rows,), float64
    log_total : ndarray of shape (n_rows,), float64
    """
    out, row_max, total = _normalised_exp(u, u if overwrite else None)
    return out, row_max[:, 0], np.log(total[:, 0])


def softmax_entropy(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`softmax` of a float64 array and the entropy of each row, without a log
    per entry.

    With ``d = u - max(u)`` and ``S = sum(exp(d))`` (so ``log p = d - log S``), a row's
    entropy is

    .. math::

        H = -\\sum_k p_k \\log p_k = \\log S - \\sum_k p_k d_k ,

    a sum of two non-negative terms: one log per row and a dot product instead of a
    log per entry. It equals ``scipy.special.entr(p).sum(axis=1)`` to rounding
    (``tests/calibrators/evaluation/test_metrics.py`` checks 1e-12 relative). ``u`` is
    overwritten with ``d``.

    Parameters
    ----------
    u : ndarray of shape (n_rows, n_cols), float64

    Returns
    -------
    p : ndarray of shape (n_rows, n_cols), float64
        Exactly ``softmax(u)``.
    entropy : ndarray of shape (n_rows,), float64
        In nats.

    Examples
    --------
    >>> p, h = softmax_entropy(np.log(np.array([[0.5, 0.25, 0.25], [1.0, 1e-300, 1e-300]])))
    >>> p.round(12).tolist()[0], h.round(6).tolist()
    ([0.5, 0.25, 0.25], [1.039721, 0.0])
    """
    p, _, total = _normalised_exp(u, keep_shift=True)
    entropy = np.log(total[:, 0]) - np.einsum("ij,ij->i", p, u)
    bad = ~np.isfinite(entropy)  # d = -inf (a range past float64's): 0 * -inf
    if bad.any():
        entropy[bad] = entr(p[bad]).sum(axis=1)
    return p, entropy


def _normalised_exp(
    u: np.ndarray, out: np.ndarray | None = None, *, keep_shift: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(softmax(u), row max, row sum of exp(u - row max))``, the last two of shape (n, 1).

    With ``keep_shift``, ``u`` is overwritten with ``u - row max`` and the softmax is a
    new array (``out`` is ignored): the same numbers either way.
    """
    row_max = u.max(axis=1, keepdims=True)
    if keep_shift:
        out = np.exp(np.subtract(u, row_max, out=u))
    else:
        out = np.subtract(u, row_max, out=out)
        np.exp(out, out=out)
    total = out.sum(axis=1, keepdims=True)
    out /= total
    return out, row_max, total


_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None
# Built on first use (numpy's and scipy's BLAS are loaded by then): finding the
# libraries takes milliseconds, setting a limit microseconds.
_blas_controller = None


@contextmanager
def single_threaded_blas():
    """Limit BLAS to one thread while any caller is inside this context.

    The products of the penalised fits are small (N x K by K x K); OpenBLAS's
    threads spin when another process or thread holds the other cores (the fit
    slows down many times over; ``bench/README.md`` has the figures), and our own
    fold threads already use the cores. The BLAS thread count is process-wide, so nested and
    concurrent users are reference-counted: the first sets the limit, the
    last restores it (a plain ``threadpool_limits`` per thread would restore
    it under the feet of a thread still running).
    """
    global _blas_users, _blas_limiter, _blas_controller
    with _blas_lock:
        if _blas_users == 0:
            if _blas_controller is None:
                _blas_controller = ThreadpoolController()
            _blas_limiter = _blas_controller.limit(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None
