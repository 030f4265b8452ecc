"""Live calibration from labelled feedback, and the /metrics snapshot.

Feedback rows are never stored. Each ``POST /feedback`` is calibrated by the version
that served it, reduced to per-bin sums over the 15 equal-width confidence bins of
the hold-out ECE (rows, correct rows, confidence, NLL, entropy, Brier: the
sufficient statistics of :func:`calibrators.evaluation.metrics.bin_statistics` plus the means
a report needs), and *added* to one row per (version, time bucket, bin) of
``feedback_bins`` with ``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``.
The increment happens in SQL, so concurrent writers (several workers, several
replicas) never lose an update, and any window is one ``SUM ... GROUP BY bin``.

The live figures of a window are exactly those of :func:`calibrators.evaluation.metrics.report`
on the same calibrated rows for every metric that is a function of per-bin or per-row
sums (``n``, ``accuracy``, ``nll``, ``brier``, ``entropy``, ``ece``, ``mce``, ``bins``,
and the debiased ECE with its interval, ``ece_debiased``, ``ece_debiased_lower``,
``ece_debiased_upper``: it needs each bin's rows, correct rows and confidence sum,
for the bin's gap and the variance of its accuracy); the others need the rows and
are ``None`` (:data:`NOT_FROM_AGGREGATES`). The smooth ECE is one of them: its
kernel needs the outcomes on a grid finer than its bandwidth (spacing under
sigma / 20, so hundreds to thousands of points), not 15 bins, and the window keeps
no such grid; it is reported for the hold-out only.

A window is rounded outward to whole buckets: it covers the buckets that start at
or after ``floor((now - window) / width) * width``, so up to one bucket width more
than asked (the width is ``Settings.feedback_bucket_seconds``, 60 s by default).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from scipy.special import entr
from sqlalchemy.orm import Session, sessionmaker

from calibrators.evaluation import drift, metrics
from calibrators.numerics import row_chunks
from calibrators.validation import PROBABILITY_FLOOR
from service.errors import InvalidInput, NotReady
from service.observe import metrics as obs
from service.observe import token_nll
from service.storage import counts, fits, loops, quality, registry
from service.storage.array_cache import CacheStats
from service.storage.db import CalibratorVersion, FeedbackNllBin, Model, as_utc, utcnow
from service.storage.quality import SUMS
from service.vocabulary import FITTED, LOOP_STATES, STATUSES, format_duration, parse_duration

log = logging.getLogger("welltempered.monitoring")

N_BINS = metrics.DEFAULT_N_BINS
EDGES = metrics.bin_edges(N_BINS)
#: Keys of ``calibrators.evaluation.metrics.report`` that need the rows, not their sums: ``None``
#: in a live report.
NOT_FROM_AGGREGATES = (
    "nll_median",
    "nll_p95",
    "ece_quantile",
    "classwise_ece",
    "smooth_ece",
    "smooth_ece_lower",
    "smooth_ece_upper",
    "smooth_ece_bandwidth",
)
#: Keys of the debiased ECE in a report, from ``estimate``, ``lower``, ``upper``.
DEBIASED_KEYS = {
    "ece_debiased": "estimate",
    "ece_debiased_lower": "lower",
    "ece_debiased_upper": "upper",
}
#: Keys of a version's hold-out report exported with their interval.
HOLDOUT_INTERVALS = (
    *DEBIASED_KEYS,
    "smooth_ece",
    "smooth_ece_lower",
    "smooth_ece_upper",
)
MAX_WINDOW_SECONDS = 366 * 86_400
#: How far a histogram quantile may be from the exact one, relatively, above
#: ``token_nll.SMALLEST`` nats (below it: that many nats).
RELATIVE_ERROR = float(10.0 ** (1.0 / token_nll.BINS_PER_DECADE) - 1.0)
#: The key of the per-row NLL histogram in the statistics of a feedback post
#: (:mod:`service.observe.token_nll`).
NLL_HISTOGRAM = "nll_histogram"


# ---------------------------------------------------------------------------
# windows and buckets


def parse_window(text: str) -> int:
    """``"30m"``, ``"1h"``, ``"7d"`` ... as seconds (:func:`service.vocabulary.parse_duration`,
    at most 366 days).

    >>> parse_window("90m"), parse_window("7d")
    (5400, 604800)
    """
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise InvalidInput(f"window: {exc}") from None
    if seconds > MAX_WINDOW_SECONDS:
        raise InvalidInput(f"window must be at most 366d. Got {text!r}.")
    return seconds


def format_window(seconds: int) -> str:
    """The shortest exact spelling of a window: 3600 -> "1h".

    >>> format_window(3600), format_window(5400), format_window(61)
    ('1h', '90m', '61s')
    """
    return format_duration(seconds)


def bucket_start(timestamp: float, width: int) -> int:
    """Start (Unix seconds) of the bucket of ``width`` seconds holding ``timestamp``."""
    return math.floor(timestamp / width) * width


def window_start(window_seconds: int, width: int, now: float | None = None) -> int:
    """First bucket start inside a window ending ``now`` (rounded outward)."""
    now = time.time() if now is None else now
    return bucket_start(now - window_seconds, width)


# ---------------------------------------------------------------------------
# per-bin statistics of calibrated rows


def feedback_statistics(probs: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Per-bin sums of calibrated, labelled rows: what one feedback adds to a bucket.

    Parameters
    ----------
    probs : ndarray of shape (n_samples, n_classes)
        Calibrated probabilities (validated: finite, rows summing to 1).
    labels : ndarray of shape (n_samples,)
        Integer labels in ``[0, n_classes)``.

    Returns
    -------
    dict
        For each name of :data:`SUMS`, an ndarray of shape (15,): ``count``,
        ``correct_count`` and ``confidence_sum`` are
        :func:`calibrators.evaluation.metrics.bin_statistics` of the top label (confidence = row
        maximum, correct = first argmax equals the label); ``nll_sum`` adds
        ``-log max(p_y, 2**-149)``, ``entropy_sum`` ``-sum p log p`` (nats) and
        ``brier_sum`` ``sum_k (p_k - [y = k])**2`` of the rows in each bin: the same
        per-row quantities as :func:`calibrators.evaluation.metrics.report`.

    Computed a row chunk at a time (:func:`calibrators.numerics.row_chunks`), the
    chunks' sums added (:func:`add_statistics`): float64 copies of one chunk, never of
    the (n, K) probabilities.
    """
    n, k = probs.shape
    return add_statistics(_statistics(probs[rows], labels[rows]) for rows in row_chunks(n, k))


