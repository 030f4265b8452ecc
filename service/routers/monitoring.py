"""Monitoring: labelled feedback, live calibration and drift, reliability diagrams, /metrics.

The numerics live in :mod:`service.monitoring` (per-bin sums, live report, drift)
and :mod:`calibrators`; the metric vocabulary in :mod:`service.observability`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response

from service import inference, ingest, monitoring, store
from service import observability as obs
from service.db import CalibratorVersion
from service.deps import ModelDep, SessionDep, StateDep, VersionDep
from service.openapi import LABELS, SCORE_PROPERTIES
from service.problems import InvalidInput
from service.schemas import MAX_ID
from service.svg import CONTENT_TYPE as SVG
from service.svg import reliability_svg
from service.uploads import read_body, require_json

router = APIRouter(tags=["monitoring"])

_MODEL = "/v1/models/{model}"
_SVG_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {SVG: {}}, "description": "A reliability diagram (SVG)."}
}

WindowQuery = Annotated[
    str | None,
    Query(
        description="How far back: an integer and one unit of s, m, h, d, w (30m, 1h, 7d). "
        "Default: the server's monitoring window (WELLTEMPERED_MONITORING_WINDOW_SECONDS)."
    ),
]
VersionQuery = Annotated[
    int | None,
    Query(ge=1, le=MAX_ID, description="A version number (default: the 'production' alias)."),
]


def window_seconds(window: str | None, state: StateDep) -> int:
    return (
        state.settings.monitoring_window_seconds
        if window is None
        else monitoring.parse_window(window)
    )


# ---------------------------------------------------------------------------
# /metrics


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"}},
)
def metrics(state: StateDep) -> Response:
    """Prometheus text format: this service's events (all workers) and database gauges."""
    settings = state.settings

    def snapshot() -> obs.Snapshot:
        return monitoring.snapshot(
            state.sessions, settings.monitoring_window_seconds, settings.feedback_bucket_seconds
        )

    body, content_type = obs.render_metrics(snapshot)
    return Response(body, headers={"Content-Type": content_type})


# ---------------------------------------------------------------------------
# feedback


async def feedback_body(request: Request, state: StateDep) -> bytes:
    require_json(request)
    return await read_body(request, state.settings.max_json_bytes)


def parse_feedback(body: bytes) -> tuple[dict, str, int | None]:
    """``{"logits" | "probabilities": [[...]], "labels": [...], "version"?: N}``."""
    obj = ingest._json_object(body, {*ingest.JSON_SCORE_KEYS, "labels", "version"})
    key = ingest._score_key(obj, ingest.JSON_SCORE_KEYS)
    if "labels" not in obj:
        raise InvalidInput("The body must hold 'labels', one class index per row.")
    version = obj.get("version")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_ID
    ):
        raise InvalidInput(
            f"version must be an integer in [1, {MAX_ID}] (the version that served the rows). "
            f"Got {version!r}."
        )
    return obj, key, version


_FEEDBACK_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        **SCORE_PROPERTIES,
                        "labels": LABELS,
                        "version": {"type": "integer", "minimum": 1},
                    },
                    "required": ["labels"],
                }
            }
        },
    }
}


@router.post(f"{_MODEL}/feedback", openapi_extra=_FEEDBACK_DOC)
def post_feedback(
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    body: Annotated[bytes, Depends(feedback_body)],
) -> dict[str, Any]:
    """Labels for rows served earlier: calibrated by the version that served them (default:
    the 'production' alias), folded into the time-bucketed reliability statistics."""
    obj, key, version = parse_feedback(body)
    row = monitoring.monitored_version(session, model, version)
    store.check_servable(row, model)
    labelled = ingest.validated(obj[key], obj["labels"], key, model.num_classes, model.name)
    onnx = state.serving.onnx.get(row.id, lambda: row.params)
    out = inference.run(onnx, inference.as_onnx_input(labelled.scores, labelled.kind))
    stats = monitoring.feedback_statistics(out["probabilities"], labelled.labels)
    bucket = monitoring.bucket_start(time.time(), state.settings.feedback_bucket_seconds)
    monitoring.record_feedback(session, row.id, stats, bucket)
    n = int(labelled.labels.shape[0])
    obs.observe_feedback(model.namespace, model.name, row.version, n)
    return {
        "model": model.name,
        "version": row.version,
        "rows": n,
        "correct": int(np.sum(stats["correct_count"])),
        "bucket_start": bucket,
        "bucket_seconds": state.settings.feedback_bucket_seconds,
    }


# ---------------------------------------------------------------------------
# live quality


def _live(session, state: StateDep, row: CalibratorVersion, seconds: int) -> tuple[dict, dict]:
    since = monitoring.window_start(seconds, state.settings.feedback_bucket_seconds)
    stats = monitoring.window_statistics(session, since, [row.id]).get(
        row.id, monitoring.empty_statistics()
    )
    window = {
        "window": monitoring.format_window(seconds),
        "window_seconds": seconds,
        "since": since,
        "bucket_seconds": state.settings.feedback_bucket_seconds,
    }
    return window, stats


@router.get(f"{_MODEL}/monitoring")
def get_monitoring(
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    window: WindowQuery = None,
    version: VersionQuery = None,
) -> dict[str, Any]:
    """Live calibration of a version over a window, its hold-out figures, and the drift
    verdict (``calibrators.drift.detect_drift``: method, bound, p-value)."""
    seconds = window_seconds(window, state)
    row = monitoring.monitored_version(session, model, version)
    monitoring.check_fitted(row, model)
    info, stats = _live(session, state, row, seconds)
    holdout = monitoring.holdout_report(row)
    return {
        "model": model.name,
        "version": row.version,
        **info,
        "live": monitoring.live_report(stats, model.num_classes),
        "holdout": holdout,
        "drift": monitoring.drift_verdict(holdout["bins"], stats),
    }


@router.get(
    f"{_MODEL}/monitoring/reliability.svg", response_class=Response, responses=_SVG_RESPONSES
)
def live_reliability_svg(
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    window: WindowQuery = None,
    version: VersionQuery = None,
) -> Response:
    """Reliability diagram of the live window next to the version's hold-out."""
    seconds = window_seconds(window, state)
    row = monitoring.monitored_version(session, model, version)
    monitoring.check_fitted(row, model)
    info, stats = _live(session, state, row, seconds)
    live = monitoring.live_report(stats, model.num_classes)
    after = row.metrics_after
    label = f"live, last {info['window']} ({live['n']} rows)"
    svg = reliability_svg(
        [
            {"label": "hold-out (at fit time)", "bins": after["bins"], "ece": after["ece"]},
            {"label": label, "bins": live["bins"], "ece": live["ece"]},
        ],
        f"{model.name} v{row.version}: live vs hold-out",
    )
    return Response(svg, media_type=SVG)


@router.get(
    f"{_MODEL}/calibrators/{{version}}/reliability.svg",
    response_class=Response,
    responses=_SVG_RESPONSES,
)
def holdout_reliability_svg(model: ModelDep, version: VersionDep) -> Response:
    """Reliability diagram of the hold-out rows, before vs after calibration."""
    monitoring.check_fitted(version, model)
    before, after = version.metrics_before, version.metrics_after
    method = version.chosen_method or version.method
    svg = reliability_svg(
        [
            {"label": "before (uncalibrated)", "bins": before["bins"], "ece": before["ece"]},
            {"label": f"after ({method})", "bins": after["bins"], "ece": after["ece"]},
        ],
        f"{model.name} v{version.version}: hold-out reliability ({after['n']} rows)",
    )
    return Response(svg, media_type=SVG)
