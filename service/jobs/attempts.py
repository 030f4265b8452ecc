"""One attempt of a fit: claim the version, run :func:`~service.jobs.fitting.fit_job`
(:func:`~service.jobs.fitting.import_job` for a version from posted parameters),
record the outcome; stop at once when asked.

Whichever queue hands the job over (the embedded one of :mod:`service.jobs.local`, or
the job engine of :mod:`service.jobs.engine`), a worker calls :func:`execute`:

1. :func:`service.storage.fits.claim` flips the version ``queued`` -> ``running`` and
   numbers the attempt;
2. the fit runs in a child process (``executor="process"``, the default: a fit can be
   killed, and its memory is returned when it ends) or in the calling thread
   (``"thread"``: tests, and debugging);
3. the attempt writes its outcome, guarded by its number
   (:func:`service.storage.fits.finish`), so a late writer changes nothing.

While it runs, ``stop()`` is polled every :data:`POLL_SECONDS`: ``"cancel"`` (a user
cancelled the version, which is already marked) kills the child and writes nothing;
``"shutdown"`` (the worker is stopping) kills it and hands the version back to the
queue (``running`` -> ``queued``), never marks it failed. In thread mode the fit is
stopped at its next progress report (cooperative).

A child process watches the worker that started it and exits if that worker is gone
(SIGKILL, lost machine): its attempt would be retried elsewhere anyway, and the guard
would discard its result.

What the attempt's reads did in the array store's read cache (hits, misses, evictions:
:class:`~service.storage.array_cache.CacheStats`) is handed to ``on_cache`` in the
worker's process, through a pipe from a child process, once the arrays are loaded:
the worker exports it (nobody scrapes a fit's process).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from service.jobs import loop
from service.jobs.fitting import fit_job, import_job
from service.storage import fits, loops
from service.storage.array_cache import CacheStats
from service.storage.arrays import ArrayStore
from service.storage.db import make_engine

log = logging.getLogger("welltempered.fits")

#: How often a running attempt looks at ``stop()`` and at its child process.
POLL_SECONDS = 0.1
#: How often a child process checks that the worker that started it is alive.
WATCHDOG_SECONDS = 1.0

#: What :func:`execute` returns besides a version status: the attempt was stopped by
#: the worker's shutdown and the version is queued again.
HANDED_BACK = "handed-back"


@dataclass(frozen=True)
class WorkerConfig:
    """What an attempt needs (picklable): no engine crosses a process boundary."""

    database_url: str
    data_dir: str
    progress_interval: float
    #: ``"process"`` (a child process per attempt) or ``"thread"`` (the caller's thread).
    executor: str = "process"
    #: BLAS/OpenMP threads of a fit.
    threads: int | None = None
    #: Bytes one fit may use (an ``auto`` fit skips the candidates above it).
    memory_budget: int | None = None
    #: Attempts after which a version whose workers keep dying is marked failed.
    max_attempts: int = 5
    #: ``WELLTEMPERED_ARRAY_STORE`` (None: ``<data_dir>/arrays``).
    array_store: str | None = None
    #: ``WELLTEMPERED_ARRAY_CACHE_BYTES``: the budget of the read cache (None: no bound).
    array_cache_bytes: int | None = None


class _Stopped(Exception):
    """Raised from a thread-mode fit's progress report when ``stop()`` asks for it."""


#: Called with what an attempt's reads did in the read cache (in the worker's process).
CacheReport = Callable[[CacheStats], None]


def _report_cache(store: ArrayStore, on_cache: CacheReport | None) -> None:
    stats = store.take_cache_stats()
    if on_cache is None or stats.empty:
        return
    try:
        on_cache(stats)
    except Exception:  # a figure: never fail a fit for it
        log.warning("could not report the read cache's figures", exc_info=True)


def run_claimed(
    version_id: int,
    task: fits.FitTask,
    config: WorkerConfig,
    sessions: sessionmaker,
    stopping: Callable[[], bool] | None = None,
    on_cache: CacheReport | None = None,
) -> str:
    """Run a claimed attempt to its end and record the outcome; returns its status.

    The fit's own failures (bad data, an optimiser error) are the outcome ``failed``,
    recorded with the error. ``stopping()`` True at a progress report raises
    :class:`_Stopped` out of the fit (thread mode). ``on_cache`` gets the read cache's
    figures of the attempt's reads, once they are done.
    """
    last = [0.0]

    def progress(p: float) -> None:
        if stopping is not None and stopping():
            raise _Stopped
        now = time.monotonic()
        if now - last[0] < config.progress_interval:
            return
        last[0] = now
        try:
            fits.record_progress(sessions, version_id, task.attempt, round(float(p), 4))
        except Exception:  # progress is advisory: never fail a fit for it
            log.warning("could not record progress of version id %s", version_id, exc_info=True)

    try:
        store = ArrayStore(Path(config.data_dir), config.array_store, config.array_cache_bytes)
        try:
            scores = store.load(task.scores_sha256)
            labels = None if task.labels_sha256 is None else store.load(task.labels_sha256)
            sequences = (
                None if task.sequences_sha256 is None else store.load(task.sequences_sha256)
            )
            ids = None if task.topk_ids_sha256 is None else store.load(task.topk_ids_sha256)
        finally:
            _report_cache(store, on_cache)
        if task.params is not None:  # a version from posted parameters: evaluated only
            result = import_job(
                task.params, scores, labels, memory_budget=config.memory_budget,
                sequences=sequences, **task.spec,
            )
        else:
            result = fit_job(
                scores, labels, progress=progress, memory_budget=config.memory_budget,
                sequences=sequences, topk_ids=ids, **task.spec,
            )
        also = None if task.comparing is None else _loop_end(task, scores, labels, result)
    except _Stopped:
        raise
    except Exception as exc:  # the fit's outcome: recorded, not raised
        log.info("fit of version id %s failed: %s", version_id, exc)
        fits.fail(sessions, version_id, f"{type(exc).__name__}: {exc}", task.attempt)
        return "failed"
    fits.finish(sessions, version_id, task.attempt, also, progress=1.0, error=None, **result)
    return result["status"]


