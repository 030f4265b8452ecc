"""Label shift: the production class priors of a version's served rows over a window,
and, on request, a prior-corrected version to evaluate (never promoted by itself).

The numerics are :mod:`service.observe.label_shift`'s; the counts
:mod:`service.observe.served`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy.orm import Session

from service.api.deps import AppState, ModelDep, SessionDep, StateDep
from service.api.idempotent import IdempotentJson
from service.api.routers.calibrators import enqueue_import
from service.api.routers.monitoring import MonitoredDep, WindowDep
from service.api.schemas import FitAccepted, LabelShiftOut
from service.errors import Conflict, InvalidInput
from service.observe import label_shift, monitoring
from service.server import budget
from service.server.budget import declare
from service.serving.inference import version_key, version_params
from service.storage import counts, registry
from service.storage.db import CalibratorVersion, Dataset, Model, ServedClass

router = APIRouter(tags=["monitoring"])

_PATH = "/v1/models/{model}/label-shift"


def served_shift(
    session: Session, state: AppState, row: CalibratorVersion, seconds: int
) -> dict[str, Any]:
    """The window, and :func:`service.observe.label_shift.estimate` of ``row``'s served
    counts in it against its hold-out confusion matrix (computed once per process)."""
    if registry.version_top_k(session, row) is not None:
        raise InvalidInput(
            f"Version {row.version} serves top-k rows: label shift is not estimated for "
            "top-k versions (their served classes are not counted, and a prior-shift "
            "correction needs full (N, K) scores)."
        )
    width = state.settings.feedback_bucket_seconds
    since = monitoring.window_start(seconds, width)
    served = counts.window_counts(session, ServedClass, since, [row.id]).get(row.id, {})
    dataset = session.get(Dataset, row.dataset_id)
    # The reads are done: end their transaction, so the connection goes back to the pool
    # while the hold-out is calibrated (the first time) and the estimate computed.
    session.commit()
    pairs = state.holdouts.get(
        version_key(row),
        lambda: label_shift.holdout_pairs(state.arrays, dataset, row, version_params(row)),
    )
    return {
        "window": monitoring.format_window(seconds),
        "window_seconds": seconds,
        "since": since,
        "bucket_seconds": width,
        **label_shift.estimate(pairs, served, dataset.n_classes),
    }


@declare(budget.READ_LARGE)
@router.get(_PATH, response_model=LabelShiftOut)
def get_label_shift(
    model: ModelDep, seconds: WindowDep, row: MonitoredDep, session: SessionDep, state: StateDep
) -> dict[str, Any]:
    """The class priors of the rows the version served in the window, estimated from their
    predicted-class counts and the version's hold-out confusion matrix (black-box shift
    estimation), with a 95 % interval per class and the chi-square verdict of the counts
    against the hold-out's. The version's hold-out confusion matrix is computed at the
    first call of a process (a pass of the calibrator over its hold-out rows), then kept."""
    return {
        "model": model.name,
        "version": row.version,
        **served_shift(session, state, row, seconds),
    }


@declare(budget.Budget("write"))
@router.post(_PATH, status_code=202, response_model=FitAccepted)
def propose_correction(
    model: ModelDep,
    seconds: WindowDep,
    row: MonitoredDep,
    session: SessionDep,
    state: StateDep,
    response: Response,
    claim: IdempotentJson,
) -> FitAccepted:
    """Queue a prior-shift version: the version's calibrator with the window's estimated
    weights (p'(y|x) ∝ p(y|x) w_y), evaluated on the version's hold-out resampled to the
    estimated priors and policed like any version (the argmax policy applies: it can change
    predictions). It is only proposed: no alias moves. 409 when the window gives no
    estimate."""
    if claim.replay is not None:
        return claim.replay
    found = served_shift(session, state, row, seconds)
    proposal = _proposal(model, row, found)
    dataset = session.get(Dataset, row.dataset_id)
    return enqueue_import(
        model, dataset, session, state, response, claim, proposal, row.holdout, row.seed
    )


def _proposal(model: Model, row: CalibratorVersion, found: dict[str, Any]) -> dict[str, Any]:
    if found["estimate"] is None:
        raise Conflict(
            f"No label-shift estimate for version {row.version} of {model.name!r} over the "
            f"last {found['window']}: {found['unidentified']}"
        )
    weights = label_shift.class_weights(
        found["classes"], found["estimate"]["weights"], model.num_classes
    )
    return label_shift.corrected_params(version_params(row), weights)