def _statistics(probs: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    confidence = probs.max(axis=1).astype(np.float64)
    correct = probs.argmax(axis=1) == labels
    p = probs.astype(np.float64)
    true_p = p[np.arange(p.shape[0]), labels]
    nll = -np.log(np.maximum(true_p, PROBABILITY_FLOOR))
    entropy = entr(p).sum(axis=1)
    brier = np.einsum("ij,ij->i", p, p) - 2.0 * true_p + 1.0
    return _binned(confidence, correct, nll, entropy, brier)


def _binned(confidence, correct, nll, entropy, brier) -> dict[str, np.ndarray]:
    """The statistics of rows from their per-row quantities (:func:`feedback_statistics`)."""
    stats = metrics.bin_statistics(confidence, correct, N_BINS)
    # The bin of each row, by the rule bin_statistics documents (half-open, last closed).
    index = np.searchsorted(EDGES[1:-1], confidence, side="right")
    return {
        "count": stats["count"].astype(np.int64),
        "correct_count": stats["correct_count"].astype(np.int64),
        "confidence_sum": stats["confidence_sum"],
        "nll_sum": np.bincount(index, weights=nll, minlength=N_BINS),
        "entropy_sum": np.bincount(index, weights=entropy, minlength=N_BINS),
        "brier_sum": np.bincount(index, weights=brier, minlength=N_BINS),
        NLL_HISTOGRAM: token_nll.nll_histogram(nll),
    }


def topk_feedback_statistics(
    probabilities: np.ndarray, tail: np.ndarray, label_column: np.ndarray, nll: np.ndarray
) -> dict[str, np.ndarray]:
    """:func:`feedback_statistics` of calibrated top-k rows: ``probabilities`` (n, k) and
    ``tail`` (n,) as served, ``label_column`` each label's column among the top-k (-1:
    in the tail, ``calibrators.topk.TopK.label_in_top_k``), ``nll`` each row's NLL under
    the version's tail model (``calibrators.topk.nll_rows``, the figure of its hold-out
    report). The outcomes are the k tokens and the tail as one: confidence is the top-1
    token's probability, correct when the label is that token; entropy and Brier score
    are over the k + 1 outcomes (a label in the tail is the tail's outcome)."""
    p = probabilities.astype(np.float64)
    t = tail.astype(np.float64)
    rows = np.arange(p.shape[0])
    top = p.argmax(axis=1)
    true_p = np.where(label_column >= 0, p[rows, np.maximum(label_column, 0)], t)
    brier = np.einsum("ij,ij->i", p, p) + t * t - 2.0 * true_p + 1.0
    return _binned(p[rows, top], top == label_column, nll, entr(p).sum(axis=1) + entr(t), brier)


def add_statistics(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sums of per-bin statistics (of row chunks, of posts): :func:`empty_statistics`
    plus each part."""
    total = empty_statistics()
    for part in parts:
        for name in (*SUMS, NLL_HISTOGRAM):
            total[name] += part[name]
    return total


def record_feedback(
    session: Session, version_id: int, stats: Mapping[str, np.ndarray], bucket: int
) -> None:
    """Add ``stats`` to the (version, bucket) rows: one atomic UPSERT, in bin order
    (:func:`service.storage.quality.add_feedback`). Commits."""
    rows = [
        {
            "version_id": version_id,
            "bucket_start": bucket,
            "bin_index": int(b),
            "count": int(stats["count"][b]),
            "correct_count": int(stats["correct_count"][b]),
            "confidence_sum": float(stats["confidence_sum"][b]),
            "nll_sum": float(stats["nll_sum"][b]),
            "entropy_sum": float(stats["entropy_sum"][b]),
            "brier_sum": float(stats["brier_sum"][b]),
        }
        for b in np.flatnonzero(stats["count"])
    ]
    quality.add_feedback(session, rows)


def empty_statistics() -> dict[str, np.ndarray]:
    return {
        **{
            name: np.zeros(N_BINS, dtype=np.int64 if name.endswith("count") else np.float64)
            for name in SUMS
        },
        NLL_HISTOGRAM: np.zeros(token_nll.N_BINS, dtype=np.int64),
    }


def record_nll_histogram(
    session: Session, version_id: int, stats: Mapping[str, np.ndarray], bucket: int
) -> None:
    """Add ``stats``' per-row NLL histogram to the (version, bucket) rows of
    ``feedback_nll_bins`` (:mod:`service.observe.token_nll`), without committing: in the
    transaction :func:`record_feedback` commits, so a post counts in both or neither."""
    histogram = stats[NLL_HISTOGRAM]
    rows = [(version_id, bucket, int(b), int(histogram[b])) for b in np.flatnonzero(histogram)]
    counts.add_counts(session, FeedbackNllBin, rows, commit=False)


def window_nll_histograms(
    session: Session, since: int, version_ids: Iterable[int] | None = None
) -> dict[int, np.ndarray]:
    """The per-row NLL histogram (:mod:`service.observe.token_nll`) of the feedback in the
    buckets starting at or after ``since``, per version id (versions with rows)."""
    out = {}
    for version_id, found in counts.window_counts(
        session, FeedbackNllBin, since, version_ids
    ).items():
        histogram = np.zeros(token_nll.N_BINS, dtype=np.int64)
        histogram[list(found)] = list(found.values())
        out[version_id] = histogram
    return out


def window_token_nll(
    session: Session, since: int, version_ids: Iterable[int] | None = None
) -> dict[int, list[float | None]]:
    """The :data:`service.observe.token_nll.QUANTILES` of the per-row NLL of the feedback
    in the buckets starting at or after ``since``, per version id (versions with rows)."""
    return {
        version_id: token_nll.quantiles(histogram)
        for version_id, histogram in window_nll_histograms(session, since, version_ids).items()
    }


def live_nll_quantiles(histogram: np.ndarray | None, n: int) -> dict[str, Any]:
    """The median and p95 of the window's per-row NLL from its histogram, with what they
    are good to: ``n`` the rows they describe, None figures without rows.

    Feedback posted before the histogram was kept (migration 0016) is in the window's
    sums but not in its histogram: then ``n`` is below the live report's, and says so."""
    counted = 0 if histogram is None else int(histogram.sum())
    median, p95 = token_nll.quantiles(histogram) if counted else (None, None)
    return {
        "n": counted,
        "complete": counted == n,
        "median": median,
        "p95": p95,
        "relative_error": RELATIVE_ERROR,
        "absolute_error_below": token_nll.SMALLEST,
    }


def window_statistics(
    session: Session, since: int, version_ids: Iterable[int] | None = None
) -> dict[int, dict[str, np.ndarray]]:
    """Per-bin sums over the buckets starting at or after ``since``, per version id
    (without the NLL histogram: :func:`window_token_nll` reads it)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for version_id, bin_index, *sums in quality.window_sums(session, since, version_ids):
        stats = out.setdefault(version_id, empty_statistics())
        for name, value in zip(SUMS, sums, strict=True):
            stats[name][bin_index] = value
    return out


# ---------------------------------------------------------------------------
# reports


def live_report(stats: Mapping[str, np.ndarray], n_classes: int) -> dict[str, Any]:
    """The keys of :func:`calibrators.evaluation.metrics.report`, from per-bin sums.

    Keys in :data:`NOT_FROM_AGGREGATES` are ``None`` (listed under
    ``not_from_aggregates``); with no rows every metric is ``None`` and ``n`` is 0.
    """
    count = np.asarray(stats["count"], dtype=np.int64)
    n = int(count.sum())
    out: dict[str, Any] = {"n": n, "n_classes": int(n_classes)}
    if n == 0:
        out.update(
            dict.fromkeys(("accuracy", "nll", "brier", "entropy", "ece", "mce"), None),
            **dict.fromkeys(DEBIASED_KEYS),
            bins={
                "edges": EDGES.tolist(),
                "count": [0] * N_BINS,
                "mean_confidence": [None] * N_BINS,
                "accuracy": [None] * N_BINS,
            },
        )
    else:
        correct = np.asarray(stats["correct_count"], np.int64)
        calibration = metrics.ece_from_bin_statistics(
            count, stats["confidence_sum"], correct, EDGES
        )
        debiased = metrics.debiased_ece_from_bin_statistics(
            count, stats["confidence_sum"], correct, level=metrics.INTERVAL_LEVEL
        )
        out.update(
            accuracy=float(np.sum(stats["correct_count"]) / n),
            nll=float(np.sum(stats["nll_sum"]) / n),
            brier=float(np.sum(stats["brier_sum"]) / n),
            entropy=float(np.sum(stats["entropy_sum"]) / n),
            ece=calibration["ece"],
            mce=calibration["mce"],
            bins=calibration["bins"],
            **{key: debiased[part] for key, part in DEBIASED_KEYS.items()},
        )
    out.update(
        dict.fromkeys(NOT_FROM_AGGREGATES), n_bins=N_BINS, interval_level=metrics.INTERVAL_LEVEL
    )
    out["not_from_aggregates"] = list(NOT_FROM_AGGREGATES)
    return out


def check_fitted(row: CalibratorVersion, model: Model) -> None:
    """409 unless the version was fitted (it has hold-out metrics to compare with)."""
    if row.status not in FITTED or not row.metrics_after:
        raise NotReady(
            f"Version {row.version} of {model.name!r} is {row.status}: only a fitted version "
            "has hold-out figures to monitor against.",
            version_status=row.status,
        )


def holdout_report(row: CalibratorVersion) -> dict[str, Any]:
    """The calibrated hold-out metrics measured at fit time, with the argmax agreement."""
    return {**row.metrics_after, "argmax_agreement": (row.argmax or {}).get("agreement")}


def holdout_confidence(report: Mapping[str, Any]) -> float | None:
    """Mean top-label confidence of a hold-out report, from its bins' counts and mean
    confidences (None without bins or rows)."""
    bins = report.get("bins") or {}
    count = np.asarray(bins.get("count") or [], dtype=np.float64)
    if count.sum() <= 0:
        return None
    mean = np.array([0.0 if m is None else m for m in bins["mean_confidence"]], np.float64)
    return float(count @ mean / count.sum())


def drift_verdict(holdout_bins: Mapping, stats: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """:func:`calibrators.evaluation.drift.detect_drift` of the live sums against the hold-out
    bins."""
    live = {
        "count": stats["count"],
        "confidence_sum": stats["confidence_sum"],
        "correct_count": stats["correct_count"],
    }
    return drift.detect_drift(holdout_bins, live)


def monitored_version(session: Session, model: Model, version: int | None) -> CalibratorVersion:
    """``version`` of ``model``, or the one its default alias points at (404 if none)."""
    return registry.served_version(session, model, version=version)


# ---------------------------------------------------------------------------
# /metrics: the database gauges


QUANTILES = (0.5, 0.95, 1.0)


def _seconds(later: datetime, earlier: datetime) -> float:
    return max(0.0, (as_utc(later) - as_utc(earlier)).total_seconds())


def _queue_gauges(snap: dict[str, list], rows: list[fits.QueueRow], now: datetime) -> None:
    """The fit queue's gauges of ``rows`` (:func:`service.storage.fits.queue_rows`)."""
    by_namespace: dict[str, list[fits.QueueRow]] = {}
    for row in rows:
        by_namespace.setdefault(row.namespace, []).append(row)
    for namespace, group in sorted(by_namespace.items()):
        queued = [r.created_at for r in group if r.status == "queued"]
        if queued:
            snap["fit_queue_oldest"].append(
                ({"namespace": namespace}, _seconds(now, min(queued, key=as_utc)))
            )
        snap["fit_retries"].append(
            ({"namespace": namespace}, sum(max(0, r.attempts - 1) for r in group))
        )
        done = [r for r in group if r.finished_at is not None and r.started_at is not None]
        took = [r.fit_seconds for r in done if r.fit_seconds is not None]
        waited = [_seconds(r.started_at, r.created_at) for r in done]
        for key, values in (("fit_seconds", took), ("fit_wait_seconds", waited)):
            if values:
                for q, v in zip(QUANTILES, np.quantile(values, QUANTILES), strict=True):
                    snap[key].append(({"namespace": namespace, "quantile": f"{q:g}"}, float(v)))


def snapshot(
    sessions: sessionmaker,
    window_seconds: int,
    bucket_seconds: int,
    stalled_seconds: float = 30.0,
) -> obs.Snapshot:
    """The database gauges of :class:`service.observe.metrics.DatabaseQualityCollector`.

    Fit jobs by status (every status, 0 included), hold-out figures of every aliased
    version, the live figures and drift bound of every version with feedback in the
    window, and the recalibration loop's runs per model and state. A fixed number of
    queries, whatever the number of models. Every model-level sample
    is labelled by the model's namespace as well as its name (names are unique per
    namespace only).
    """
    now = utcnow()
    with sessions() as session:
        jobs = quality.fits_by_status(session)
        queue = fits.queue_rows(session, now - timedelta(seconds=window_seconds))
        alive = quality.fit_workers_alive(session, stalled_seconds)
        aliased = quality.aliased_holdout(session)
        since = window_start(window_seconds, bucket_seconds)
        live = window_statistics(session, since)
        token = window_token_nll(session, since)
        versions = quality.version_labels(session, live)
        runs = loops.outcomes(session)
    snap: dict[str, list] = {key: [] for key in obs.DB_GAUGES}
    namespaces = sorted({namespace for namespace, _ in jobs})
    snap["fit_jobs"] = [
        ({"namespace": ns, "status": s}, jobs.get((ns, s), 0))
        for ns in namespaces
        for s in STATUSES
    ]
    _queue_gauges(snap, queue, now)
    # Every state of a model with runs, at 0 where it has none: the series of a first
    # failure exists before it, so an alert sees it rise (WelltemperedLoopRunFailed).
    counted = {(ns, name, state): n for ns, name, state, n in runs}
    snap["loop_runs"] = [
        ({"namespace": ns, "model": name, "status": state}, counted.get((ns, name, state), 0))
        for ns, name in sorted({(ns, name) for ns, name, _, _ in runs})
        for state in LOOP_STATES
    ]
    if alive is not None:
        snap["fit_workers_alive"] = [({}, alive)]
    snap["live_window_seconds"] = [({}, window_seconds)]
    for namespace, name, version, alias, after, argmax in aliased:
        labels = {"namespace": namespace, "model": name, "version": version, "alias": alias}
        after = after or {}
        snap["holdout_ece"].append((labels, after.get("ece")))
        snap["holdout_nll"].append((labels, after.get("nll")))
        snap["holdout_accuracy"].append((labels, after.get("accuracy")))
        snap["holdout_argmax_agreement"].append((labels, (argmax or {}).get("agreement")))
        snap["holdout_confidence"].append((labels, holdout_confidence(after)))
        snap["holdout_rows"].append((labels, after.get("n")))
        for key in HOLDOUT_INTERVALS:  # absent from versions fitted before they existed
            snap[f"holdout_{key}"].append((labels, after.get(key)))
    for version_id, namespace, name, n_classes, version, after in versions:
        stats = live[version_id]
        report = live_report(stats, n_classes)
        labels = {"namespace": namespace, "model": name, "version": version}
        for key in ("ece", "nll", "accuracy", "entropy", *DEBIASED_KEYS):
            snap[f"live_{key}"].append((labels, report[key]))
        snap["live_labelled_rows"].append((labels, report["n"]))
        for q, value in zip(token_nll.QUANTILES, token.get(version_id, ()), strict=False):
            snap["live_token_nll"].append(({**labels, "quantile": f"{q:g}"}, value))
        if after and after.get("bins"):
            snap["live_ece_bound"].append((labels, drift_verdict(after["bins"], stats)["bound"]))
    return snap


def observe_finished_fit(
    metrics: obs.ServiceMetrics, session_factory: sessionmaker, version_id: int
) -> None:
    """:meth:`~service.observe.metrics.ServiceMetrics.observe_fit` of a job that ended.

    The method and duration are read from the job's row. ``create_app`` hands it to
    the fit runner as its ``on_finished`` callback, so it runs in the serve process
    when the pool's future completes (the fit itself may have run in another
    process, whose metrics nobody scrapes).
    """
    try:
        timed = fits.fit_duration(session_factory, version_id)
    except Exception:
        log.exception("metrics: could not read fit %s to observe its duration", version_id)
        return
    if timed is not None:
        metrics.observe_fit(*timed)


def observe_array_cache(metrics: obs.ServiceMetrics, stats: CacheStats) -> None:
    """:meth:`~service.observe.metrics.ServiceMetrics.observe_array_cache` of what a fit's
    reads did in the read cache: the fit runner's ``on_cache`` callback, called in the
    process that runs the fit runner (the fit itself may have run in a child)."""
    metrics.observe_array_cache(stats.hits, stats.misses, stats.evictions)


# ---------------------------------------------------------------------------
# HTTP metrics: a pure ASGI middleware
