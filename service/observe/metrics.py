"""Every Prometheus metric of the service, defined in this one module.

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

Two kinds of figures
--------------------
*Events of this process* (requests, served rows, entropy and confidence of
served rows, argmax flips, feedback rows, fit durations, requests refused by
the rate limit) are :class:`~prometheus_client.Counter` /
:class:`~prometheus_client.Histogram` objects incremented by the helpers
:func:`observe_request`, :func:`observe_predictions`, :func:`observe_feedback`,
:func:`observe_fit` and :func:`observe_rate_limited`.

*Shared state* (fit jobs by status, hold-out quality of each aliased
version, live quality over the feedback window) is read from the database *at
scrape time* by :class:`DatabaseQualityCollector`, so every worker and every
replica reports the same value. Aggregate those gauges across replicas with
``max``/``avg``, never ``sum`` (the dashboard and the alert rules do).

Several worker processes: prometheus_client's multiprocess mode
----------------------------------------------------------------
Followed exactly as its documentation prescribes
(https://prometheus.github.io/client_python/multiprocess/):

1. ``PROMETHEUS_MULTIPROC_DIR`` names a directory, set in the environment by
   the start-up script (Dockerfile / compose, or the shell) *before* any
   worker imports ``prometheus_client``: the library picks its value storage
   when it is first imported (``prometheus_client.values.ValueClass``).
   Importing this module raises :class:`MultiprocessModeError` when the two
   disagree (variable set after the import, or removed since), instead of
   silently exporting one worker's share.
2. The directory is wiped between runs, before start-up: the parent calls
   :func:`prepare_multiprocess_dir` once, before starting the workers.
3. Each scrape builds a *fresh* :class:`~prometheus_client.CollectorRegistry`
   holding a :class:`~prometheus_client.multiprocess.MultiProcessCollector`
   (:func:`render_metrics` does it), never the global ``REGISTRY`` (whose
   metrics would be exported twice).
4. When a worker exits, ``mark_process_dead(pid)`` removes its live-gauge
   files. uvicorn has no ``child_exit`` hook (gunicorn's place for it), so a
   worker calls :func:`mark_process_dead` at the end of its lifespan, and
   :func:`mark_dead_workers` at the start of its lifespan (files of workers
   that died without a clean shutdown).
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
serve`` with one worker) the metrics live in the default registry and
:func:`render_metrics` exports it, with the process and GC collectors. The
``_created`` series are disabled so both modes expose the same series.

Work done in other processes (fits run in a process pool) is *not* observed
where it runs: the serve process calls :func:`observe_fit` when the job ends
(the duration is on the job row), so the figure is right in both modes.
"""

from __future__ import annotations

import functools
import glob
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("welltempered.metrics")

__all__ = [
    "DB_GAUGES",
    "LABELS",
    "METRICS",
    "PREFIX",
    "DatabaseQualityCollector",
    "GaugeSpec",
    "MultiprocessModeError",
    "Snapshot",
    "mark_dead_workers",
    "mark_process_dead",
    "multiprocess_dir",
    "observe_feedback",
    "observe_fit",
    "observe_predictions",
    "observe_rate_limited",
    "observe_request",
    "prepare_multiprocess_dir",
    "render_metrics",
    "route_template",
    "status_class",
    "track_in_progress",
]

PREFIX = "welltempered_"
#: The closed set of label names.
LABELS = frozenset({"namespace", "model", "version", "alias", "method", "route", "status"})
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ``route`` of a request no route matched (404s of unknown paths): one series, not one
#: per path a scanner tries.
UNMATCHED_ROUTE = "unmatched"
_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MultiprocessModeError(RuntimeError):
    """``PROMETHEUS_MULTIPROC_DIR`` and prometheus_client's storage disagree."""


def _detect_mode() -> str | None:
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


_MULTIPROC_DIR = _detect_mode()
# _created series exist only in single-process mode; disable them so both modes agree.
prometheus_client.disable_created_metrics()


def multiprocess_dir() -> str | None:
    """The directory this process's metrics are written to, or None (single process)."""
    return _MULTIPROC_DIR


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
# events of this process (counters and histograms; multiprocess-safe)

