"""The embedded fit queue: threads of the serve process run fits (SQLite, ``make run``).

One process owns the database file, so the queue lives in memory: versions are taken
round-robin across namespaces, in order within one, at most ``running_per_namespace``
of a namespace at once (the same rules as :mod:`service.jobs.engine`). What a dead
process left unfinished runs when the next one starts (the running ones again, as
their next attempt), never marked failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.jobs.attempts import HANDED_BACK, CacheReport, WorkerConfig, execute
from service.jobs.engine import worker_name
from service.storage import fits
from service.storage.db import CalibratorVersion

log = logging.getLogger("welltempered.fits")


class LocalQueue:
    """Run fits in ``workers`` threads of this process (each attempt in a child process
    unless ``config.executor == "thread"``).

    ``on_finished(version_id)`` is called after an attempt ran to an end, ``on_cache``
    with the read cache's figures of its reads (:func:`~service.jobs.attempts.execute`). On
    :meth:`stop`, running attempts may go on for ``grace_seconds``, then they are
    stopped and their versions queued again for the next start.
    """

    def __init__(
        self,
        config: WorkerConfig,
        sessions: sessionmaker,
        *,
        workers: int = 1,
        running_per_namespace: int = 2,
        grace_seconds: float = 10.0,
        on_finished: Callable[[int], None] | None = None,
        on_cache: CacheReport | None = None,
    ):
        self.config = config
        self.sessions = sessions
        self.workers = workers
        self.running_per_namespace = running_per_namespace
        self.grace_seconds = grace_seconds
        self.on_finished = on_finished
        self.on_cache = on_cache
        self.name = worker_name("serve")
        self._cond = threading.Condition()
        self._waiting: dict[str, deque[int]] = {}
        self._ring: deque[str] = deque()  # namespaces, next to serve first
        self._running: dict[str, int] = {}
        self._cancelled: set[int] = set()
        self._stop_at: float | None = None
        self._threads: list[threading.Thread] = []

    # -- the queue interface (see service.jobs.queue) --------------------------------

    def enqueue(self, session: Session, version: CalibratorVersion, namespace: str) -> None:
        """Nothing to write: the committed ``queued`` row is the job (:meth:`submitted`)."""

    def submitted(self, version_id: int, namespace: str) -> None:
        with self._cond:
            self._waiting.setdefault(namespace, deque()).append(version_id)
            if namespace not in self._ring:
                self._ring.append(namespace)
            self._cond.notify()

    def cancel(self, session: Session, version: CalibratorVersion) -> None:
        """Nothing to write: the row's ``cancelled`` status is what counts (:meth:`cancelled`)."""

    def cancelled(self, version_id: int) -> None:
        with self._cond:
            self._cancelled.add(version_id)
            for waiting in self._waiting.values():
                if version_id in waiting:
                    waiting.remove(version_id)

    def start(self, recover: bool = True) -> LocalQueue:
        """Start the workers on every queued version; with ``recover``, first queue again
        the versions a dead process left running (once per database file: ``serve``
        does it before its uvicorn workers start, and they start with False)."""
        if recover:
            requeued = fits.requeue_running(self.sessions)
            if requeued:
                log.warning("queued again %d fit(s) left running by a stopped server", requeued)
        for version_id, namespace in fits.queued(self.sessions):
            self.submitted(version_id, namespace)
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"welltempered-fit-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop_at = time.monotonic() + self.grace_seconds
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.grace_seconds + 10)

    # -- the workers -----------------------------------------------------------------

    def _next(self) -> tuple[int, str] | None:
        with self._cond:
            while self._stop_at is None:
                for _ in range(len(self._ring)):
                    namespace = self._ring[0]
                    self._ring.rotate(-1)  # served (or skipped): to the back of the ring
                    waiting = self._waiting.get(namespace)
                    if not waiting:
                        self._ring.remove(namespace)
                        self._waiting.pop(namespace, None)
                        continue
                    if self._running.get(namespace, 0) >= self.running_per_namespace:
                        continue
                    self._running[namespace] = self._running.get(namespace, 0) + 1
                    return waiting.popleft(), namespace
                self._cond.wait()
            return None

    def _stop_reason(self, version_id: int) -> str | None:
        if version_id in self._cancelled:
            return "cancel"
        if self._stop_at is not None and time.monotonic() >= self._stop_at:
            return "shutdown"
        return None

    def _work(self) -> None:
        while (item := self._next()) is not None:
            version_id, namespace = item
            try:
                outcome = execute(
                    version_id,
                    self.config,
                    self.sessions,
                    self.name,
                    lambda v=version_id: self._stop_reason(v),
                    on_cache=self.on_cache,
                )
            except Exception:
                log.exception("fit attempt of version id %s failed outside the fit", version_id)
                outcome = "failed"
                try:
                    fits.fail(self.sessions, version_id, "the fit worker failed; see the log")
                except Exception:
                    log.exception("could not mark version id %s failed", version_id)
            finally:
                with self._cond:
                    self._running[namespace] -= 1
                    self._cancelled.discard(version_id)
                    self._cond.notify()
            if outcome != HANDED_BACK and self.on_finished is not None:
                try:
                    self.on_finished(version_id)
                except Exception:
                    log.exception("on_finished of version id %s failed", version_id)
