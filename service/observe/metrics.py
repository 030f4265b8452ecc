"""Every Prometheus metric of the service: a fixed vocabulary, in this one module.

The vocabulary
--------------
Names start with ``welltempered_``, use base units (``_seconds``, ``_nats``;
``_ratio`` for a quantity in [0, 1]) and counters end in ``_total``. Label
names come from a closed set, :data:`LABELS`: ``namespace`` (the tenant owning
the model; two namespaces may each have a model of the same name, so every series
labelled by ``model`` is labelled by ``namespace`` first), ``model``, ``version``,
``alias``, ``method`` (HTTP method on HTTP metrics, calibration method on fit
metrics), ``route`` (the route *template*, never the raw path) and ``status``
(the status *class* "2xx" on HTTP metrics, the job status on
``welltempered_fit_jobs``). Request ids, dataset ids, class indices, API keys
and key ids live in the database and the logs, never in labels (the rate
limit's refusals are counted by the key's ``namespace``). :data:`METRICS`
lists every name with its type and labels.

Nothing is created at import
----------------------------
Importing this module defines the vocabulary (the :class:`EventSpec` constants
listed in :data:`EVENTS`, and :data:`DB_GAUGES`) and nothing else: no metric
object, nothing in prometheus_client's global ``REGISTRY``, no environment read.
:class:`ServiceMetrics` creates the metrics of one process from the vocabulary;
:func:`service.api.app.create_app` builds one and hands it to whatever observes
events (the HTTP middleware, predict and feedback, the fit runner's callback,
the rate limiter) and to ``GET /metrics``.

Two kinds of figures
--------------------
*Events of this process* (requests, served rows, entropy and confidence of
served rows and the sums of their confidence and squared confidence, argmax flips,
feedback rows, fit durations, requests refused by the rate limit, the read cache of its
fits' arrays) are
:class:`~prometheus_client.Counter` / :class:`~prometheus_client.Histogram`
objects of a :class:`ServiceMetrics`, incremented by its methods
:meth:`~ServiceMetrics.observe_request`,
:meth:`~ServiceMetrics.observe_predictions`,
:meth:`~ServiceMetrics.observe_feedback`, :meth:`~ServiceMetrics.observe_fit`,
:meth:`~ServiceMetrics.observe_rate_limited` and
:meth:`~ServiceMetrics.observe_array_cache`.

*Shared state* (fit jobs by status, hold-out quality of each aliased
version, live quality over the feedback window) is read from the database *at
scrape time* by :class:`DatabaseQualityCollector`, so every worker and every
replica reports the same value. Aggregate those gauges across replicas with
``max``/``avg``, never ``sum`` (the dashboard and the alert rules do). The bytes
of the array read cache are read at scrape time too, from the cache folder
(:class:`ArrayCacheCollector`): the same for every process of one data folder,
so per target (``max by (instance)``).

Several worker processes: prometheus_client's multiprocess mode
----------------------------------------------------------------
Followed exactly as its documentation prescribes
(https://prometheus.github.io/client_python/multiprocess/):

1. ``PROMETHEUS_MULTIPROC_DIR`` names a directory, set in the environment by
   the start-up script (Dockerfile / compose, the shell, or ``welltempered
   serve --workers N`` in its parent process) *before* any worker imports
   ``prometheus_client``: the library picks its value storage when it is first
   imported (``prometheus_client.values.ValueClass``). Building a
   :class:`ServiceMetrics` raises :class:`MultiprocessModeError` when the two
   disagree (variable set after the import, or removed since), instead of
   silently exporting one worker's share.
2. The directory is wiped between runs, before start-up: the parent calls
   :func:`prepare_multiprocess_dir` once, before starting the workers
   (``serve --workers N`` calls :func:`export_multiprocess_dir`, which does that
   and sets the variable).
3. Each scrape builds a *fresh* :class:`~prometheus_client.CollectorRegistry`
   holding a :class:`~prometheus_client.multiprocess.MultiProcessCollector`
   (:meth:`ServiceMetrics.render`, :func:`render_multiprocess`), never a
   registry the metrics are registered in (they would be exported twice). Each
   worker builds its own :class:`ServiceMetrics`, and only one: two in one
   process would write the same files.
4. When a worker exits, ``mark_process_dead(pid)`` removes its live-gauge
   files. uvicorn has no ``child_exit`` hook (gunicorn's place for it), so a
   worker calls :meth:`ServiceMetrics.mark_process_dead` at the end of its
   lifespan, and :meth:`ServiceMetrics.mark_dead_workers` at the start of its
   lifespan (files of workers that died without a clean shutdown).
5. The documented limits are respected: no ``Gauge.set_function``, no ``pid``
   label, no Info/Enum, no exemplars, no label ``remove``/``clear``. The only
   process gauge, ``welltempered_http_requests_in_progress``, uses
   ``multiprocess_mode="livesum"``. The database gauges are not
   ``prometheus_client`` objects at all but a collector added to the per-scrape
   registry next to the ``MultiProcessCollector``; it reads the database, not
   process memory, which is why it is correct in this mode (the documented
   "custom collectors do not work" concerns per-process collectors such as the
   CPU and memory ones, which are therefore absent in multiprocess mode).

Without ``PROMETHEUS_MULTIPROC_DIR`` (one process: tests, ``welltempered
serve`` with one worker) the metrics live in the :class:`ServiceMetrics`' own
registry, next to the process, platform and GC collectors that prometheus_client
puts in its default registry, and :meth:`ServiceMetrics.render` exports that
registry. The ``_created`` series are disabled (when a :class:`ServiceMetrics`
is built) so both modes expose the same series.

Work done in other processes (fits run in a process pool) is *not* observed
where it runs: the serve process calls :meth:`ServiceMetrics.observe_fit` when
the job ends (the duration is on the job row), and
:meth:`ServiceMetrics.observe_array_cache` with the read cache's figures the fit's
process sent it (:mod:`service.jobs.attempts`), so the figures are right in both
modes. A dedicated ``welltempered worker`` does the same with a
:class:`ServiceMetrics` of its own, which its own metrics listener serves
(:mod:`service.server.exporter`).
"""

