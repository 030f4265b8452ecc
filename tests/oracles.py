"""The oracles the tests and benchmarks share, each written once.

``softmax`` is written here from its definition, not imported from
``calibrators.numerics``: an oracle must not share the code it checks.
``traced_peak`` measures memory with tracemalloc; ``wait_for_version`` polls a
calibrator version through any client with ``get`` (httpx or FastAPI's TestClient).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from service.vocabulary import UNFINISHED


def softmax(z: np.ndarray) -> np.ndarray:
    """The softmax of each row (the last axis), in float64.

    Parameters
    ----------
    z : array-like of shape (..., n_classes)
        Scores of any real dtype.

    Returns
    -------
    ndarray of shape (..., n_classes), float64
        ``exp(z - max z) / sum exp(z - max z)`` along the last axis.
    """
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def traced_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` under tracemalloc; its result and the peak bytes.

    The peak counts what Python and numpy allocate from the start of the call
    (memory held before it is not traced, so it is not counted).
    """
    tracemalloc.start()
    try:
        result = fn(*args, **kwargs)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def finished(body: dict) -> bool:
    """Whether a version's fit has ended (succeeded, failed or cancelled)."""
    return body["status"] not in UNFINISHED


def status_is(*statuses: str) -> Callable[[dict], bool]:
    """The condition that a version's status is one of ``statuses``."""

    def check(body: dict) -> bool:
        return body["status"] in statuses

    check.__name__ = f"status in {statuses}"
    return check


def wait_for_version(
    client: Any,
    model: str,
    version: int,
    until: Callable[[dict], bool] = finished,
    timeout: float = 120.0,
    interval: float = 0.05,
) -> dict:
    """Poll ``GET /v1/models/{model}/calibrators/{version}`` until ``until(body)``.

    Parameters
    ----------
    client : httpx.Client or fastapi.testclient.TestClient
        A client whose relative URLs reach the service.
    model, version : str, int
        The version to poll.
    until : callable, default: :func:`finished`
        The condition on the version's JSON body.
    timeout, interval : float
        Seconds before giving up (``math.inf``: never) and between two polls.

    Returns
    -------
    dict
        The first body that meets ``until``.

    Raises
    ------
    AssertionError
        On an answer other than 200, or when ``timeout`` passes first (with the last body).
    """
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/models/{model}/calibrators/{version}")
        assert r.status_code == 200, r.text
        body = r.json()
        if until(body):
            return body
        assert time.monotonic() < deadline, f"{until.__name__} not met after {timeout}s: {body}"
        time.sleep(interval)


def shifted_sample(
    labels: np.ndarray, seed: int, concentration: float = 0.5, n: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``labels`` resampled to skewed class priors: issue 23's label-shift protocol.

    The priors are drawn from a symmetric Dirichlet(``concentration``) over the classes;
    each of ``n`` rows (default: as many as ``labels``) draws its class from them and
    then a row of that class uniformly, with replacement (classes absent from
    ``labels`` get their prior's share moved to the others). Seeded:
    ``numpy.random.default_rng(seed)``.

    Returns
    -------
    (ndarray of int, ndarray of float)
        The indices into ``labels``, and the priors drawn.
    """
    rng = np.random.default_rng(seed)
    k = int(labels.max()) + 1
    present = np.bincount(labels, minlength=k) > 0
    priors = rng.dirichlet(np.full(k, concentration)) * present
    priors /= priors.sum()
    n = labels.shape[0] if n is None else n
    classes = rng.choice(k, size=n, p=priors)
    order = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[order], np.arange(k))
    sizes = np.bincount(labels, minlength=k)
    picks = starts[classes] + (rng.random(n) * sizes[classes]).astype(np.int64)
    return order[picks], priors
