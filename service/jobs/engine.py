"""Fits on a job engine: Procrastinate, on the service's own PostgreSQL database.

Why Procrastinate: it keeps its queue in PostgreSQL tables, beside ours, so a fit's
version row and its job are written in ONE transaction (:meth:`JobEngine.enqueue`
defers on the request's own connection): a fit is never lost between the two, nor
queued twice. Workers register and send heartbeats; LISTEN/NOTIFY wakes them at once
for new jobs and abort requests. No broker to run.

- Any process may enqueue and cancel (API replicas, ``RUN_FITS=false`` or not).
- Workers (``welltempered worker``, or the serve process itself with
  ``WELLTEMPERED_RUN_FITS=true``, the default) run :meth:`JobEngine.run_worker`: each
  job is one attempt of :func:`service.jobs.attempts.execute`.
- A worker stopping cleanly (SIGTERM) waits up to the grace period, then stops the
  attempts still running and hands their versions back (the job is retried at once by
  another worker); nothing is marked failed.
- A worker that dies (SIGKILL, lost machine) stops sending heartbeats; every worker's
  reaper retries the jobs of workers silent for longer than ``stalled_seconds``. The
  version's attempt counter goes up, and only the newest attempt can write a result.
- Fairness: a namespace's fits are taken in order; across namespaces, round-robin:
  a fit's priority is minus the number of the namespace's fits ahead of it, so the
  first waiting fit of every namespace goes before anyone's second. At most
  ``running_per_namespace`` run at once per namespace: each fit takes one of that many
  locks of its namespace ("lanes"), and a lock runs one job at a time.

Nothing is created at import time: :class:`JobEngine` builds the Procrastinate app.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from procrastinate import App, JobContext, PsycopgConnector, RetryStrategy, SyncPsycopgConnector
from procrastinate.exceptions import JobAborted
from procrastinate.job_context import AbortReason
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.attempts import HANDED_BACK, CacheReport, WorkerConfig, execute
from service.storage import fits
from service.storage.db import CalibratorVersion

log = logging.getLogger("welltempered.fits")

#: The job engine's name of the fit task.
TASK = "welltempered.fit"


def conninfo(database_url: str) -> str:
    """The libpq URI of a SQLAlchemy PostgreSQL URL (its query, e.g. ``options``, kept)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def worker_name(role: str = "worker") -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{role}"


def _driver_connection(session: Session):
    """The request transaction's psycopg connection: the job is deferred in it."""
    return session.connection().connection.driver_connection


