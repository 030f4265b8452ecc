"""Label shift of a served version over a window, from counts only.

Under label shift the class frequencies of production change while each class looks
the same. The served predicted-class counts of a window
(:mod:`service.observe.served`) and the version's hold-out confusion matrix of
predicted against true class identify the new class priors: black-box shift
estimation (:func:`calibrators.evaluation.shift.bbse`), with its delta-method
interval, and :func:`~calibrators.evaluation.shift.shift_test`'s chi-square verdict
of the served counts against the hold-out's predicted counts.

Why BBSE rather than EM on the calibrated probabilities (Saerens et al. 2002): EM's
E-step reweights every row's probabilities, so it needs the served rows, which the
service never keeps; BBSE needs counts that add up across processes and replicas. It
also relies less on calibration: the confusion matrix is measured, not assumed from
the probabilities (EM reads any miscalibration as a shift).

The confusion matrix is the version's own: its calibrated argmax against the labels
on the hold-out rows of its dataset (the split of its fit: holdout, seed and sequence
ids). Each process computes the predicted and true class of those rows once per
version (:class:`HoldoutCache`; versions are immutable) and counts a matrix from them
for each estimate, so memory is O(rows) whatever K. Above
:data:`~service.observe.served.EXACT_CLASSES` classes the served counts keep the most
served classes and an ``other`` bucket, and the estimate is made on those classes plus
``other`` (:func:`coarsen`): the confusion matrix counts every other class as
``other`` on both axes, and every class in ``other`` gets that group's weight (the
shift inside the group is assumed proportional).

The proposed correction is a ``prior-shift`` version over the served version's
calibrator (``p'(y|x) ∝ p(y|x) w_y``, :class:`calibrators.PriorShift`) with BBSE's
add-one smoothed weights. A served version that is itself a prior-shift version is
corrected from its base: the weights are relative to the hold-out's class priors
whichever calibrator predicted the counts.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from sqlalchemy.orm import sessionmaker

import calibrators
from calibrators import CalibrationInputError
from calibrators.evaluation import shift
from calibrators.evaluation.holdout import split_indices
from calibrators.methods.prior_shift import PriorShift
from calibrators.numerics import row_chunks
from service.observe.monitoring import window_start
from service.observe.served import EXACT_CLASSES, OTHER
from service.storage import counts, registry
from service.storage.arrays import ArrayStore
from service.storage.db import CalibratorVersion, Dataset, ServedClass

log = logging.getLogger("welltempered.monitoring")


def holdout_pairs(
    arrays: ArrayStore, dataset: Dataset, row: CalibratorVersion, params: Mapping[str, Any]
) -> np.ndarray:
    """The predicted and the true class of each of the version's hold-out rows: int64 of
    shape (2, m), the first row the calibrated first argmax. Every confusion matrix of
    :func:`coarsen` is counted from them, in O(m) memory whatever K (a K x K matrix
    would not fit at a language model's K).

    The hold-out is the one of its fit (:func:`calibrators.evaluation.holdout.split_indices`
    of the dataset's rows with the version's holdout, seed and sequence ids); its rows are
    calibrated by ``params`` (the version's, with their kind) a row chunk at a time.
    """
    labels = arrays.load(dataset.labels_sha256)
    scores = arrays.load(dataset.scores_sha256)
    groups = registry.dataset_sequences(arrays, dataset)
    _, hold = split_indices(labels.shape[0], row.holdout, row.seed, groups=groups)
    cal = calibrators.from_params(dict(params))
    pairs = np.empty((2, hold.size), dtype=np.int64)
    pairs[1] = labels[hold]
    for rows in row_chunks(hold.size, scores.shape[1]):
        x = np.asarray(scores[hold[rows]])
        pairs[0, rows] = cal.predict_proba(x, kind=dataset.kind).argmax(axis=1)
    return pairs


class HoldoutCache:
    """:func:`holdout_pairs` per version key (a version is immutable), the most recently
    used ``size`` kept; one computation at a time."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, compute: Callable[[], np.ndarray]) -> np.ndarray:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
            value = compute()  # under the lock: a scrape and a request do it once
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return value


def coarsen(
    pairs: np.ndarray, served: Mapping[int, int], k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The classes the estimate is made on, and over them the hold-out's confusion
    matrix (counts per (predicted, true) class) and the served counts.

    Up to :data:`EXACT_CLASSES` classes, every class. Above, the :data:`EXACT_CLASSES`
    most served classes (ties by index) and ``other`` (:data:`OTHER`, last): the
    confusion matrix counts every class outside them as ``other``, on both axes.

    >>> pairs = np.array([[0, 0, 1, 2, 2], [0, 1, 1, 2, 2]])
    >>> classes, c, n = coarsen(pairs, {0: 4, 2: 1}, 3)
    >>> classes.tolist(), c.tolist(), n.tolist()
    ([0, 1, 2], [[1, 1, 0], [0, 1, 0], [0, 0, 2]], [4, 0, 1])
    """
    if k <= EXACT_CLASSES:
        classes = np.arange(k)
        group = classes
    else:
        known = sorted(((-n, c) for c, n in served.items() if c != OTHER))[:EXACT_CLASSES]
        tracked = np.array(sorted(c for _, c in known), dtype=np.int64)
        group = np.full(k, tracked.size, dtype=np.int64)
        group[tracked] = np.arange(tracked.size)
        classes = np.append(tracked, OTHER)
    size = classes.size
    joint = np.bincount(group[pairs[0]] * size + group[pairs[1]], minlength=size * size)
    counts = np.zeros(size, dtype=np.int64)
    for c, n in served.items():
        counts[size - 1 if c == OTHER else group[c]] += n
    return classes, joint.reshape(size, size), counts


def estimate(pairs: np.ndarray, served: Mapping[int, int], k: int) -> dict[str, Any]:
    """The label-shift answer of a window: the verdict, and the BBSE estimate when the
    hold-out identifies it.

    Returns
    -------
    dict
        ``classes`` (the class indices estimated, :data:`OTHER` for the ``other``
        group), ``served_rows``, ``holdout_rows``, ``verdict``
        (:func:`~calibrators.evaluation.shift.shift_test`), and ``estimate``: None
        (with ``unidentified`` saying why) when nothing was served or the confusion
        matrix is singular, else BBSE's ``priors``, ``lower``, ``upper``, ``std``,
        ``source_priors``, ``weights`` and ``level``, and ``prior_l1_distance``
        (:math:`\\sum_j |\\hat q_j - p_j|`, 0 without shift, at most 2).
    """
    classes, joint, counts = coarsen(pairs, served, k)
    out: dict[str, Any] = {
        "classes": classes.tolist(),
        "served_rows": int(counts.sum()),
        "holdout_rows": int(joint.sum()),
        "verdict": shift.shift_test(joint.sum(axis=1), counts),
        "estimate": None,
        "unidentified": None,
    }
    try:
        found = shift.bbse(joint, counts)
    except CalibrationInputError as exc:
        out["unidentified"] = str(exc)
        return out
    found["prior_l1_distance"] = shift.prior_l1_error(found["priors"], found["source_priors"])
    out["estimate"] = found
    return out


def class_weights(classes: list[int], weights: list[float], k: int) -> np.ndarray:
    """Weights over all ``k`` classes from those of :func:`estimate`: each estimated
    class its own, every class of the ``other`` group the group's."""
    full = np.ones(k)
    for c, w in zip(classes, weights, strict=True):
        if c == OTHER:
            rest = np.ones(k, dtype=bool)
            rest[[i for i in classes if i != OTHER]] = False
            full[rest] = w
        else:
            full[c] = w
    return full


def corrected_params(params: Mapping[str, Any], weights: np.ndarray) -> dict[str, Any]:
    """The params of the prior-shift version over a served version's ``params``: its
    calibrator (its base, when it is a prior-shift version itself) plus ``log w``."""
    cal = calibrators.from_params(dict(params))
    base = cal.base_ if isinstance(cal, PriorShift) else cal
    return PriorShift.from_base(base, weights).to_params()


def snapshot(
    sessions: sessionmaker,
    arrays: ArrayStore,
    holdouts: HoldoutCache,
    params_of: Callable[[CalibratorVersion], Mapping[str, Any]],
    window_seconds: int,
    bucket_seconds: int,
) -> dict[str, list]:
    """The label-shift gauges of :class:`service.observe.metrics.DatabaseQualityCollector`
    for every version that served rows in the window: the served rows, the L1 distance
    of the estimated priors from the hold-out's (none when unidentified) and the
    verdict's p-value (none under its minimum of rows). ``params_of`` gives a version's
    params with their kind. A version whose estimate fails (its dataset's arrays
    missing...) is logged and left out; the others are still exported."""
    snap: dict[str, list] = {
        "label_shift_served_rows": [],
        "label_shift_prior_l1": [],
        "label_shift_p_value": [],
    }
    with sessions() as session:
        served = counts.window_counts(
            session, ServedClass, window_start(window_seconds, bucket_seconds)
        )
        versions = counts.versions_with_datasets(session, served) if served else []
    for row, model, dataset in versions:
        labels = {"namespace": model.namespace, "model": model.name, "version": row.version}
        try:
            compute = functools.partial(holdout_pairs, arrays, dataset, row, params_of(row))
            pairs = holdouts.get((row.id, row.created_at), compute)
            found = estimate(pairs, served[row.id], model.num_classes)
        except Exception:
            log.exception("metrics: no label-shift estimate for version id %s", row.id)
            continue
        snap["label_shift_served_rows"].append((labels, found["served_rows"]))
        l1 = None if found["estimate"] is None else found["estimate"]["prior_l1_distance"]
        snap["label_shift_prior_l1"].append((labels, l1))
        snap["label_shift_p_value"].append((labels, found["verdict"]["p_value"]))
    return snap
