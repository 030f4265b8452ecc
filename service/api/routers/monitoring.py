"""Monitoring: labelled feedback, live calibration and drift, reliability diagrams, /metrics.

The numerics live in :mod:`service.observe.monitoring` (per-bin sums, live report, drift)
and :mod:`calibrators`; the metric vocabulary in :mod:`service.observe.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response

from calibrators import topk
from service.api.codecs import json_body, npz, rules
from service.api.deps import (
    AppState,
    DtypeQuery,
    KindQuery,
    ModelDep,
    SessionDep,
    StateDep,
    VersionDep,
)
from service.api.idempotent import idempotent
from service.api.openapi import BINARY, LABELS, OCTET_STREAM, SCORE_PROPERTIES
from service.api.schemas import FeedbackOut, MonitoringOut
from service.api.uploads import NPZ_TYPES, Upload, labelled_body
from service.errors import InvalidInput
from service.jobs import loop
from service.observe import label_shift, monitoring
from service.observe import metrics as obs
from service.observe.svg import CONTENT_TYPE as SVG
from service.observe.svg import reliability_svg
from service.security import limits
from service.server import budget
from service.server.budget import declare
from service.serving import inference
from service.storage import loops, registry
from service.storage.db import CalibratorVersion, Model
from service.storage.retry import retry_read
from service.storage.usage import Quotas
from service.vocabulary import DEFAULT_ALIAS, MAX_ID

router = APIRouter(tags=["monitoring"])

_MODEL = "/v1/models/{model}"
_SVG_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {SVG: BINARY, OCTET_STREAM: BINARY},
        "description": "A reliability diagram (SVG); the same bytes as "
        f"{OCTET_STREAM} (a download) when the Accept header asks for that and not for SVG.",
    }
}


def svg_response(svg: str | bytes, request: Request, name: str) -> Response:
    """The diagram as SVG, or as a download when the client accepts octet-stream only."""
    accept = request.headers.get("accept", "")
    if OCTET_STREAM in accept and SVG not in accept and "image/*" not in accept:
        return Response(
            svg,
            media_type=OCTET_STREAM,
            headers={"Content-Disposition": f'attachment; filename="{name}.svg"'},
        )
    return Response(svg, media_type=SVG)


WindowQuery = Annotated[
    str | None,
    Query(
        description="How far back: an integer and one unit of s, m, h, d, w (30m, 1h, 7d). "
        "Default: the server's monitoring window (WELLTEMPERED_MONITORING_WINDOW_SECONDS)."
    ),
]
VersionQuery = Annotated[
    int | None,
    Query(ge=1, le=MAX_ID, description=f"A version number (default: the {DEFAULT_ALIAS!r} alias)."),
]


def window_seconds(state: StateDep, window: WindowQuery = None) -> int:
    """``?window=`` in seconds (422 if malformed), or the server's monitoring window."""
    return (
        state.settings.monitoring_window_seconds
        if window is None
        else monitoring.parse_window(window)
    )


WindowDep = Annotated[int, Depends(window_seconds)]


# ---------------------------------------------------------------------------
# /metrics


@declare(budget.Budget("metrics", answer="max_json_bytes"))
@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"}},
)
def metrics(state: StateDep) -> Response:
    """Prometheus text format: this service's events (all workers) and database gauges."""
    settings = state.settings

    def snapshot() -> obs.Snapshot:
        return {
            **retry_read(
                monitoring.snapshot,
                state.sessions,
                settings.monitoring_window_seconds,
                settings.feedback_bucket_seconds,
                settings.worker_stalled_seconds,
            ),
            **label_shift_snapshot(state),
        }

    body, content_type = state.metrics.render(snapshot, state.arrays.read_cache.usage)
    return Response(body, headers={"Content-Type": content_type})


def label_shift_snapshot(state: AppState) -> obs.Snapshot:
    """The label-shift gauges over the monitoring window
    (:func:`service.observe.label_shift.snapshot`)."""
    settings = state.settings
    return retry_read(
        label_shift.snapshot,
        state.sessions,
        state.arrays,
        state.holdouts,
        inference.version_params,
        settings.monitoring_window_seconds,
        settings.feedback_bucket_seconds,
    )