from __future__ import annotations

import bisect
import collections
import functools
import glob
import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.observe.pending import drain_by_key

log = logging.getLogger("welltempered.metrics")

__all__ = [
    "DB_GAUGES",
    "EVENTS",
    "LABELS",
    "METRICS",
    "PREFIX",
    "ArrayCacheCollector",
    "DatabaseQualityCollector",
    "EventSpec",
    "GaugeSpec",
    "MultiprocessModeError",
    "ServiceMetrics",
    "Snapshot",
    "export_multiprocess_dir",
    "prepare_multiprocess_dir",
    "render_multiprocess",
    "route_template",
    "status_class",
]

PREFIX = "welltempered_"
#: The closed set of label names.
LABELS = frozenset(
    {"namespace", "model", "version", "alias", "method", "route", "status", "quantile"}
)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ``route`` of a request no route matched (404s of unknown paths): one series, not one
#: per path a scanner tries.
UNMATCHED_ROUTE = "unmatched"
_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MultiprocessModeError(RuntimeError):
    """``PROMETHEUS_MULTIPROC_DIR`` and prometheus_client's storage disagree."""


def _multiprocess_dir_from_environment() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR``, checked against the storage prometheus_client chose."""
    multiprocess_storage = values.ValueClass is not values.MutexValue
    path = os.environ.get(MULTIPROC_ENV) or None
    if multiprocess_storage and path is None:
        raise MultiprocessModeError(
            f"prometheus_client was imported with {MULTIPROC_ENV} set, but it is unset now: "
            "keep it set for the whole life of the process. Got no value."
        )
    if path is not None and not multiprocess_storage:
        raise MultiprocessModeError(
            f"{MULTIPROC_ENV} was set after prometheus_client was imported, so this process "
            "keeps its metrics in memory and a scrape would only see part of them: set it in "
            f"the environment before the process starts. Got {path!r}."
        )
    return path


# ---------------------------------------------------------------------------
# buckets

#: Seconds; a batch predict of 100k rows or an upload takes seconds.
HTTP_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Nats, from nearly one-hot rows to log(1000) = 6.908 (uniform over 1000 classes);
#: log 2 = 0.693, log 10 = 2.303, log 100 = 4.605 fall just under 0.7, 2.5 and 4.61.
ENTROPY_BUCKETS_NATS = (
    0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 2.5,
    3.0, 3.5, 4.0, 4.61, 5.0, 5.5, 6.0, 6.5, 6.91,
)  # fmt: skip
#: Maximum probability of a row: 1/K up to 1 (K up to 1000), finer near 1.
CONFIDENCE_BUCKETS = (
    0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0,
)  # fmt: skip
#: Seconds; exact fits take milliseconds, Dirichlet on 100k x 1000 takes minutes.
FIT_BUCKETS_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                       300.0, 600.0, 1800.0, 3600.0)  # fmt: skip


# ---------------------------------------------------------------------------
# events of a process (counters and histograms; multiprocess-safe): the specs

_KINDS = {"counter": Counter, "histogram": Histogram, "gauge": Gauge}


@dataclass(frozen=True)
class EventSpec:
    """One metric of the events of a process; :class:`ServiceMetrics` creates it."""

    kind: Literal["counter", "histogram", "gauge"]
    #: The exported name (a counter's with its ``_total``).
    name: str
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    #: How a gauge adds up over worker processes (multiprocess mode).
    multiprocess_mode: str | None = None

    def create(self, registry: CollectorRegistry) -> Counter | Histogram | Gauge:
        """The prometheus_client metric, registered in ``registry`` (never the global one)."""
        options: dict[str, Any] = {}
        if self.buckets is not None:
            options["buckets"] = self.buckets
        if self.multiprocess_mode is not None:
            options["multiprocess_mode"] = self.multiprocess_mode
        return _KINDS[self.kind](
            self.name, self.documentation, self.labels, registry=registry, **options
        )


HTTP_REQUESTS = EventSpec(
    "counter",
    "welltempered_http_requests_total",
    "HTTP requests answered, by route template, HTTP method and status class.",
    ("route", "method", "status"),
)
HTTP_DURATION = EventSpec(
    "histogram",
    "welltempered_http_request_duration_seconds",
    "Time from request to response, by route template, HTTP method and status class.",
    ("route", "method", "status"),
    buckets=HTTP_BUCKETS_SECONDS,
)
HTTP_IN_PROGRESS = EventSpec(
    "gauge",
    "welltempered_http_requests_in_progress",
    "HTTP requests being handled now (summed over the live worker processes).",
    multiprocess_mode="livesum",
)
PREDICTIONS = EventSpec(
    "counter",
    "welltempered_predictions_total",
    "Rows served by /predict (calibrated probability vectors), by namespace, model and version.",
    ("namespace", "model", "version"),
)
PREDICTION_ENTROPY = EventSpec(
    "histogram",
    "welltempered_prediction_entropy_nats",
    "Shannon entropy of each served calibrated row, in nats (0 = one-hot, log K = uniform).",
    ("namespace", "model"),
    buckets=ENTROPY_BUCKETS_NATS,
)
PREDICTION_CONFIDENCE = EventSpec(
    "histogram",
    "welltempered_prediction_confidence_ratio",
    "Confidence (maximum probability) of each served calibrated row.",
    ("namespace", "model"),
    buckets=CONFIDENCE_BUCKETS,
)
PREDICTION_CONFIDENCE_SUM = EventSpec(
    "counter",
    "welltempered_prediction_confidence_total",
    "Sum of the confidence (maximum probability) of served calibrated rows, by namespace, "
    "model and version. Over a window, its increase over that of welltempered_predictions_total "
    "is the expected accuracy of the rows served (calibrators.evaluation.shift).",
    ("namespace", "model", "version"),
)
PREDICTION_CONFIDENCE_SQUARED = EventSpec(
    "counter",
    "welltempered_prediction_confidence_squared_total",
    "Sum of the squared confidence of served calibrated rows, by namespace, model and "
    "version: with the confidence sum, the Poisson-binomial variance sum c(1 - c) of the "
    "number of served rows whose top label is right (the expected accuracy's interval).",
    ("namespace", "model", "version"),
)
ARGMAX_FLIPS = EventSpec(
    "counter",
    "welltempered_prediction_argmax_flips_total",
    "Served rows whose calibrated argmax differs from the uncalibrated argmax (possible "
    "only under argmax_policy 'warn' or 'off').",
    ("namespace", "model", "version"),
)
FEEDBACK_ROWS = EventSpec(
    "counter",
    "welltempered_feedback_rows_total",
    "Labelled rows received by /feedback, by namespace, model and the version that served them.",
    ("namespace", "model", "version"),
)
FIT_DURATION = EventSpec(
    "histogram",
    "welltempered_fit_duration_seconds",
    "Wall time of finished calibrator fits, by requested method.",
    ("method",),
    buckets=FIT_BUCKETS_SECONDS,
)
RATE_LIMITED = EventSpec(
    "counter",
    "welltempered_rate_limited_requests_total",
    "Requests refused with 429 because their API key was over its rate limit in this "
    "process (WELLTEMPERED_RATE_LIMIT_PER_SECOND), by the key's namespace.",
    ("namespace",),
)
ARRAY_CACHE_HITS = EventSpec(
    "counter",
    "welltempered_array_cache_hits_total",
    "Array reads of the fits this process ran that a copy in the local read cache served "
    "(an object-store array store only).",
)
ARRAY_CACHE_MISSES = EventSpec(
    "counter",
    "welltempered_array_cache_misses_total",
    "Array reads of the fits this process ran that downloaded the array from the object "
    "store.",
)
ARRAY_CACHE_EVICTIONS = EventSpec(
    "counter",
    "welltempered_array_cache_evictions_total",
    "Copies the fits this process ran removed from the local read cache to keep it under "
    "WELLTEMPERED_ARRAY_CACHE_BYTES (least recently used first).",
)

#: Every event metric, in the order :class:`ServiceMetrics` creates (and exports) them.
EVENTS = (
    HTTP_REQUESTS, HTTP_DURATION, HTTP_IN_PROGRESS, PREDICTIONS, PREDICTION_ENTROPY,
    PREDICTION_CONFIDENCE, PREDICTION_CONFIDENCE_SUM, PREDICTION_CONFIDENCE_SQUARED,
    ARGMAX_FLIPS, FEEDBACK_ROWS, FIT_DURATION, RATE_LIMITED,
    ARRAY_CACHE_HITS, ARRAY_CACHE_MISSES, ARRAY_CACHE_EVICTIONS,
)  # fmt: skip


# ---------------------------------------------------------------------------
# shared state, read from the database at scrape time


@dataclass(frozen=True)
class GaugeSpec:
    """One gauge of :class:`DatabaseQualityCollector`."""

    name: str
    documentation: str
    labels: tuple[str, ...]


_HOLDOUT = ("namespace", "model", "version", "alias")
_LIVE = ("namespace", "model", "version")

#: The database gauges, keyed by the name used in a snapshot (see :data:`Snapshot`).
DB_GAUGES: dict[str, GaugeSpec] = {
    spec_key: GaugeSpec(*spec)
    for spec_key, spec in {
        "fit_jobs": (
            "welltempered_fit_jobs",
            "Calibrator fit jobs in the database, by namespace and status (queued, running, "
            "succeeded, rejected, failed, cancelled).",
            ("namespace", "status"),
        ),
        "fit_queue_oldest": (
            "welltempered_fit_queue_oldest_seconds",
            "Age of the oldest queued fit of a namespace (absent when none is queued).",
            ("namespace",),
        ),
        "fit_workers_alive": (
            "welltempered_fit_workers_alive",
            "Fit workers whose heartbeat is younger than WELLTEMPERED_WORKER_STALLED_SECONDS, "
            "fleet-wide (PostgreSQL; absent on SQLite, where the serve process runs fits).",
            (),
        ),
        "fit_retries": (
            "welltempered_fit_retries",
            "Attempts beyond the first (a worker died or was stopped mid-fit) of the fits "
            "unfinished or finished in the window.",
            ("namespace",),
        ),
        "fit_seconds": (
            "welltempered_fit_seconds",
            "Quantiles (0.5, 0.95, 1) of the fit time of the fits finished in the window.",
            ("namespace", "quantile"),
        ),
        "fit_wait_seconds": (
            "welltempered_fit_wait_seconds",
            "Quantiles (0.5, 0.95, 1) of the queue wait (queued -> started, last attempt) of "
            "the fits finished in the window.",
            ("namespace", "quantile"),
        ),
        "holdout_ece": (
            "welltempered_holdout_ece_ratio",
            "Top-label ECE (15 equal-width bins) of an aliased version on its hold-out rows, "
            "measured at fit time.",
            _HOLDOUT,
        ),
        "holdout_ece_debiased": (
            "welltempered_holdout_ece_debiased_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of an aliased "
            "version on its hold-out rows at fit time: "
            "estimate.",
            _HOLDOUT,
        ),
        "holdout_ece_debiased_lower": (
            "welltempered_holdout_ece_debiased_lower_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of an aliased "
            "version on its hold-out rows at fit time: "
            "lower bound of its 95 % interval (0 unless the rows show more error than a calibrated"
            " model's noise; alert on it).",
            _HOLDOUT,
        ),
        "holdout_ece_debiased_upper": (
            "welltempered_holdout_ece_debiased_upper_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of an aliased "
            "version on its hold-out rows at fit time: "
            "upper bound of its 95 % interval.",
            _HOLDOUT,
        ),
        "holdout_smooth_ece": (
            "welltempered_holdout_smooth_ece_ratio",
            "Smooth ECE (Blasiok & Nakkiran 2023) of an aliased version on its hold-out rows at "
            "fit time: "
            "estimate.",
            _HOLDOUT,
        ),
        "holdout_smooth_ece_lower": (
            "welltempered_holdout_smooth_ece_lower_ratio",
            "Smooth ECE (Blasiok & Nakkiran 2023) of an aliased version on its hold-out rows at "
            "fit time: "
            "lower bound of its 95 % interval (0 unless the rows show more error than a calibrated"
            " model's noise; alert on it).",
            _HOLDOUT,
        ),
        "holdout_smooth_ece_upper": (
            "welltempered_holdout_smooth_ece_upper_ratio",
            "Smooth ECE (Blasiok & Nakkiran 2023) of an aliased version on its hold-out rows at "
            "fit time: "
            "upper bound of its 95 % interval.",
            _HOLDOUT,
        ),
        "holdout_nll": (
            "welltempered_holdout_nll_nats",
            "Mean negative log-likelihood of an aliased version on its hold-out rows.",
            _HOLDOUT,
        ),
        "holdout_accuracy": (
            "welltempered_holdout_accuracy_ratio",
            "Accuracy of an aliased version on its hold-out rows.",
            _HOLDOUT,
        ),
        "holdout_confidence": (
            "welltempered_holdout_confidence_ratio",
            "Mean top-label confidence of an aliased version on its hold-out rows at fit time: "
            "the hold-out accuracy minus it is the top-label gap the expected accuracy of "
            "served rows is corrected by (calibrators.evaluation.shift).",
            _HOLDOUT,
        ),
        "holdout_rows": (
            "welltempered_holdout_rows",
            "Hold-out rows an aliased version was evaluated on at fit time (the noise of its "
            "hold-out figures).",
            _HOLDOUT,
        ),
        "holdout_argmax_agreement": (
            "welltempered_holdout_argmax_agreement_ratio",
            "Fraction of hold-out rows whose calibrated argmax equals the uncalibrated one.",
            _HOLDOUT,
        ),
        "live_ece": (
            "welltempered_live_ece_ratio",
            "Top-label ECE (15 equal-width bins) of the labelled feedback rows in the window.",
            _LIVE,
        ),
        "live_ece_debiased": (
            "welltempered_live_ece_debiased_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of the "
            "labelled feedback rows in the window, from the per-bin sums: estimate.",
            _LIVE,
        ),
        "live_ece_debiased_lower": (
            "welltempered_live_ece_debiased_lower_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of the "
            "labelled feedback rows in the window, from the per-bin sums: lower bound of its 95 % "
            "interval (0 unless the window shows more error than a calibrated model's noise: the "
            "figure to alert on).",
            _LIVE,
        ),
        "live_ece_debiased_upper": (
            "welltempered_live_ece_debiased_upper_ratio",
            "Debiased L2 top-label ECE (Kumar et al. 2019; 15 equal-width bins) of the "
            "labelled feedback rows in the window, from the per-bin sums: upper bound of its 95 % "
            "interval.",
            _LIVE,
        ),
        "live_ece_bound": (
            "welltempered_live_ece_bound_ratio",
            "Live ECE above which the drift verdict is 'drift' "
            "(calibrators.evaluation.drift bound); "
            "absent while the window has too few labelled rows.",
            _LIVE,
        ),
        "live_nll": (
            "welltempered_live_nll_nats",
            "Mean negative log-likelihood of the labelled feedback rows in the window.",
            _LIVE,
        ),
        "live_accuracy": (
            "welltempered_live_accuracy_ratio",
            "Accuracy of the labelled feedback rows in the window.",
            _LIVE,
        ),
        "live_token_nll": (
            "welltempered_live_token_nll_nats",
            "Quantiles (0.5, 0.95) of the per-row (per-token) negative log-likelihood of the "
            "labelled feedback rows in the window, from a fixed histogram of 32 log-spaced "
            "bins per decade (service.observe.token_nll): within 7.5 % of the exact quantile "
            "above 1e-4 nats.",
            (*_LIVE, "quantile"),
        ),
        "live_entropy": (
            "welltempered_live_entropy_nats",
            "Mean entropy of the calibrated feedback rows in the window, in nats.",
            _LIVE,
        ),
        "live_labelled_rows": (
            "welltempered_live_labelled_rows",
            "Labelled feedback rows in the window.",
            _LIVE,
        ),
        "label_shift_served_rows": (
            "welltempered_label_shift_served_rows",
            "Rows a version served in the window, counted by predicted class for label shift "
            "(each serve process adds its counts every WELLTEMPERED_SERVED_FLUSH_SECONDS).",
            _LIVE,
        ),
        "label_shift_prior_l1": (
            "welltempered_label_shift_prior_l1_distance",
            "Label shift: sum over classes of |q - p|, q the class priors of the rows a "
            "version served in the window (black-box shift estimation from their "
            "predicted-class counts and the version's hold-out confusion matrix), p its "
            "hold-out's; 0 without shift, at most 2. Absent when the hold-out does not "
            "identify the priors.",
            _LIVE,
        ),
        "label_shift_p_value": (
            "welltempered_label_shift_p_value",
            "Label shift verdict: p-value of the chi-square test of a version's served "
            "predicted-class counts in the window against its hold-out's ('shift' below "
            "0.01); absent under 200 served rows.",
            _LIVE,
        ),
        "live_window_seconds": (
            "welltempered_live_window_seconds",
            "Length of the window the live_* gauges are computed over.",
            (),
        ),
        "loop_runs": (
            "welltempered_loop_runs",
            "Recalibration loop runs of a model by state (fitting, promoted, waiting, "
            "not-promoted, failed), counted in the database: every outcome so far.",
            ("namespace", "model", "status"),
        ),
    }.items()
}
_DATABASE_UP = GaugeSpec(
    "welltempered_database_up",
    "1 when the last scrape read the database gauges, 0 when the database query failed.",
    (),
)

_ARRAY_CACHE_BYTES = GaugeSpec(
    "welltempered_array_cache_bytes",
    "Bytes of the read copies in the local array cache of this target's data folder "
    "(object-store array stores; at most WELLTEMPERED_ARRAY_CACHE_BYTES), at scrape time.",
    (),
)


class ArrayCacheCollector:
    """``welltempered_array_cache_bytes``: ``usage()`` (the cache folder's bytes, which
    every process of the folder shares) read at scrape time, like the database gauges.
    No sample when the folder cannot be read (the error is logged)."""

    def __init__(self, usage: Callable[[], int]):
        self._usage = usage

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(_ARRAY_CACHE_BYTES.name, _ARRAY_CACHE_BYTES.documentation)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(_ARRAY_CACHE_BYTES.name, _ARRAY_CACHE_BYTES.documentation)
        try:
            family.add_metric([], float(self._usage()))
        except OSError:
            log.warning("metrics: could not add up the array cache's files", exc_info=True)
        yield family


#: What a snapshot callable returns: for some keys of :data:`DB_GAUGES`, the samples
#: as ``(labels, value)`` with ``labels`` a mapping of exactly the gauge's label
#: names to str/int values. A missing key exports the gauge with no samples; a
#: ``None`` value (an empty window) is skipped.
Snapshot = Mapping[str, Iterable[tuple[Mapping[str, Any], float | None]]]


class DatabaseQualityCollector:
    """Gauges computed at scrape time from ``snapshot()``: the same in every process.

    Parameters
    ----------
    snapshot : callable () -> :data:`Snapshot`
        Reads the database (plain rows, no prometheus objects), e.g.::

            {"fit_jobs": [({"namespace": "a", "status": "running"}, 1)],
             "holdout_ece": [({"namespace": "team-a", "model": "m", "version": 3,
                              "alias": "production"}, 0.012)],
             "live_ece": [({"namespace": "team-a", "model": "m", "version": 3}, 0.019)],
             "live_window_seconds": [({}, 3600)]}

        If it raises, the exception is logged, ``welltempered_database_up`` is 0
        and the gauges have no samples: the process metrics are still served.

    Raises
    ------
    ValueError
        From :meth:`collect`, when the snapshot breaks the contract (unknown key,
        wrong label names, a value that is not a number): a bug, not an outage.

    Examples
    --------
    >>> c = DatabaseQualityCollector(
    ...     lambda: {"fit_jobs": [({"namespace": "a", "status": "queued"}, 2)]})
    >>> [(m.name, [s.value for s in m.samples]) for m in c.collect()][:1]
    [('welltempered_fit_jobs', [2.0])]
    """

    def __init__(self, snapshot: Callable[[], Snapshot]):
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        # Registering calls describe(), so the registry never queries the database then.
        for spec in (*DB_GAUGES.values(), _DATABASE_UP):
            yield GaugeMetricFamily(spec.name, spec.documentation, labels=spec.labels)

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot()
        except Exception:
            log.exception("metrics: the database snapshot failed; database gauges left empty")
            snap, up = {}, 0.0
        else:
            up = 1.0
        unknown = set(snap) - set(DB_GAUGES)
        if unknown:
            raise ValueError(
                f"snapshot keys must be among {sorted(DB_GAUGES)}. Got {sorted(unknown)}."
            )
        for key, spec in DB_GAUGES.items():
            family = GaugeMetricFamily(spec.name, spec.documentation, labels=spec.labels)
            for labels, value in snap.get(key, ()):
                if value is None:
                    continue
                if set(labels) != set(spec.labels):
                    raise ValueError(
                        f"snapshot[{key!r}] labels must be {sorted(spec.labels)}. "
                        f"Got {sorted(labels)}."
                    )
                if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                    raise ValueError(f"snapshot[{key!r}] values must be numbers. Got {value!r}.")
                family.add_metric([str(labels[name]) for name in spec.labels], float(value))
            yield family
        yield GaugeMetricFamily(_DATABASE_UP.name, _DATABASE_UP.documentation, value=up)


# ---------------------------------------------------------------------------
# the catalogue

#: Every metric name -> (type, label names). Counters are listed with ``_total``.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{spec.name: (spec.kind, spec.labels) for spec in EVENTS},
    **{
        spec.name: ("gauge", spec.labels)
        for spec in (*DB_GAUGES.values(), _DATABASE_UP, _ARRAY_CACHE_BYTES)
    },
}


# ---------------------------------------------------------------------------
# labels


def status_class(status_code: int) -> str:
    """``"2xx"`` for 200..299 and so on; ``"other"`` outside 100..599.

    >>> status_class(201), status_class(503), status_class(42)
    ('2xx', '5xx', 'other')
    """
    code = int(status_code)
    return f"{code // 100}xx" if 100 <= code <= 599 else "other"


def _method_label(method: str) -> str:
    upper = str(method).upper()
    return upper if upper in _HTTP_METHODS else "OTHER"


def route_template(scope: Mapping[str, Any]) -> str:
    """The matched route's template (``/v1/models/{model}/predict``) of an ASGI scope.

    Starlette/FastAPI put the matched route in ``scope["route"]`` while routing;
    before routing, or when nothing matched, this is :data:`UNMATCHED_ROUTE`.
    """
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


#: Up to this many values, :func:`_observe_many` puts each in its bucket in a Python
#: loop; above it, one vectorised bucket count is cheaper (the break-even point;
#: bench/README.md).
_SMALL_BATCH = 16
#: Answers of at most :data:`_SMALL_BATCH` rows wait for at most this many others, or
#: this many seconds, before they are counted (:meth:`ServiceMetrics.fold`).
_FOLD_ANSWERS = 256
_FOLD_SECONDS = 1.0


def _observe_few(child, values: list[float]) -> None:
    """:func:`_observe_many` for a few rows (a prediction of one, every time), given as
    Python floats: ``observe``'s own search, by bisection, without its per-call checks
    and its Python loop over the bounds."""
    bounds, buckets, total = child._upper_bounds, child._buckets, child._sum
    for x in values:
        if math.isfinite(x):
            buckets[bisect.bisect_left(bounds, x)].inc(1)
            total.inc(x)


def _observe_many(child, values: np.ndarray) -> None:
    """``child.observe(v)`` for every finite ``v``, with one increment per bucket.

    prometheus_client has no batch API; a Python loop costs two mmap writes per row
    in multiprocess mode. Its histogram keeps non-cumulative bucket counters
    (``_buckets``, one per ``_upper_bounds`` entry, the last +Inf) and ``_sum``, and
    ``observe`` puts ``v`` in the first bucket with ``v <= bound``: that is
    ``searchsorted(bounds, v, side="left")``. tests/service/observe/test_observability.py
    checks the result equals per-row ``observe``.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size <= _SMALL_BATCH:
        _observe_few(child, v.tolist())
        return
    v = v[np.isfinite(v)]
    if v.size == 0:
        return
    bounds = np.asarray(child._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, v, side="left"), minlength=bounds.size)
    for i in np.flatnonzero(counts):
        child._buckets[i].inc(float(counts[i]))
    child._sum.inc(float(v.sum()))


