"""Background fits: the job function, the worker pool, and crash recovery.

A calibrator version row *is* the job. Its life, and what a crash leaves:

1. the API inserts it ``queued`` (committed) and submits its id to the pool;
2. the worker flips it to ``running``, loads the dataset (``mmap``), fits, and
   writes progress now and then;
3. the worker writes the outcome (``succeeded`` / ``rejected`` with params and
   metrics, or ``failed`` with the error) in ONE transaction, guarded by
   ``WHERE status = 'running'``.

A version that is not ``succeeded`` or ``rejected`` has no params, so a
half-fitted calibrator is never visible. If the serve process dies, rows left
``queued``/``running`` are marked ``failed`` by :func:`recover` on the next start.

:func:`fit_job` is pure numerics (no database), so it is tested directly.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

import calibrators
from calibrators import metrics
from calibrators.holdout import split_indices, split_sizes
from calibrators.validation import to_probabilities
from service.errors import FitTooLarge
from service.jobs import evaluation
from service.storage import fits
from service.storage.arrays import ArrayStore
from service.storage.db import make_engine
from service.vocabulary import AUTO

log = logging.getLogger("welltempered.fits")


def check_fit_request(method: str, options: dict[str, Any]) -> None:
    """Build the calibrator(s) once, so bad options are a 422 now, not a failed job later."""
    if method == AUTO:
        unknown = set(options) - set(calibrators.METHODS)
        if unknown:
            raise calibrators.CalibrationInputError(
                "options of an 'auto' fit are keyed by method "
                f"({', '.join(calibrators.METHODS)}). Got {sorted(unknown)!r}."
            )
        for m in calibrators.METHODS:
            _create(m, options.get(m) or {})
    else:
        _create(method, options)


def _create(method: str, options: Any):
    if not isinstance(options, dict):
        raise calibrators.CalibrationInputError(
            f"options for {method!r} must be an object. Got {options!r}."
        )
    return calibrators.create(method, **options)  # unknown or bad options: the error says


def auto_candidates(argmax_policy: str) -> tuple[str, ...]:
    """The methods an ``auto`` fit tries and chooses among by held-out NLL.

    Under ``require`` only the methods that keep every argmax by construction
    (``preserves_argmax``): the others would be fitted only to be rejected.
    Temperature scaling is one of them, so ``auto`` is never worse than it on the
    held-out NLL. Under ``warn`` and ``off``, every method.
    """
    if argmax_policy == "require":
        return tuple(m for m, cls in calibrators.CALIBRATORS.items() if cls.preserves_argmax)
    return tuple(calibrators.METHODS)


def memory_budget(configured: int | None, fit_workers: int) -> int:
    """Bytes one fit may use: the setting, or half the physical memory per fit worker."""
    if configured:
        return configured
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical // (2 * max(1, fit_workers))


def job_bytes(method: str, options: dict[str, Any], n_fit: int, n_hold: int, k: int,
              itemsize: int) -> int:
    """Memory estimate of one candidate's fit job, its scores included.

    The calibrator's own model (:func:`calibrators.estimate_cost`: working memory and
    the fit rows) plus what the job holds beside it: the held-out rows and two
    float64 probability arrays of them (before and after calibration).
    """
    fit = calibrators.estimate_cost(method, n_fit, k, options, itemsize=itemsize)
    return fit.total_bytes + n_hold * k * (itemsize + 2 * 8)


def _largest_k(method, options, n_fit, n_hold, k, itemsize, budget) -> int:
    """The largest K <= k whose :func:`job_bytes` fits ``budget`` (bisection; 0 if none)."""
    lo, hi = 1, k  # job_bytes(lo) fits (or lo = 1: none does), job_bytes(hi) does not
    if job_bytes(method, options, n_fit, n_hold, 2, itemsize) > budget:
        return 0
    lo = 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if job_bytes(method, options, n_fit, n_hold, mid, itemsize) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _method_options(method: str, options: dict[str, Any], m: str) -> dict[str, Any]:
    return (options.get(m) or {}) if method == AUTO else options


def affordable(method: str, options: dict[str, Any], *, argmax_policy: str, n_rows: int,
               k: int, itemsize: int, holdout: float, budget: int | None) -> tuple[str, ...]:
    """The candidate methods of a fit whose memory estimate fits ``budget``.

    Raises :class:`service.errors.FitTooLarge` when none does (for an explicit method:
    when it does not), naming the method, the estimate and the largest K that fits.
    """
    candidates = auto_candidates(argmax_policy) if method == AUTO else (method,)
    if budget is None:
        return candidates
    n_fit, n_hold = split_sizes(n_rows, holdout)
    need = {
        m: job_bytes(m, _method_options(method, options, m), n_fit, n_hold, k, itemsize)
        for m in candidates
    }
    fits = tuple(m for m in candidates if need[m] <= budget)
    if fits:
        return fits
    cheapest = min(candidates, key=need.__getitem__)
    largest = _largest_k(
        cheapest, _method_options(method, options, cheapest), n_fit, n_hold, k, itemsize, budget
    )
    raise FitTooLarge(
        f"a {cheapest} fit on {n_fit:,} x {k:,} scores needs about {need[cheapest] / 2**30:.3g} "
        f"GiB (estimate), more than a fit worker's budget of {budget / 2**30:.3g} GiB "
        f"(WELLTEMPERED_FIT_MEMORY_BYTES); at {n_fit:,} rows the largest K that fits is "
        f"{largest:,}. Got K = {k:,}.",
        method=cheapest,
        estimate_bytes=need[cheapest],
        budget_bytes=budget,
        max_classes=largest,
    )


def fit_job(
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    kind: str,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
    argmax_policy: str,
    progress: Callable[[float], None] | None = None,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """Fit on the first part of the permutation, evaluate on the rest; no side effects.

    Returns the columns of the finished version: status (succeeded | rejected),
    chosen_method, params, metrics_before/after, argmax, candidates (auto only),
    warning, rejection (why, when rejected) and fit_seconds.
    """
    fit_idx, hold_idx = split_indices(labels.shape[0], holdout, seed)
    x_fit, y_fit = np.asarray(scores[fit_idx]), labels[fit_idx]
    x_hold, y_hold = np.asarray(scores[hold_idx]), labels[hold_idx]
    before = metrics.report(to_probabilities(x_hold, kind), y_hold)

    k = int(scores.shape[1])
    methods = affordable(
        method, options, argmax_policy=argmax_policy, n_rows=labels.shape[0], k=k,
        itemsize=scores.dtype.itemsize, holdout=holdout, budget=memory_budget,
    )
    skipped = [m for m in (auto_candidates(argmax_policy) if method == AUTO else ()) if
               m not in methods]
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for i, m in enumerate(methods):
        opts = (options.get(m) or {}) if method == AUTO else options

        def scaled(p: float, i: int = i) -> None:
            if progress is not None:
                progress(min(1.0, (i + float(p)) / len(methods)))

        t0 = time.perf_counter()
        cal = _create(m, opts).fit(x_fit, y_fit, kind=kind, progress=scaled)
        seconds = time.perf_counter() - t0
        results[m] = {
            "cal": cal,
            **evaluation.evaluate(cal, x_hold, y_hold, kind=kind, argmax_policy=argmax_policy),
            "fit_seconds": seconds,
        }
        scaled(1.0)
    total = time.perf_counter() - started

    allowed = [m for m in methods if results[m]["allowed"]]
    pool = allowed or list(methods)
    chosen = min(pool, key=lambda m: results[m]["metrics"]["nll"])
    best = results[chosen]
    warnings = [w for w in [evaluation.warning(chosen, best["argmax"], argmax_policy)] if w]
    if skipped:
        warnings.append(
            f"auto skipped {', '.join(skipped)}: memory estimate above a fit worker's budget."
        )
    warning = " ".join(warnings) or None
    return {
        "status": "succeeded" if allowed else "rejected",
        "chosen_method": chosen,
        "params": best["cal"].to_params(),
        "metrics_before": before,
        "metrics_after": best["metrics"],
        "argmax": best["argmax"],
        "candidates": (
            {
                m: {k: r[k] for k in ("metrics", "argmax", "fit_seconds", "allowed")}
                for m, r in results.items()
            }
            if method == AUTO
            else None
        ),
        "warning": warning,
        "rejection": evaluation.rejection(results, argmax_policy),
        "fit_seconds": total,
    }


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs (picklable): no engine crosses a process boundary."""

    database_url: str
    data_dir: str
    progress_interval: float
    threads: int | None = None
    #: Bytes one fit may use (an ``auto`` fit skips the candidates above it).
    memory_budget: int | None = None