class JobEngine:
    """Enqueue, cancel and run fits through Procrastinate.

    Parameters
    ----------
    config : WorkerConfig
        What each attempt needs (its ``database_url`` is the queue's database too).
    sessions : sessionmaker
        This process's sessions, for the claims and hand-backs of attempts.
    running_per_namespace : int
        Most fits of one namespace running at once, fleet-wide.
    heartbeat_seconds, stalled_seconds : float
        A worker's heartbeat interval, and the silence after which its jobs are retried.
    grace_seconds : float
        On stop, how long running attempts may go on before they are handed back.
    on_finished : callable (version_id) -> None, optional
        Called in the worker's process after an attempt ran to an end (not handed back).
    on_cache : callable (CacheStats) -> None, optional
        Called in the worker's process with what an attempt's reads did in the array
        store's read cache (:func:`service.jobs.attempts.execute`).
    """

    def __init__(
        self,
        config: WorkerConfig,
        sessions: sessionmaker,
        *,
        running_per_namespace: int = 2,
        heartbeat_seconds: float = 10.0,
        stalled_seconds: float = 30.0,
        grace_seconds: float = 10.0,
        role: str = "worker",
        on_finished: Callable[[int], None] | None = None,
        on_cache: CacheReport | None = None,
    ):
        self.config = config
        self.sessions = sessions
        self.running_per_namespace = running_per_namespace
        self.heartbeat_seconds = heartbeat_seconds
        self.stalled_seconds = stalled_seconds
        self.grace_seconds = grace_seconds
        self.name = worker_name(role)
        self.on_finished = on_finished
        self.on_cache = on_cache
        self.app = App(
            connector=PsycopgConnector(
                conninfo=conninfo(config.database_url),
                min_size=1,
                max_size=4,
                kwargs={"application_name": f"welltempered-{role}"},
            )
        )
        # Only the attempts the worker stops at shutdown raise (JobAborted): they are
        # retried, as many times as it takes (claim() caps the attempts of a version).
        self.app.task(
            name=TASK,
            pass_context=True,
            retry=RetryStrategy(retry_exceptions={JobAborted}),
        )(self._fit)
        # Requests defer and cancel on their own (synchronous) transaction's connection,
        # through a twin app whose connector is synchronous and never opened: the worker's
        # app, once open, would treat that connection as an asynchronous one.
        self._requests = App(connector=SyncPsycopgConnector(conninfo=conninfo(config.database_url)))

    # -- any process ----------------------------------------------------------------

    def enqueue(self, session: Session, version: CalibratorVersion, namespace: str) -> None:
        """Defer ``version``'s job in ``session``'s transaction (flushed, not committed)."""
        ahead = fits.count_unfinished(session, namespace) - 1  # the version itself counts
        lane = ahead % self.running_per_namespace
        job_id = self._requests.configure_task(
            TASK,
            lock=f"fits/{namespace}/{lane}",
            priority=-ahead,
            connection=_driver_connection(session),
        ).defer(version_id=version.id)
        fits.set_job_id(session, version, job_id)

    def cancel(self, session: Session, version: CalibratorVersion) -> None:
        """Cancel ``version``'s job in ``session``'s transaction: a queued job is never
        started; a running one is aborted (its worker is told at once, by NOTIFY)."""
        if version.job_id is not None:
            self._requests.job_manager.cancel_job_by_id(
                version.job_id, abort=True, connection=_driver_connection(session)
            )

    def submitted(self, version_id: int, namespace: str) -> None:
        """After the commit: nothing (the job was written in the transaction)."""

    def cancelled(self, version_id: int) -> None:
        """After the commit: nothing (the abort request was written in the transaction)."""

    # -- workers --------------------------------------------------------------------

    def _fit(self, context: JobContext, version_id: int) -> str:
        def stop() -> str | None:
            reason = context.abort_reason()
            if reason is None:
                return None
            if reason != AbortReason.USER_REQUEST:
                return "shutdown"
            # A cancel writes the version's status in the transaction that requests the
            # abort. The request itself reaches the worker by a NOTIFY naming a job id,
            # which every listener of the database hears: another schema's job of the
            # same id (tests, or two deployments sharing a database) would stop this fit
            # and leave its version running with its job done. Only our own cancelled
            # version stops it.
            if fits.status_of(self.sessions, version_id) == "cancelled":
                return "cancel"
            return None

        outcome = execute(
            version_id, self.config, self.sessions, self.name, stop, on_cache=self.on_cache
        )
        if outcome == HANDED_BACK:
            raise JobAborted(f"version id {version_id} handed back: the worker is stopping")
        if self.on_finished is not None:
            try:
                self.on_finished(version_id)
            except Exception:
                log.exception("on_finished of version id %s failed", version_id)
        return outcome

    async def reap(self) -> list[int]:
        """Retry the jobs of workers silent for ``stalled_seconds``; returns their
        version ids. Safe to run in every worker at once."""
        stalled = await self.app.job_manager.get_stalled_jobs(
            task_name=TASK, seconds_since_heartbeat=self.stalled_seconds
        )
        retried = []
        for job in stalled:
            version_id = int(job.task_kwargs["version_id"])
            await asyncio.to_thread(fits.hand_back, self.sessions, version_id)
            try:
                await self.app.job_manager.retry_job(job)
            except Exception as exc:  # another reaper was first, or the job was cancelled
                log.info("job %s (version id %s) not retried: %s", job.id, version_id, exc)
                continue
            log.warning(
                "retrying version id %s: its worker (id %s) sent no heartbeat for %g s",
                version_id,
                job.worker_id,
                self.stalled_seconds,
            )
            retried.append(version_id)
        return retried

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self.reap()
            except Exception:
                log.warning(
                    "the stalled-job reaper failed; next in %g s",
                    self.heartbeat_seconds,
                    exc_info=True,
                )

    async def open(self) -> None:
        """Open the worker's connection pool (before :meth:`work`)."""
        await self.app.open_async()

    async def close(self) -> None:
        await self.app.close_async()

    async def work(self, concurrency: int = 1, install_signal_handlers: bool = True) -> None:
        """Run fits until stopped (a signal, or this coroutine's cancellation), then hand
        back what is still running after the grace period. The app must be open."""
        reaper = asyncio.create_task(self._reap_forever(), name="welltempered-reaper")
        try:
            await self.app.run_worker_async(
                name=self.name,
                concurrency=concurrency,
                install_signal_handlers=install_signal_handlers,
                update_heartbeat_interval=self.heartbeat_seconds,
                stalled_worker_timeout=self.stalled_seconds,
                shutdown_graceful_timeout=self.grace_seconds,
                abort_job_polling_interval=1.0,
                fetch_job_polling_interval=2.0,
                listen_notify=True,
                delete_jobs="successful",
            )
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)

    async def run_worker(self, concurrency: int = 1, install_signal_handlers: bool = True) -> None:
        """:meth:`work` between :meth:`open` and :meth:`close` (``welltempered worker``)."""
        await self.open()
        try:
            await self.work(concurrency, install_signal_handlers)
        finally:
            await self.close()