# ---------------------------------------------------------------------------
# the metrics of a process


class ServiceMetrics:
    """The event metrics of this process, created from :data:`EVENTS`; one per app.

    ``PROMETHEUS_MULTIPROC_DIR`` is read here, when the object is built (not when
    this module is imported). With it (multiprocess mode) the values are written to
    that directory, where :meth:`render` in any worker adds up every worker's
    files: build one object per process, after the variable is final. Without it
    the metrics live in this object's own registry, with the process, platform
    and GC collectors, and two objects in one process (two apps in a test) are
    independent.

    Raises
    ------
    MultiprocessModeError
        When ``PROMETHEUS_MULTIPROC_DIR`` and the storage prometheus_client chose
        when it was imported disagree (the variable set after the import, or
        removed since).

    Examples
    --------
    >>> metrics = ServiceMetrics()
    >>> metrics.observe_request("/healthz", "GET", 200, 0.001)
    >>> b'welltempered_http_requests_total{method="GET",route="/healthz",status="2xx"} 1.0' in (
    ...     metrics.render()[0])
    True
    """

    def __init__(self) -> None:
        self.multiprocess_dir = _multiprocess_dir_from_environment()
        # _created series exist only in single-process mode; disable them so both modes agree.
        prometheus_client.disable_created_metrics()
        # Never exported in multiprocess mode (point 3 of the module docstring).
        self._registry = CollectorRegistry(auto_describe=True)
        if self.multiprocess_dir is None:
            # What prometheus_client's default registry holds, in the same order.
            GCCollector(registry=self._registry)
            PlatformCollector(registry=self._registry)
            ProcessCollector(registry=self._registry)
        created = {spec.name: spec.create(self._registry) for spec in EVENTS}
        self.http_requests: Counter = created[HTTP_REQUESTS.name]
        self.http_duration: Histogram = created[HTTP_DURATION.name]
        self.http_in_progress: Gauge = created[HTTP_IN_PROGRESS.name]
        self.predictions: Counter = created[PREDICTIONS.name]
        self.prediction_entropy: Histogram = created[PREDICTION_ENTROPY.name]
        self.prediction_confidence: Histogram = created[PREDICTION_CONFIDENCE.name]
        self.confidence_sum: Counter = created[PREDICTION_CONFIDENCE_SUM.name]
        self.confidence_squared: Counter = created[PREDICTION_CONFIDENCE_SQUARED.name]
        self.argmax_flips: Counter = created[ARGMAX_FLIPS.name]
        self.feedback_rows: Counter = created[FEEDBACK_ROWS.name]
        self.fit_duration: Histogram = created[FIT_DURATION.name]
        self.rate_limited: Counter = created[RATE_LIMITED.name]
        self.array_cache_hits: Counter = created[ARRAY_CACHE_HITS.name]
        self.array_cache_misses: Counter = created[ARRAY_CACHE_MISSES.name]
        self.array_cache_evictions: Counter = created[ARRAY_CACHE_EVICTIONS.name]
        # ``metric.labels(...)`` validates and hashes the labels on every call (six
        # per predict request); the children of a label set never change
        # (nothing here removes series), so they are looked up once. The label sets are
        # closed (route templates, namespaces x models x versions), which bounds these
        # caches like the series themselves.
        self._request_children = functools.lru_cache(maxsize=4096)(self._request_values)
        #: The in-progress gauge's value: the request middleware adds to it directly
        #: (``Gauge.inc``'s checks cost more than the addition, twice per request).
        self.http_in_progress_value = self.http_in_progress._value
        self._prediction_children = functools.lru_cache(maxsize=4096)(self._prediction_labels)
        #: Answers of a few rows not counted yet (:meth:`fold`): ``deque`` appends and
        #: pops are atomic, so threads may add and fold at once.
        self._pending_predictions: deque = deque()
        #: Requests not counted yet (:meth:`observe_request`, :meth:`fold`).
        self._pending_requests: deque = deque()
        self._fold_by = time.monotonic() + _FOLD_SECONDS
        # In multiprocess mode another process answers the scrapes (the parent's
        # listener, or another worker), from the files: each event goes there at once.
        self._fold_answers = 1 if self.multiprocess_dir is not None else _FOLD_ANSWERS

    def _request_values(self, route: str, method: str, status_code: int) -> tuple:
        """What :meth:`observe_request` adds to for these arguments: the request
        counter's value, and the duration histogram's bounds, buckets and sum."""
        labels = (route, _method_label(method), status_class(status_code))
        duration = self.http_duration.labels(*labels)
        count = self.http_requests.labels(*labels)._value
        return count, duration._upper_bounds, duration._buckets, duration._sum

    def _prediction_labels(self, namespace: str, model: str, version: str) -> tuple:
        """What :meth:`observe_predictions` adds to: the row, flip and confidence
        counters' values, and the entropy and confidence histograms."""
        return (
            self.predictions.labels(namespace, model, version)._value,
            self.argmax_flips.labels(namespace, model, version)._value,
            self.prediction_entropy.labels(namespace, model),
            self.prediction_confidence.labels(namespace, model),
            self.confidence_sum.labels(namespace, model, version)._value,
            self.confidence_squared.labels(namespace, model, version)._value,
        )

    # -- events ---------------------------------------------------------------

    def observe_request(self, route: str, method: str, status_code: int, seconds: float) -> None:
        """Count one answered HTTP request and its latency.

        Parameters
        ----------
        route : str
            The route template (:func:`route_template`), never the raw path.
        method : str
            HTTP method; anything outside GET/HEAD/POST/PUT/PATCH/DELETE/OPTIONS is "OTHER".
        status_code : int
            The response status; exported as its class ("2xx").
        seconds : float
            Wall time from receiving the request to sending the response start.
        """
        # Counted with the next requests' (:meth:`fold`), as answers of a few rows are.
        pending = self._pending_requests
        pending.append(((route, method, status_code), seconds))
        if len(pending) >= self._fold_answers or time.monotonic() >= self._fold_by:
            self.fold()

    def _count_requests(self) -> None:
        """What Counter.inc and Histogram.observe do for the requests kept, without their
        checks (the children exist, the amounts are valid), with observe's bucket search
        by bisection, one increment per series, bucket and sum."""
        for key, seconds in drain_by_key(self._pending_requests).items():
            durations = [max(0.0, float(s)) for s in seconds]
            count, bounds, buckets, total = self._request_children(*key)
            count.inc(len(durations))
            for bucket, n in collections.Counter(
                bisect.bisect_left(bounds, s) for s in durations
            ).items():
                buckets[bucket].inc(n)
            total.inc(math.fsum(durations))

    @contextmanager
    def track_in_progress(self) -> Iterator[None]:
        """Count the request in ``welltempered_http_requests_in_progress`` while it runs."""
        self.http_in_progress.inc()
        try:
            yield
        finally:
            self.http_in_progress.dec()

    def observe_predictions(
        self, namespace: str, model: str, version: int | str, entropy, confidence, flipped: int = 0
    ) -> None:
        """Count the rows of one /predict answer and their entropy and confidence, and add
        the sums of their confidence and squared confidence (the expected accuracy's).

        Parameters
        ----------
        namespace : str
            The namespace owning the model (``models.namespace``).
        model : str
            Model name, unique within its namespace only.
        version : int or str
            The calibrator version that served the rows.
        entropy : array-like of shape (n_rows,)
            Entropy of each calibrated row, in nats. Non-finite entries are not observed.
        confidence : array-like of shape (n_rows,)
            Maximum probability of each calibrated row.
        flipped : int, default 0
            Rows whose calibrated argmax differs from the uncalibrated one.
        """
        entropy = np.asarray(entropy).ravel()
        confidence = np.asarray(confidence).ravel()
        if entropy.shape != confidence.shape:
            raise ValueError(
                f"entropy and confidence must have one entry per row. Got {entropy.size} "
                f"and {confidence.size}."
            )
        if isinstance(flipped, bool) or not 0 <= int(flipped) <= entropy.size:
            raise ValueError(f"flipped must be an int in [0, {entropy.size}]. Got {flipped!r}.")
        key = (namespace, model, str(version))
        if entropy.size > _SMALL_BATCH:
            self._count_predictions(key, entropy, confidence, int(flipped))
            return
        # A few rows (a predict of one, every time): counted with the next answers, in
        # one pass of numpy's over all of them (:meth:`fold`). One by one, the counters'
        # locks and the small conversions cost a predict of one row about a tenth of
        # its server time over HTTP (bench/README.md, "Serving through http.client").
        pending = self._pending_predictions
        pending.append((key, (entropy, confidence, int(flipped))))
        if len(pending) >= self._fold_answers or time.monotonic() >= self._fold_by:
            self.fold()

    def fold(self) -> None:
        """Count the requests and the answers of a few rows that :meth:`observe_request` and
        :meth:`observe_predictions` have kept: done when :data:`_FOLD_ANSWERS` of either
        are waiting or the oldest has waited :data:`_FOLD_SECONDS`, and before every
        :meth:`render`, so a scrape of this process sees every request and answer. In
        multiprocess mode nothing waits (another process answers the scrapes, from the
        files). Safe from any thread."""
        self._count_requests()
        groups = drain_by_key(self._pending_predictions)
        self._fold_by = time.monotonic() + _FOLD_SECONDS
        for key, answers in groups.items():
            entropy, confidence, flips = zip(*answers, strict=True)
            self._count_predictions(
                key, np.concatenate(entropy), np.concatenate(confidence), sum(flips)
            )

    def _count_predictions(
        self, key: tuple[str, str, str], entropy: np.ndarray, confidence: np.ndarray, flipped: int
    ) -> None:
        rows, flips, entropies, confidences, total, squared = self._prediction_children(*key)
        # The counters' values directly, as observe_request does: the children exist and
        # the amounts are valid.
        rows.inc(entropy.size)
        if flipped:  # the series exists at 0 from ``labels`` (_prediction_labels)
            flips.inc(flipped)
        _observe_many(entropies, entropy)
        _observe_many(confidences, confidence)
        c = confidence.astype(np.float64)
        total.inc(float(c.sum()))
        squared.inc(float(c @ c))

    def observe_feedback(self, namespace: str, model: str, version: int | str, rows: int) -> None:
        """Count labelled rows received by /feedback for the version that served them.

        Parameters
        ----------
        namespace : str
            The namespace owning the model (``models.namespace``).
        model : str
            Model name, unique within its namespace only.
        version : int or str
            The calibrator version that calibrated the rows.
        rows : int
            Labelled rows received.
        """
        self.feedback_rows.labels(namespace, model, str(version)).inc(int(rows))

    def observe_fit(self, method: str, seconds: float) -> None:
        """Record one finished fit's wall time (call it in the serve process, see above)."""
        self.fit_duration.labels(method).observe(max(0.0, float(seconds)))

    def observe_rate_limited(self, namespace: str) -> None:
        """Count one request refused by the rate limit, under its key's namespace (not the key)."""
        self.rate_limited.labels(namespace).inc()

    def observe_array_cache(self, hits: int, misses: int, evictions: int) -> None:
        """Count what a fit's array reads did in the local read cache: reads a cached
        copy served, reads that downloaded the array, copies removed to make room."""
        self.array_cache_hits.inc(int(hits))
        self.array_cache_misses.inc(int(misses))
        self.array_cache_evictions.inc(int(evictions))

    # -- exposition and worker lifecycle ---------------------------------------

    def render(
        self,
        snapshot: Callable[[], Snapshot] | None = None,
        cache_usage: Callable[[], int] | None = None,
    ) -> tuple[bytes, str]:
        """The body and Content-Type of ``GET /metrics``.

        Builds a fresh registry for this scrape: the metrics of every worker (a
        ``MultiProcessCollector`` over :attr:`multiprocess_dir`) in multiprocess
        mode, this object's registry otherwise, plus a
        :class:`DatabaseQualityCollector` over ``snapshot`` and an
        :class:`ArrayCacheCollector` over ``cache_usage`` when given.

        Parameters
        ----------
        snapshot : callable () -> :data:`Snapshot`, optional
            Reads the database gauges; without it they are not exported.
        cache_usage : callable () -> int, optional
            The bytes in the array read cache
            (:meth:`service.storage.array_cache.ReadCache.usage`); without it
            ``welltempered_array_cache_bytes`` is not exported.

        Returns
        -------
        (bytes, str)
            The Prometheus text exposition (format 0.0.4) and its Content-Type.
        """
        self.fold()
        if self.multiprocess_dir is not None:
            return render_multiprocess(self.multiprocess_dir, snapshot, cache_usage)
        return _exposition(self._registry, snapshot, cache_usage)

    def mark_process_dead(self, pid: int | None = None) -> None:
        """prometheus_client's ``mark_process_dead`` for ``pid`` (default: this process).

        A worker calls it as the last step of its lifespan; a no-op in single-process mode.
        """
        if self.multiprocess_dir is not None:
            multiprocess.mark_process_dead(
                os.getpid() if pid is None else pid, self.multiprocess_dir
            )

    def mark_dead_workers(self) -> list[int]:
        """Mark dead every process whose live-gauge files remain but which no longer runs.

        For workers killed without a clean lifespan shutdown (uvicorn restarts them and
        has no ``child_exit`` hook). Call it when a worker starts; returns the pids.
        """
        if self.multiprocess_dir is None:
            return []
        dead = set()
        pattern = os.path.join(glob.escape(self.multiprocess_dir), "gauge_live*_*.db")
        for name in glob.glob(pattern):
            match = re.fullmatch(r"gauge_live[a-z]+_(\d+)\.db", os.path.basename(name))
            if match and not _pid_alive(int(match.group(1))):
                dead.add(int(match.group(1)))
        for pid in sorted(dead):
            multiprocess.mark_process_dead(pid, self.multiprocess_dir)
        return sorted(dead)