def _init_worker(threads: int | None) -> None:
    """Runs first in each worker process: cap the numeric libraries' thread pools."""
    if threads is not None:
        from threadpoolctl import threadpool_limits

        global _limits
        _limits = threadpool_limits(limits=threads)


_limits = None


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _engine(url: str) -> Engine:
    with _engines_lock:
        if url not in _engines:
            _engines[url] = make_engine(url)
        return _engines[url]


def dispose_engine(url: str) -> None:
    with _engines_lock:
        engine = _engines.pop(url, None)
    if engine is not None:
        engine.dispose()


def run_fit(version_id: int, config: WorkerConfig) -> str:
    """The job: runs in a worker process (or thread). Returns the final status."""
    factory = sessionmaker(_engine(config.database_url))
    task = fits.claim(factory, version_id)
    if isinstance(task, str):  # not queued (any more): its status
        return task

    last = [0.0]

    def progress(p: float) -> None:
        now = time.monotonic()
        if now - last[0] < config.progress_interval:
            return
        last[0] = now
        try:
            fits.record_progress(factory, version_id, round(float(p), 4))
        except Exception:  # progress is advisory: never fail a fit for it
            log.warning("could not record progress of version id %s", version_id, exc_info=True)

    try:
        store = ArrayStore(Path(config.data_dir))
        scores, labels = store.load(task.scores_sha256), store.load(task.labels_sha256)
        result = fit_job(
            scores, labels, progress=progress, memory_budget=config.memory_budget, **task.spec
        )
    except Exception as exc:  # the job's outcome: recorded, not raised into the pool
        log.info("fit of version id %s failed: %s", version_id, exc)
        fits.finish(factory, version_id, status="failed", error=f"{type(exc).__name__}: {exc}")
        return "failed"
    fits.finish(factory, version_id, progress=1.0, error=None, **result)
    return result["status"]


