"""The fits of a serve process: which queue, and whether this process runs fits.

- SQLite (``make run``): :class:`~service.jobs.local.LocalQueue`, threads of this
  process; one process per database file.
- PostgreSQL: :class:`~service.jobs.engine.JobEngine` (Procrastinate). Any number of
  API replicas enqueue and cancel; ``welltempered worker`` processes run fits, and so
  does each serve process unless ``WELLTEMPERED_RUN_FITS=false`` (API only).

A queue has four calls: ``enqueue(session, version, namespace)`` and
``cancel(session, version)`` inside the request's transaction, ``submitted(version_id,
namespace)`` and ``cancelled(version_id)`` after its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from sqlalchemy.orm import sessionmaker

from service.jobs.attempts import CacheReport, WorkerConfig
from service.jobs.engine import JobEngine
from service.jobs.fitting import memory_budget
from service.jobs.local import LocalQueue
from service.settings import Settings
from service.storage import retry

log = logging.getLogger("welltempered.fits")


def worker_config(settings: Settings) -> WorkerConfig:
    return WorkerConfig(
        database_url=settings.database_url,
        data_dir=str(settings.data_dir),
        progress_interval=settings.progress_interval_seconds,
        executor=settings.fit_executor,
        threads=settings.fit_threads or max(1, (os.cpu_count() or 2) // 2),
        memory_budget=memory_budget(settings.fit_memory_bytes, settings.fit_workers),
        max_attempts=settings.fit_max_attempts,
        array_store=settings.array_store,
        array_cache_bytes=settings.array_cache_bytes,
    )


def job_engine(
    settings: Settings,
    sessions: sessionmaker,
    role: str = "worker",
    on_finished: Callable[[int], None] | None = None,
    on_cache: CacheReport | None = None,
) -> JobEngine:
    return JobEngine(
        worker_config(settings),
        sessions,
        running_per_namespace=settings.max_running_fits_per_namespace,
        heartbeat_seconds=settings.worker_heartbeat_seconds,
        stalled_seconds=settings.worker_stalled_seconds,
        grace_seconds=settings.fit_grace_seconds,
        role=role,
        on_finished=on_finished,
        on_cache=on_cache,
    )


class Fits:
    """The serve process's fits: ``queue`` for the API, workers started by :meth:`start`
    when this process runs fits, stopped (hand-backs included) by :meth:`stop`.
    ``on_finished`` and ``on_cache`` are the queue's (:class:`~service.jobs.local.LocalQueue`)."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker,
        on_finished: Callable[[int], None] | None = None,
        on_cache: CacheReport | None = None,
    ):
        self.settings = settings
        self.config = worker_config(settings)
        self.runs_fits = settings.run_fits
        self._task: asyncio.Task | None = None
        if settings.is_sqlite:
            self.queue: LocalQueue | JobEngine = LocalQueue(
                self.config,
                sessions,
                workers=settings.fit_workers,
                running_per_namespace=settings.max_running_fits_per_namespace,
                grace_seconds=settings.fit_grace_seconds,
                on_finished=on_finished,
                on_cache=on_cache,
            )
        else:
            self.queue = job_engine(settings, sessions, "serve", on_finished, on_cache)

    async def start(self) -> None:
        if not self.runs_fits:
            log.info("this process runs no fits (WELLTEMPERED_RUN_FITS=false)")
            return
        if isinstance(self.queue, LocalQueue):
            # Its reads come before its threads start: a failed start can be run again.
            retry.until_reachable(
                self.queue.start, self.settings.recover_jobs,
                wait_seconds=self.settings.startup_database_wait_seconds,
                what="queueing the waiting fits",
            )
            return
        # Opened here, in the lifespan's start-up: a pool cancelled while it connects
        # would leave its own tasks behind.
        await self.queue.open()
        self._task = asyncio.create_task(
            self.queue.work(self.settings.fit_workers, install_signal_handlers=False),
            name="welltempered-worker",
        )

    async def stop(self) -> None:
        if isinstance(self.queue, LocalQueue):
            if self.runs_fits:
                await asyncio.to_thread(self.queue.stop)
            return
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, timeout=self.settings.fit_grace_seconds + 15)
        await self.queue.close()
