"""The metrics of big datasets, computed after their upload's answer.

An upload of more than :data:`service.storage.registry.INLINE_METRICS_SCORES` scores is
answered once its arrays and row are stored, with ``metrics`` null; its serve process
then computes them here (:func:`service.storage.registry.fill_metrics`, from the stored
arrays) on one daemon thread, one dataset at a time, so big uploads never compute at
once more than one report per process.

A process may stop before it gets to them. Every ``interval`` seconds, and once at
start, the thread also takes every dataset still without metrics that is older than
``grace`` seconds: younger ones belong to an upload whose process is about to compute
them. Two processes that compute the same dataset write it once (the update takes only
a row still without metrics); both reports are the same figures.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from sqlalchemy.orm import sessionmaker

from service.storage import registry
from service.storage.arrays import ArrayStore

log = logging.getLogger("welltempered.storage")

#: Seconds a dataset without metrics is left to its own upload's process.
GRACE_SECONDS = 60.0


class MetricsFiller:
    """Computes the metrics of the datasets :meth:`submit` names, and of those left
    without (module docstring), until :meth:`stop`."""

    def __init__(
        self,
        sessions: sessionmaker,
        arrays: ArrayStore,
        interval: float,
        grace: float = GRACE_SECONDS,
    ):
        self.sessions = sessions
        self.arrays = arrays
        #: Seconds between two looks for datasets left without metrics (0: at start only).
        self.interval = interval
        self.grace = grace
        self._queue: queue.Queue[int | None] = queue.Queue()  # None: wake up to stop
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="welltempered-dataset-metrics", daemon=True
        )

    def start(self) -> MetricsFiller:
        self._thread.start()
        return self

    def submit(self, dataset_id: int) -> None:
        """Compute the metrics of ``dataset_id`` (stored without them) soon."""
        self._queue.put(dataset_id)

    def _run(self) -> None:
        look_at = time.monotonic()  # the first look: now
        while True:
            wait = None if look_at is None else max(0.0, look_at - time.monotonic())
            try:
                dataset_id = self._queue.get(timeout=wait)
            except queue.Empty:
                self._look_for_left()
                look_at = time.monotonic() + self.interval if self.interval > 0 else None
                continue
            if self._stopping.is_set():
                return
            try:
                registry.fill_metrics(self.sessions, self.arrays, dataset_id)
            except Exception:
                log.warning(
                    "the metrics of dataset %d failed; taken again within %g s",
                    dataset_id, self.interval + self.grace, exc_info=True,
                )  # fmt: skip

    def _look_for_left(self) -> None:
        try:
            with self.sessions() as session:
                left = registry.datasets_without_metrics(session, self.grace)
        except Exception:
            log.warning("the look for datasets without metrics failed", exc_info=True)
            return
        for dataset_id in left:
            self._queue.put(dataset_id)

    def stop(self) -> None:
        """Let the dataset in progress finish (its figures are written), then end; the
        ones still queued are taken by the next process's look."""
        self._stopping.set()
        self._queue.put(None)  # wakes the thread
        if self._thread.is_alive():
            self._thread.join(timeout=60)