# ---------------------------------------------------------------------------
# feedback


FeedbackVersionQuery = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_ID,
        description=f"The version that served the rows (default: the {DEFAULT_ALIAS!r} alias). "
        "A JSON body may give it as its 'version' field instead.",
    ),
]


async def feedback_body(
    request: Request, state: StateDep, model: ModelDep
) -> AsyncIterator[Upload]:
    """JSON read into memory, or a .npz spooled to a temp file (removed after the
    response), like a dataset upload; 415 for anything else. After the model is found."""
    bounds = rules.bounds(state.settings, "feedback", model.num_classes, model.name)
    async with labelled_body(
        request,
        json_limit=json_body.json_body_limit(bounds, state.settings.max_json_bytes),
        temp_path=state.arrays.temp_path,
        multipart=False,
        expected=f"Send feedback as application/json or as a .npz body ({', '.join(NPZ_TYPES)}).",
    ) as upload:
        yield upload


FeedbackBodyDep = Annotated[Upload, Depends(feedback_body)]
IdempotentFeedback = idempotent(feedback_body)


def parse_feedback(
    body: bytes | bytearray, bounds: rules.Bounds, kind: str | None
) -> tuple[rules.Labelled, int | None]:
    """``{"logits" | "probabilities": [[...]], "labels": [...], "version"?: N}``."""
    labelled, extra = json_body.labelled_from_json(body, bounds, kind, extra_keys=("version",))
    version = extra.get("version")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_ID
    ):
        raise InvalidInput(
            f"version must be an integer in [1, {MAX_ID}] (the version that served the rows). "
            f"Got {version!r}."
        )
    return labelled, version


def feedback_rows(
    body: Upload, bounds: rules.Bounds, version: int | None, kind: str | None = None
) -> tuple[rules.Labelled | rules.TopKRows, int | None]:
    """The validated rows, and the version that served them: the query's ``version``, or a
    JSON body's own (422 if the two disagree). Labelled top-k rows (the members and keys
    of a top-k dataset; no ``version`` key then) for a top-k version."""
    if body.npz is not None:
        return npz.labelled_from_npz(body.npz, replace(bounds, topk=True), kind), version
    if json_body.is_topk(body.json):
        if kind is not None:
            raise InvalidInput(f"?kind={kind} is for full scores; top-k rows are "
                               "log-probabilities. Drop ?kind.")
        return json_body.topk_from_json(body.json, bounds, labelled=True), version
    labelled, in_body = parse_feedback(body.json, bounds, kind)
    if in_body is not None and version is not None and in_body != version:
        raise InvalidInput(
            f"version {in_body} in the body and version {version} in the query disagree: "
            "give it once."
        )
    return labelled, in_body if in_body is not None else version


_NPZ_MEMBERS = (
    ".npz with one score array (logits | probabilities | predictions) and one label array "
    "(labels | ground_truth), the names a dataset upload accepts."
)
_FEEDBACK_DOC = {
    "requestBody": {
        "required": True,
        "description": "Labelled rows as JSON or as a .npz (binary). Most rows per request: "
        "WELLTEMPERED_MAX_FEEDBACK_ROWS (413 over it).",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        **SCORE_PROPERTIES,
                        "labels": LABELS,
                        "version": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                    },
                    "required": ["labels"],
                }
            },
            # Also accepted, and the same: application/x-npz and application/zip (NPZ_TYPES);
            # the document names the one type every client generator knows.
            OCTET_STREAM: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": f"{_NPZ_MEMBERS} Also accepted as "
                    f"{' or '.join(t for t in NPZ_TYPES if t != OCTET_STREAM)}.",
                }
            },
        },
    }
}