def mark_failed(session_factory, version_id: int, error: str) -> None:
    fits.fail_unfinished(session_factory, error, version_id)


def recover(session_factory) -> int:
    """Mark fits left queued/running by a dead serve process as failed; returns how many.

    Called once when ``serve`` starts, before any worker exists: nothing can be
    legitimately running then (one ``serve`` per database, see docs/operations.md).
    """
    return fits.fail_unfinished(
        session_factory,
        "interrupted: the server stopped before this fit finished; submit it again",
    )


class FitRunner:
    """Owns the pool. Processes by default: a fit holds the GIL in places (scipy's
    optimizer loop), and a process cannot slow the API's threads down.

    ``on_finished(version_id)``, when given, is called in this process after a job
    ran to its end (succeeded, rejected or failed by the fit itself), from the
    thread that completes the job's future: the layer above records what it needs
    (the app observes the fit's duration) without this module knowing of it. An
    exception it raises is logged, never propagated.
    """

    def __init__(
        self,
        kind: str,
        workers: int,
        config: WorkerConfig,
        session_factory,
        on_finished: Callable[[int], None] | None = None,
    ):
        self.kind = kind
        self.workers = workers
        self.config = config
        self.session_factory = session_factory
        self.on_finished = on_finished
        self._executor: cf.Executor | None = None
        self._lock = threading.Lock()
        self._pending: set[int] = set()

    def _pool(self) -> cf.Executor:
        with self._lock:
            if self._executor is None:
                if self.kind == "process":
                    # spawn: never fork a process that holds sockets, locks and threads.
                    ctx = multiprocessing.get_context("spawn")
                    self._executor = cf.ProcessPoolExecutor(
                        self.workers,
                        mp_context=ctx,
                        initializer=_init_worker,
                        initargs=(self.config.threads,),
                    )
                else:
                    self._executor = cf.ThreadPoolExecutor(self.workers, "welltempered-fit")
            return self._executor

    def submit(self, version_id: int) -> cf.Future:
        try:
            future = self._pool().submit(run_fit, version_id, self.config)
        except cf.BrokenExecutor:
            self._reset()
            future = self._pool().submit(run_fit, version_id, self.config)
        with self._lock:
            self._pending.add(version_id)
        future.add_done_callback(lambda f: self._done(version_id, f))
        return future

    def _reset(self) -> None:
        with self._lock:
            broken, self._executor = self._executor, None
        if broken is not None:
            broken.shutdown(wait=False, cancel_futures=True)

    def _done(self, version_id: int, future: cf.Future) -> None:
        with self._lock:
            self._pending.discard(version_id)
        if future.cancelled():
            error = "cancelled: the server shut down before this fit started"
        elif future.exception() is not None:
            exc = future.exception()
            error = f"the fit worker died: {type(exc).__name__}: {exc}"
            if isinstance(exc, cf.BrokenExecutor):
                self._reset()
        else:
            if self.on_finished is not None:
                try:
                    self.on_finished(version_id)
                except Exception:
                    log.exception("on_finished of version id %s failed", version_id)
            return
        try:
            mark_failed(self.session_factory, version_id, error)
        except Exception:
            log.exception("could not mark version id %s failed", version_id)

    def shutdown(self) -> None:
        """Cancel queued fits and stop running ones (their rows become failed)."""
        with self._lock:
            executor, self._executor = self._executor, None
            pending = set(self._pending)
        if executor is None:
            return
        executor.shutdown(wait=False, cancel_futures=True)
        processes = getattr(executor, "_processes", None) or {}
        for proc in list(processes.values()):
            proc.terminate()
        for proc in list(processes.values()):
            proc.join(timeout=5)
        for version_id in pending:
            try:
                mark_failed(
                    self.session_factory,
                    version_id,
                    "interrupted: the server shut down before this fit finished",
                )
            except Exception:
                log.exception("could not mark version id %s failed", version_id)
        if self.kind == "thread":
            executor.shutdown(wait=True)
            dispose_engine(self.config.database_url)
