"""The prediction path from validated scores on, shared by /v1 predict and /v2 infer:
the row limit, the version's ONNX session, the prediction metrics, the served class
counts and ``top_k``."""

from __future__ import annotations

import numpy as np
from scipy.special import xlogy

from calibrators import topk
from calibrators.numerics import row_chunks
from service.observe.metrics import ServiceMetrics
from service.observe.served import ServedCounts
from service.security import limits
from service.serving import inference
from service.serving.inference import Served


def calibrate(
    served: Served,
    scores: np.ndarray,
    kind: str,
    max_rows: int,
    metrics: ServiceMetrics,
    served_counts: ServedCounts,
    top_k: int | None = None,
) -> dict[str, np.ndarray]:
    """The serving path from validated scores on, shared by /v1 predict and /v2 infer.

    The version's rule of kinds (422 for a kind it does not serve,
    :func:`service.serving.inference.check_input_kind`), the row limit (413), the
    version's ONNX session, the prediction metrics, the predicted classes counted for
    label shift (:class:`service.observe.served.ServedCounts`), and with ``top_k`` the k largest
    probabilities (:func:`service.serving.inference.top_k`).
    Returns the graph's outputs (:data:`~service.serving.inference.OUTPUTS`), plus
    :data:`~service.serving.inference.TOP_K_OUTPUTS` with ``top_k``.
    """
    inference.check_input_kind(
        served.input_kinds, kind, f"Version {served.version} of {served.model!r}"
    )
    limits.check_rows(scores.shape[0], max_rows, "predict")
    if top_k is not None:  # before the work, not after
        inference.check_top_k(top_k, served.num_classes)
    out = inference.run(served.session, inference.as_onnx_input(scores, kind))
    flipped = _flipped(scores, out["label"])
    metrics.observe_predictions(
        served.namespace, served.model, served.version, out["entropy"], out["confidence"], flipped
    )
    served_counts.add(served.version_key, served.num_classes, out["label"])
    if top_k is not None:
        out.update(inference.top_k(out["probabilities"], top_k))
    return out


#: Rows that :func:`_flipped` compares in Python.
_FEW_ROWS = 16


def _flipped(scores: np.ndarray, labels: np.ndarray) -> int:
    """Rows whose calibrated argmax is not the input's (the log of probabilities keeps
    it). A big batch in row chunks: numpy's argmax copies an unaligned array whole, and a
    /v2 binary input is a view of the body at the JSON header's length, any offset."""
    n, k = scores.shape
    if n <= _FEW_ROWS:  # a predict of one row, every time: no numpy reductions
        top = scores.argmax(axis=1).tolist()
        return sum(a != b for a, b in zip(top, labels.tolist(), strict=True))
    if n * k <= inference.RUN_ELEMENTS:
        return int((scores.argmax(axis=1) != labels).sum())
    return sum(
        int((scores[rows].argmax(axis=1) != labels[rows]).sum())
        for rows in row_chunks(n, k, inference.RUN_ELEMENTS)
    )


def calibrate_topk(
    served: Served, rows: topk.TopK, max_rows: int, metrics: ServiceMetrics
) -> dict[str, np.ndarray]:
    """The serving path of a top-k version (``served.topk_k`` set), shared by /v1 and
    /v2: the row limit (413), the width of the rows its graph was built for (422), then
    its ONNX session: ``probabilities`` (N, k), the calibrated top-k in the rows' order,
    and ``tail`` (N,), the mass of the rest (:func:`service.serving.inference.run_topk`).

    The prediction metrics count the rows as for full scores, with the top-1's
    calibrated probability as the confidence and :func:`topk_entropy` as the entropy.
    The served classes (label shift's counts) are not counted: a top-k version has no
    hold-out confusion matrix over its vocabulary and no prior-shift correction
    (docs/api.md, "Top-k log-probabilities")."""
    limits.check_rows(rows.logprobs.shape[0], max_rows, "predict")
    inference.check_topk_width(
        served.topk_k, rows.k, f"Version {served.version} of {served.model!r}"
    )
    out = inference.run_topk(served.session, rows.logprobs)
    top = out["probabilities"].argmax(axis=1)
    confidence = np.take_along_axis(out["probabilities"], top[:, None], axis=1)[:, 0]
    metrics.observe_predictions(
        served.namespace, served.model, served.version,
        topk_entropy(out["probabilities"], out["tail"]), confidence,
        _flipped(rows.logprobs, top),
    )
    return out


def topk_entropy(probabilities: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The entropy in nats of each served top-k row as the k + 1 outcomes it gives: the
    k tokens and the tail as one bucket (N,). A lower bound of the entropy over the
    vocabulary, which the tail's tokens would add to (by at most ``tail * log(V - k)``).

    >>> topk_entropy(np.array([[0.5, 0.25]]), np.array([0.25])).round(4)
    array([1.0397])
    """
    p = np.concatenate([probabilities, tail[:, None]], axis=1).astype(np.float64)
    return -xlogy(p, p).sum(axis=1)