@declare(budget.FEEDBACK)
@router.post(f"{_MODEL}/feedback", response_model=FeedbackOut, openapi_extra=_FEEDBACK_DOC)
def post_feedback(
    model: ModelDep,
    session: SessionDep,
    state: StateDep,
    body: FeedbackBodyDep,
    claim: IdempotentFeedback,
    version: FeedbackVersionQuery = None,
    kind: KindQuery = None,
    dtype: DtypeQuery = None,
) -> dict[str, Any]:
    """Labels for rows served earlier: calibrated by the version that served them (default:
    the default alias), folded into the time-bucketed reliability statistics.

    The body is JSON or a .npz (the arrays a dataset upload accepts); at most
    ``max_feedback_rows`` rows, else 413 and nothing is recorded. With an
    ``Idempotency-Key``, a post is counted once however often it is retried
    (:mod:`service.api.idempotent`)."""
    if claim.replay is not None:
        return claim.replay
    settings = state.settings
    bounds = rules.bounds(settings, "feedback", model.num_classes, model.name, dtype)
    labelled, version = feedback_rows(body, bounds, version, kind)
    n = int(labelled.labels.shape[0])
    limits.check_rows(n, settings.max_feedback_rows, "feedback")
    row = monitoring.monitored_version(session, model, version)
    registry.check_servable(row, model)
    what = f"Version {row.version} of {model.name!r}"
    width = registry.version_top_k(session, row)
    top = isinstance(labelled, rules.TopKRows)
    if width is not None and not top:
        raise rules.topk_needed(what)
    if width is None and top:
        raise rules.full_needed(what)
    onnx = state.serving.onnx.get(inference.version_key(row), lambda: inference.version_params(row))
    if top:
        params = inference.version_params(row)
    else:
        inference.check_input_kind(inference.input_kinds(onnx), labelled.kind, what)
    # The reads are done: end their transaction, so the connection goes back to the
    # pool during the computation and the write below runs on a checked one, briefly.
    session.commit()
    if top:
        stats = topk_statistics(onnx, params, labelled, what)
    else:
        # Calibrated and reduced a row chunk at a time: memory beyond the rows is one chunk's.
        stats = monitoring.add_statistics(
            monitoring.feedback_statistics(out["probabilities"], labelled.labels[rows])
            for rows, out in inference.run_chunks(onnx, labelled.scores, labelled.kind)
        )
    bucket = monitoring.bucket_start(time.time(), settings.feedback_bucket_seconds)
    answer = {
        "model": model.name,
        "version": row.version,
        "rows": n,
        "correct": int(np.sum(stats["correct_count"])),
        "bucket_start": bucket,
        "bucket_seconds": settings.feedback_bucket_seconds,
    }
    # In the transaction record_feedback commits: the answer is stored iff the rows count
    # (and are kept, for a model that keeps them).
    answer["kept"] = 0 if top else keep_feedback(session, state, model, row, labelled)
    claim.store(session, answer)
    monitoring.record_nll_histogram(session, row.id, stats, bucket)
    monitoring.record_feedback(session, row.id, stats, bucket)
    state.metrics.observe_feedback(model.namespace, model.name, row.version, n)
    loop_on_drift(session, state, model, row)
    return answer


def topk_statistics(onnx, params: dict, labelled: rules.TopKRows, what: str) -> dict:
    """The feedback statistics of labelled top-k rows under a top-k version (its graph
    ``onnx``, its ``params``): the rows as it serves them, each row's NLL under its tail
    model (:func:`service.observe.monitoring.topk_feedback_statistics`)."""
    rows, labels = labelled.rows, labelled.labels
    cal = topk.TopKTemperature.from_params(params)
    inference.check_topk_width(cal.k_, rows.k, what)
    out = inference.run_topk(onnx, rows.logprobs)
    nll = topk.nll_rows(rows, labels, cal.beta_, cal.tail)
    return monitoring.topk_feedback_statistics(
        out["probabilities"], out["tail"], rows.label_in_top_k(labels), nll
    )


def keep_feedback(
    session, state: StateDep, model, row: CalibratorVersion, labelled: rules.Labelled
) -> int:
    """The post's rows kept for the recalibration loop (:func:`service.storage.loops.keep`):
    how many (0 unless the model keeps feedback)."""
    return loops.keep(
        session, model, row.version, labelled.scores, labelled.labels, labelled.kind,
        Quotas.from_settings(state.settings),
    )


