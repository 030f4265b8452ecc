"""Served rows per predicted class, per version and time bucket: label shift's counts.

Predict must not write to the database per request, and several processes and
replicas serve the same version. So each process adds the predicted classes of the
rows it serves to an in-process count vector per (version, bucket)
(:meth:`ServedCounts.add`: one ``bincount`` under a lock), and a thread flushes them
every ``Settings.served_flush_seconds`` (:class:`Flusher`) by adding them to
``served_classes`` rows in one upsert (:func:`service.storage.counts.add_counts`): the
database adds, so the counts of every process add up, and a window is one ``SUM``.
The buckets are the feedback buckets (``Settings.feedback_bucket_seconds``), so a
label-shift window covers the same time as the live calibration's.

Bounded state for large K. Up to :data:`EXACT_CLASSES` classes every count is kept
exactly: at most K rows per (version, bucket). Above it (language-model vocabularies),
each flush keeps the :data:`EXACT_CLASSES` classes it counted most and adds the rest
to one ``other`` row (class :data:`OTHER`): at most ``EXACT_CLASSES + 1`` rows per
flush and bucket, whatever K. A class's window count is then low by at most the sum,
over the flushes that did not keep it, of that flush's 1,000th count, itself at most
the flush's rows / 1,000: each count is exact to within 0.1 % of the window's rows
(the Misra-Gries bound, per flush). Label shift above K = 1,000 is estimated on those
classes plus ``other`` (:mod:`service.observe.label_shift`).

A process killed between flushes loses its unflushed counts (at most one interval);
a clean shutdown flushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime

import numpy as np
from sqlalchemy.orm import sessionmaker

from service.errors import NotFound
from service.observe.monitoring import bucket_start
from service.observe.pending import drain_by_key
from service.storage import counts
from service.storage.db import ServedClass

log = logging.getLogger("welltempered.monitoring")

#: Up to this many classes, every served class is counted exactly.
EXACT_CLASSES = 1000
#: The class index of the rows of the classes a flush did not keep.
OTHER = -1
#: Below this many rows per class, a batch is counted with ``np.add.at`` (O(rows)),
#: not a ``bincount`` over every class (O(K): 262,144 for one row of a vocabulary).
_SPARSE_RATIO = 8
#: Batches of at most this many rows are counted together, once :data:`_FOLD_BATCHES`
#: are waiting or the counts are drained (:meth:`ServedCounts.add`).
_FOLD_ROWS = 16
_FOLD_BATCHES = 1024

VersionKey = tuple[int, datetime]


def kept_counts(vector: np.ndarray) -> dict[int, int]:
    """``{class: count}`` of the nonzero counts to write: all of them up to
    :data:`EXACT_CLASSES` classes; above, the largest :data:`EXACT_CLASSES` (ties by
    class index) and the rest summed under :data:`OTHER`.

    >>> kept_counts(np.array([0, 3, 1]))
    {1: 3, 2: 1}
    """
    nonzero = np.flatnonzero(vector)
    if vector.size <= EXACT_CLASSES or nonzero.size <= EXACT_CLASSES:
        return {int(i): int(vector[i]) for i in nonzero}
    order = np.lexsort((nonzero, -vector[nonzero]))
    kept = nonzero[order[:EXACT_CLASSES]]
    out = {int(i): int(vector[i]) for i in kept}
    out[OTHER] = int(vector[nonzero].sum() - vector[kept].sum())
    return out


class ServedCounts:
    """The predicted classes this process served, per (version, bucket), until flushed.

    Parameters
    ----------
    bucket_seconds : int
        The bucket width (``Settings.feedback_bucket_seconds``).
    clock : callable, default time.time
        Unix seconds now (tests move it).
    """

    def __init__(self, bucket_seconds: int, clock: Callable[[], float] = time.time):
        self.bucket_seconds = bucket_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[VersionKey, int], np.ndarray] = {}
        #: Batches of a few rows not counted yet (:meth:`fold`); ``deque`` appends and
        #: pops are atomic.
        self._pending: deque = deque()

    def add(self, version: VersionKey, num_classes: int, labels: np.ndarray) -> None:
        """Count served rows whose predicted classes are ``labels`` (ints in [0, K)).

        A batch of a few rows (a predict of one, every time) is kept until
        :data:`_FOLD_BATCHES` are waiting or the counts are drained, then counted with
        the others in one pass: one by one, the conversions, the lock and ``np.add.at``
        cost more than the count (bench/README.md, "Serving through http.client")."""
        labels = np.asarray(labels, dtype=np.int64).ravel()
        if labels.size == 0:
            return
        key = (version, bucket_start(self.clock(), self.bucket_seconds))
        if labels.size > _FOLD_ROWS:
            self._count(key, num_classes, labels)
            return
        pending = self._pending
        pending.append(((key, num_classes), labels))
        if len(pending) >= _FOLD_BATCHES:
            self.fold()

    def fold(self) -> None:
        """Count the batches :meth:`add` has kept (safe from any thread)."""
        for (key, num_classes), batches in drain_by_key(self._pending).items():
            self._count(key, num_classes, np.concatenate(batches))

    def _count(self, key: tuple[VersionKey, int], num_classes: int, labels: np.ndarray) -> None:
        sparse = labels.size * _SPARSE_RATIO < num_classes
        batch = None if sparse else np.bincount(labels, minlength=num_classes)
        with self._lock:
            vector = self._counts.get(key)
            if vector is None:
                vector = self._counts[key] = np.zeros(num_classes, dtype=np.int64)
            if sparse:
                np.add.at(vector, labels, 1)
            else:
                vector += batch

    def drain(self) -> dict[tuple[VersionKey, int], np.ndarray]:
        """The counts so far, removed from this object."""
        self.fold()
        with self._lock:
            drained, self._counts = self._counts, {}
        return drained

    def flush(self, sessions: sessionmaker) -> int:
        """Add the counts so far to ``served_classes`` (:func:`kept_counts` of each
        vector); returns the rows written. Counts of versions deleted since they served
        are dropped. On a database error the counts are put back for the next flush."""
        drained = self.drain()
        if not drained:
            return 0
        try:
            with sessions() as session:
                live = counts.live_versions(session, {version for version, _ in drained})
                by_version: dict[int, list[counts.CountRow]] = {}
                for (version, bucket), vector in drained.items():
                    if version in live:
                        by_version.setdefault(version[0], []).extend(
                            (version[0], bucket, c, n) for c, n in kept_counts(vector).items()
                        )
                rows = [row for group in by_version.values() for row in group]
                try:
                    counts.add_counts(session, ServedClass, rows)
                except NotFound:  # a version deleted meanwhile: write the others one by one
                    for group in by_version.values():
                        try:
                            counts.add_counts(session, ServedClass, group)
                        except NotFound:
                            pass
        except Exception:
            self._restore(drained)
            raise
        return len(rows)

    def _restore(self, drained: dict[tuple[VersionKey, int], np.ndarray]) -> None:
        with self._lock:
            for key, vector in drained.items():
                current = self._counts.get(key)
                self._counts[key] = vector if current is None else current + vector


class Flusher:
    """Calls :meth:`ServedCounts.flush` every ``interval`` seconds until :meth:`stop`,
    which flushes once more; a failed flush is logged and retried at the next one."""

    def __init__(self, served: ServedCounts, sessions: sessionmaker, interval: float):
        self.served = served
        self.sessions = sessions
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="welltempered-served", daemon=True)

    def start(self) -> Flusher:
        self._thread.start()
        return self

    def _flush(self) -> None:
        try:
            self.served.flush(self.sessions)
        except Exception:
            log.warning(
                "served counts: the flush failed; next in %g s", self.interval, exc_info=True
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._flush()