HTTP_REQUESTS = Counter(
    "welltempered_http_requests_total",
    "HTTP requests answered, by route template, HTTP method and status class.",
    ("route", "method", "status"),
)
HTTP_DURATION = Histogram(
    "welltempered_http_request_duration_seconds",
    "Time from request to response, by route template, HTTP method and status class.",
    ("route", "method", "status"),
    buckets=HTTP_BUCKETS_SECONDS,
)
HTTP_IN_PROGRESS = Gauge(
    "welltempered_http_requests_in_progress",
    "HTTP requests being handled now (summed over the live worker processes).",
    multiprocess_mode="livesum",
)
PREDICTIONS = Counter(
    "welltempered_predictions_total",
    "Rows served by /predict (calibrated probability vectors), by namespace, model and version.",
    ("namespace", "model", "version"),
)
PREDICTION_ENTROPY = Histogram(
    "welltempered_prediction_entropy_nats",
    "Shannon entropy of each served calibrated row, in nats (0 = one-hot, log K = uniform).",
    ("namespace", "model"),
    buckets=ENTROPY_BUCKETS_NATS,
)
PREDICTION_CONFIDENCE = Histogram(
    "welltempered_prediction_confidence_ratio",
    "Confidence (maximum probability) of each served calibrated row.",
    ("namespace", "model"),
    buckets=CONFIDENCE_BUCKETS,
)
ARGMAX_FLIPS = Counter(
    "welltempered_prediction_argmax_flips_total",
    "Served rows whose calibrated argmax differs from the uncalibrated argmax (possible "
    "only under argmax_policy 'warn' or 'off').",
    ("namespace", "model", "version"),
)
FEEDBACK_ROWS = Counter(
    "welltempered_feedback_rows_total",
    "Labelled rows received by /feedback, by namespace, model and the version that served them.",
    ("namespace", "model", "version"),
)
FIT_DURATION = Histogram(
    "welltempered_fit_duration_seconds",
    "Wall time of finished calibrator fits, by requested method.",
    ("method",),
    buckets=FIT_BUCKETS_SECONDS,
)
RATE_LIMITED = Counter(
    "welltempered_rate_limited_requests_total",
    "Requests refused with 429 because their API key was over its rate limit in this "
    "process (WELLTEMPERED_RATE_LIMIT_PER_SECOND), by the key's namespace.",
    ("namespace",),
)


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
            "Calibrator fit jobs in the database, by status (queued, running, succeeded, "
            "rejected, failed).",
            ("status",),
        ),
        "holdout_ece": (
            "welltempered_holdout_ece_ratio",
            "Top-label ECE (15 equal-width bins) of an aliased version on its hold-out rows, "
            "measured at fit time.",
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
        "live_ece_bound": (
            "welltempered_live_ece_bound_ratio",
            "Live ECE above which the drift verdict is 'drift' (calibrators.drift bound); "
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
        "live_window_seconds": (
            "welltempered_live_window_seconds",
            "Length of the window the live_* gauges are computed over.",
            (),
        ),
    }.items()
}
_DATABASE_UP = GaugeSpec(
    "welltempered_database_up",
    "1 when the last scrape read the database gauges, 0 when the database query failed.",
    (),
)

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

            {"fit_jobs": [({"status": "running"}, 1), ({"status": "failed"}, 2)],
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
    >>> c = DatabaseQualityCollector(lambda: {"fit_jobs": [({"status": "queued"}, 2)]})
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


def _catalogue() -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for metric in (
        HTTP_REQUESTS, HTTP_DURATION, HTTP_IN_PROGRESS, PREDICTIONS, PREDICTION_ENTROPY,
        PREDICTION_CONFIDENCE, ARGMAX_FLIPS, FEEDBACK_ROWS, FIT_DURATION, RATE_LIMITED,
    ):  # fmt: skip
        name = metric._name + ("_total" if metric._type == "counter" else "")
        out[name] = (metric._type, tuple(metric._labelnames))
    for spec in (*DB_GAUGES.values(), _DATABASE_UP):
        out[spec.name] = ("gauge", spec.labels)
    return out


#: Every metric name -> (type, label names). Counters are listed with ``_total``.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = _catalogue()


# ---------------------------------------------------------------------------
# helpers the app calls


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


def observe_request(route: str, method: str, status_code: int, seconds: float) -> None:
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
    requests, duration = _request_children(route, _method_label(method), status_class(status_code))
    requests.inc()
    duration.observe(max(0.0, float(seconds)))


# ``metric.labels(...)`` validates and hashes the labels on every call (~2 us each,
# six per predict request); the children of a label set never change (nothing here
# removes series), so they are looked up once. The label sets are closed (route
# templates, namespaces x models x versions), which bounds these caches like the series
# themselves.
@functools.lru_cache(maxsize=4096)
def _request_children(route: str, method: str, status: str) -> tuple:
    return HTTP_REQUESTS.labels(route, method, status), HTTP_DURATION.labels(route, method, status)


@functools.lru_cache(maxsize=4096)
def _prediction_children(namespace: str, model: str, version: str) -> tuple:
    return (
        PREDICTIONS.labels(namespace, model, version),
        ARGMAX_FLIPS.labels(namespace, model, version),
        PREDICTION_ENTROPY.labels(namespace, model),
        PREDICTION_CONFIDENCE.labels(namespace, model),
    )


@contextmanager
def track_in_progress() -> Iterator[None]:
    """Count the request in ``welltempered_http_requests_in_progress`` while it runs."""
    HTTP_IN_PROGRESS.inc()
    try:
        yield
    finally:
        HTTP_IN_PROGRESS.dec()


#: Up to this many values, :func:`_observe_many` calls ``observe`` per value (measured:
#: 2 us against 17 us for one value, break-even near 16).
_SMALL_BATCH = 16


def _observe_many(child, values: np.ndarray) -> None:
    """``child.observe(v)`` for every finite ``v``, with one increment per bucket.

    prometheus_client has no batch API; a Python loop costs two mmap writes per row
    in multiprocess mode. Its histogram keeps non-cumulative bucket counters
    (``_buckets``, one per ``_upper_bounds`` entry, the last +Inf) and ``_sum``, and
    ``observe`` puts ``v`` in the first bucket with ``v <= bound``: that is
    ``searchsorted(bounds, v, side="left")``. tests/service/test_observability.py
    checks the result equals per-row ``observe``.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size <= _SMALL_BATCH:  # a few rows: per-row observe costs less than the numpy calls
        for x in v.tolist():
            if math.isfinite(x):
                child.observe(x)
        return
    v = v[np.isfinite(v)]
    if v.size == 0:
        return
    bounds = np.asarray(child._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, v, side="left"), minlength=bounds.size)
    for i in np.flatnonzero(counts):
        child._buckets[i].inc(float(counts[i]))
    child._sum.inc(float(v.sum()))


def observe_predictions(
    namespace: str, model: str, version: int | str, entropy, confidence, flipped: int = 0
) -> None:
    """Count the rows of one /predict answer and their entropy and confidence.

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
    rows, flips, entropies, confidences = _prediction_children(namespace, model, str(version))
    rows.inc(entropy.size)
    flips.inc(int(flipped))  # creates the series at 0 too
    _observe_many(entropies, entropy)
    _observe_many(confidences, confidence)


def observe_feedback(namespace: str, model: str, version: int | str, rows: int) -> None:
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
    FEEDBACK_ROWS.labels(namespace, model, str(version)).inc(int(rows))


def observe_fit(method: str, seconds: float) -> None:
    """Record one finished fit's wall time (call it in the serve process, see above)."""
    FIT_DURATION.labels(method).observe(max(0.0, float(seconds)))


def observe_rate_limited(namespace: str) -> None:
    """Count one request refused by the rate limit, under its key's namespace (not the key)."""
    RATE_LIMITED.labels(namespace).inc()


# ---------------------------------------------------------------------------
# exposition and worker lifecycle


class _ProcessRegistry:
    """The default registry as a collector (single-process mode only)."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


def render_metrics(
    snapshot: Callable[[], Snapshot] | None = None, *, multiprocess_path: str | None = None
) -> tuple[bytes, str]:
    """The body and Content-Type of ``GET /metrics``.

    Builds a fresh registry for this scrape: the metrics of every worker (a
    ``MultiProcessCollector`` over :func:`multiprocess_dir`) in multiprocess mode,
    the default registry otherwise, plus a :class:`DatabaseQualityCollector` over
    ``snapshot`` when given.

    Parameters
    ----------
    snapshot : callable () -> :data:`Snapshot`, optional
        Reads the database gauges; without it they are not exported.
    multiprocess_path : str, optional
        Read the worker files of this directory instead of this process's mode
        (a sidecar exporter, tests).

    Returns
    -------
    (bytes, str)
        The Prometheus text exposition (format 0.0.4) and its Content-Type.
    """
    registry = CollectorRegistry()
    path = multiprocess_path or _MULTIPROC_DIR
    if path is not None:
        multiprocess.MultiProcessCollector(registry, path=path)
    else:
        registry.register(_ProcessRegistry())
    if snapshot is not None:
        registry.register(DatabaseQualityCollector(snapshot))
    return generate_latest(registry), CONTENT_TYPE_LATEST


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


def mark_process_dead(pid: int | None = None) -> None:
    """prometheus_client's ``mark_process_dead`` for ``pid`` (default: this process).

    A worker calls it as the last step of its lifespan; a no-op in single-process mode.
    """
    if _MULTIPROC_DIR is not None:
        multiprocess.mark_process_dead(os.getpid() if pid is None else pid, _MULTIPROC_DIR)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mark_dead_workers() -> list[int]:
    """Mark dead every process whose live-gauge files remain but which no longer runs.

    For workers killed without a clean lifespan shutdown (uvicorn restarts them and
    has no ``child_exit`` hook). Call it when a worker starts; returns the pids.
    """
    if _MULTIPROC_DIR is None:
        return []
    dead = set()
    for name in glob.glob(os.path.join(glob.escape(_MULTIPROC_DIR), "gauge_live*_*.db")):
        match = re.fullmatch(r"gauge_live[a-z]+_(\d+)\.db", os.path.basename(name))
        if match and not _pid_alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in sorted(dead):
        multiprocess.mark_process_dead(pid, _MULTIPROC_DIR)
    return sorted(dead)