def loop_on_drift(session, state: StateDep, model, row: CalibratorVersion) -> None:
    """After a recorded post: the drift verdict of the served version's window, and a
    loop run if it drifted and the model asks for one (:func:`service.jobs.loop.after_feedback`)."""
    if not loops.drift_triggers(session, model) or not row.metrics_after:
        return
    _, stats = _live(session, state, row, state.settings.monitoring_window_seconds)
    verdict = monitoring.drift_verdict(row.metrics_after["bins"], stats)
    loop.after_feedback(
        session, model, row, verdict, settings=state.settings, arrays=state.arrays,
        queue=state.fits.queue,
    )


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


def check_labelled(row: CalibratorVersion, model: Model) -> None:
    """422 for a version fitted without labels (an entropy target): it has no hold-out
    calibration (bins, ECE, NLL) to compare live feedback with."""
    if (row.metrics_after or {}).get("label_free"):
        raise InvalidInput(
            f"Version {row.version} of {model.name!r} was fitted without labels (an entropy "
            "target): it has no hold-out calibration figures (reliability bins, ECE, NLL) "
            "to monitor against. Monitor a version fitted on labelled scores."
        )


def get_monitored(
    session: SessionDep, model: ModelDep, version: VersionQuery = None
) -> CalibratorVersion:
    """The version a monitoring route reads: ``?version=`` or the default alias's; 404 if
    missing, 409 unless fitted, 422 if fitted without labels."""
    row = monitoring.monitored_version(session, model, version)
    monitoring.check_fitted(row, model)
    check_labelled(row, model)
    return row


MonitoredDep = Annotated[CalibratorVersion, Depends(get_monitored)]


@declare(budget.READ)
@router.get(f"{_MODEL}/monitoring", response_model=MonitoringOut)
def get_monitoring(
    model: ModelDep,
    seconds: WindowDep,
    row: MonitoredDep,
    session: SessionDep,
    state: StateDep,
) -> dict[str, Any]:
    """Live calibration of a version over a window, its hold-out figures, and the drift
    verdict (``calibrators.evaluation.drift.detect_drift``: method, bound, p-value)."""
    info, stats = _live(session, state, row, seconds)
    holdout = monitoring.holdout_report(row)
    live = monitoring.live_report(stats, model.num_classes)
    histogram = monitoring.window_nll_histograms(session, info["since"], [row.id]).get(row.id)
    return {
        "model": model.name,
        "version": row.version,
        **info,
        "live": live,
        "live_nll": monitoring.live_nll_quantiles(histogram, live["n"]),
        "holdout": holdout,
        "drift": monitoring.drift_verdict(holdout["bins"], stats),
    }


@declare(budget.READ)
@router.get(
    f"{_MODEL}/monitoring/reliability.svg", response_class=Response, responses=_SVG_RESPONSES
)
def live_reliability_svg(
    model: ModelDep,
    seconds: WindowDep,
    row: MonitoredDep,
    session: SessionDep,
    state: StateDep,
    request: Request,
) -> Response:
    """Reliability diagram of the live window next to the version's hold-out."""
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
    return svg_response(svg, request, f"{model.name}-v{row.version}-live")


@declare(budget.READ)
@router.get(
    f"{_MODEL}/calibrators/{{version}}/reliability.svg",
    response_class=Response,
    responses=_SVG_RESPONSES,
)
def holdout_reliability_svg(model: ModelDep, version: VersionDep, request: Request) -> Response:
    """Reliability diagram of the hold-out rows, before vs after calibration."""
    monitoring.check_fitted(version, model)
    check_labelled(version, model)
    before, after = version.metrics_before, version.metrics_after
    method = version.chosen_method or version.method
    svg = reliability_svg(
        [
            {"label": "before (uncalibrated)", "bins": before["bins"], "ece": before["ece"]},
            {"label": f"after ({method})", "bins": after["bins"], "ece": after["ece"]},
        ],
        f"{model.name} v{version.version}: hold-out reliability ({after['n']} rows)",
    )
    return svg_response(svg, request, f"{model.name}-v{version.version}-holdout")
