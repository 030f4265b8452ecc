"""The periodic sweeps of a serve process: orphan array files
(:func:`service.storage.array_refs.sweep`) and kept feedback rows past their model's
retention (:func:`service.storage.loops.expire`).

A daemon thread that sweeps every ``interval`` seconds with the grace period of the
settings, so files of uploads in flight are left alone. Several serve processes may
each run one: a sweep is safe against uploads, deletes and other sweeps.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import sessionmaker

from service.storage import array_refs, loops
from service.storage.arrays import ArrayStore

log = logging.getLogger("welltempered.storage")


class Sweeper:
    """Runs :func:`~service.storage.array_refs.sweep` and
    :func:`~service.storage.loops.expire` every ``interval`` seconds until :meth:`stop`;
    a failed sweep is logged and the next one runs on time."""

    def __init__(self, sessions: sessionmaker, arrays: ArrayStore, interval: float, grace: float):
        self.sessions = sessions
        self.arrays = arrays
        self.interval = interval
        self.grace = grace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="welltempered-sweep", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                array_refs.sweep(self.sessions, self.arrays, self.grace)
            except Exception:
                log.warning("the orphan sweep failed; next in %g s", self.interval, exc_info=True)
            try:
                loops.expire(self.sessions)
            except Exception:
                log.warning(
                    "the feedback retention sweep failed; next in %g s", self.interval,
                    exc_info=True,
                )

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