def _loop_end(task: fits.FitTask, scores, labels, result: dict) -> Callable:
    """A loop candidate's comparison with production (:func:`service.jobs.loop.compare`),
    as the write that goes with its outcome (:func:`service.storage.loops.conclude`)."""
    comparing, spec = task.comparing, task.spec
    comparison = loop.compare(
        comparing.production_params,
        result["params"],
        scores,
        labels,
        kind=spec["kind"],
        holdout=spec["holdout"],
        seed=spec["seed"],
        margin=comparing.margin,
        candidate_status=result["status"],
    )
    return lambda session: loops.conclude(session, comparing.run_id, result, comparison)


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_SECONDS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("the worker (pid %s) is gone: this fit attempt stops", pid)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: its result would be discarded
        except PermissionError:  # alive, another user's process: cannot be ours, but alive
            pass


def _child(
    version_id: int, task: fits.FitTask, config: WorkerConfig, parent: int, report=None
) -> None:
    """The entry point of an attempt's child process; ``report``: the writing end of a
    pipe to the worker, for the read cache's figures."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if config.threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=config.threads)
    engine = make_engine(config.database_url)
    try:
        run_claimed(
            version_id,
            task,
            config,
            sessionmaker(engine),
            on_cache=None if report is None else report.send,
        )
    finally:
        engine.dispose()
        if report is not None:
            report.close()


def _receive_reports(reader, on_cache: CacheReport) -> None:
    """What a child sent through its pipe (it has ended: sent, or never will)."""
    try:
        while reader.poll():
            on_cache(reader.recv())
    except (EOFError, OSError):  # the child closed the pipe, or died while sending
        pass
    except Exception:
        log.warning("could not read the read cache's figures of a fit", exc_info=True)
    finally:
        reader.close()


_context = None
_context_lock = threading.Lock()


def _process_context():
    """``forkserver`` with the fit's modules preloaded: a child starts in milliseconds
    (no new interpreter, no imports), and never inherits this process's sockets,
    locks or threads (as a plain fork of an API process would)."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["service.jobs.attempts"])
            _context = ctx
        return _context


def execute(
    version_id: int,
    config: WorkerConfig,
    sessions: sessionmaker,
    worker: str,
    stop: Callable[[], str | None] = lambda: None,
    on_cache: CacheReport | None = None,
) -> str:
    """One attempt of version ``version_id``; returns the version's status after it
    (``succeeded``, ``rejected``, ``failed``, ``cancelled``, or the status that made
    the claim fail) or :data:`HANDED_BACK`.

    ``stop()`` returns None to go on, ``"cancel"`` or ``"shutdown"`` (see the module).
    ``on_cache`` is called in this process with the read cache's figures of the
    attempt's reads (see the module).
    """
    task = fits.claim(sessions, version_id, worker, config.max_attempts)
    if isinstance(task, str):
        return task
    reason: str | None = None
    if config.executor == "thread":
        try:
            return run_claimed(
                version_id,
                task,
                config,
                sessions,
                stopping=lambda: stop() is not None,
                on_cache=on_cache,
            )
        except _Stopped:
            reason = stop() or "shutdown"
    else:
        context = _process_context()
        reader, writer = context.Pipe(duplex=False) if on_cache is not None else (None, None)
        proc = context.Process(
            target=_child,
            args=(version_id, task, config, os.getpid(), writer),
            name=f"welltempered-fit-{version_id}",
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        finally:
            if writer is not None:
                writer.close()  # the child's copy is the only one: EOF when it ends
        while True:
            proc.join(POLL_SECONDS)
            if proc.exitcode is not None:
                break
            reason = stop()
            if reason is not None:
                proc.kill()
                proc.join()
                break
        if reader is not None:  # sent before the end, even by a child killed since
            _receive_reports(reader, on_cache)
        if reason is None:
            if proc.exitcode != 0:
                how = (
                    f"killed by signal {-proc.exitcode}"
                    if proc.exitcode < 0
                    else f"exit code {proc.exitcode}"
                )
                fits.fail(
                    sessions,
                    version_id,
                    f"the fit process died ({how}; SIGKILL is what the kernel's "
                    "out-of-memory killer sends)",
                    task.attempt,
                )
                return "failed"
            # A child that ends with 0 has recorded its outcome (run_claimed writes it
            # before returning). One still running under this attempt ended some other
            # way (a SystemExit inside the fit ends a process with 0): never leave the
            # version running with its job gone.
            if fits.fail(
                sessions,
                version_id,
                "the fit process ended without recording an outcome",
                task.attempt,
            ):
                log.error("the fit process of version id %s ended without an outcome",
                          version_id)
                return "failed"
            return fits.status_of(sessions, version_id)
    if reason == "cancel":
        return "cancelled"
    fits.hand_back(sessions, version_id, task.attempt)
    return HANDED_BACK