# ---------------------------------------------------------------------------
# exposition and the multiprocess directory


def _exposition(
    source: Collector,
    snapshot: Callable[[], Snapshot] | None,
    cache_usage: Callable[[], int] | None = None,
) -> tuple[bytes, str]:
    """One scrape: a fresh registry with ``source`` and, given their callables, the
    database gauges and the array cache's bytes."""
    registry = CollectorRegistry()
    registry.register(source)
    if snapshot is not None:
        registry.register(DatabaseQualityCollector(snapshot))
    if cache_usage is not None:
        registry.register(ArrayCacheCollector(cache_usage))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def render_multiprocess(
    path: str | os.PathLike,
    snapshot: Callable[[], Snapshot] | None = None,
    cache_usage: Callable[[], int] | None = None,
) -> tuple[bytes, str]:
    """The exposition of the worker files in ``path`` (what a worker serves in
    multiprocess mode; also usable by a sidecar exporter, and by tests)."""
    collector = multiprocess.MultiProcessCollector(None, path=os.fspath(path))
    return _exposition(collector, snapshot, cache_usage)


def prepare_multiprocess_dir(path: str | os.PathLike | None = None) -> str | None:
    """Create the multiprocess directory and delete the ``*.db`` files of a previous run.

    Call it once in the parent, before any worker starts (the documentation's
    "wipe the directory between runs, before start-up"); never while workers run.
    ``path`` defaults to ``$PROMETHEUS_MULTIPROC_DIR``; without either, nothing
    happens and None is returned.
    """
    target = os.fspath(path) if path is not None else os.environ.get(MULTIPROC_ENV)
    if not target:
        return None
    os.makedirs(target, exist_ok=True)
    for name in glob.glob(os.path.join(glob.escape(target), "*.db")):
        os.remove(name)
    return target


def export_multiprocess_dir(default: str | os.PathLike) -> str:
    """For the parent of several workers: prepare the directory and export its name.

    The directory is ``$PROMETHEUS_MULTIPROC_DIR``, or ``default`` (made absolute)
    when unset; it is wiped (:func:`prepare_multiprocess_dir`) and set in
    ``os.environ``, which every worker started afterwards inherits, so each imports
    prometheus_client in multiprocess mode. Call it once, before starting the
    workers; the parent builds no :class:`ServiceMetrics` itself.
    """
    path = os.environ.get(MULTIPROC_ENV) or os.path.abspath(default)
    prepare_multiprocess_dir(path)
    os.environ[MULTIPROC_ENV] = path
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
