"""Typed dependencies: what a handler needs, resolved (or 404ed) before it runs.

``SessionDep`` is a database session; ``ModelDep``, ``DatasetDep``,
``VersionDep`` and ``AliasDep`` are the looked-up rows, each one validating
dependency reused by every route that names the object in its path; ``QuotasDep``
the namespace quotas of the settings (:mod:`service.storage.usage`). The lookups
themselves (and their 404s) are :mod:`service.storage.registry`'s, also used
where a body names the object (a fit's dataset, an alias's version).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import Depends, Path, Query, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.api.auth import PrincipalDep
from service.api.schemas import Kind, ScoreDtype
from service.jobs.dataset_metrics import MetricsFiller
from service.jobs.queue import Fits
from service.observe.label_shift import HoldoutCache
from service.observe.metrics import ServiceMetrics
from service.observe.served import ServedCounts
from service.serving.inference import ServingCache
from service.settings import Settings
from service.storage import registry, retry
from service.storage.arrays import ArrayStore
from service.storage.db import Alias, CalibratorVersion, Dataset, Model
from service.storage.usage import Quotas
from service.vocabulary import MAX_ID

#: ``?kind=`` of the routes that take scores in a body: the kind said explicitly. It
#: must match the body's own name for the scores (a JSON key, a .npz array); only with
#: it are logits whose every row looks like a probability distribution accepted.
KindQuery = Annotated[
    Kind | None,
    Query(
        description="What the scores are, said explicitly (default: the body's key or array "
        "name). Must match the body; needed to send logits whose every row is a probability "
        "distribution."
    ),
]

#: ``?dtype=`` of the routes that take scores in a binary body (service.api.codecs).
DtypeQuery = Annotated[
    ScoreDtype | None,
    Query(
        description="How the score array of a .npy/.npz body is read when numpy has no "
        "dtype for it: bfloat16 sends the raw 16-bit patterns as a little-endian 2-byte "
        "array (<u2, <i2, or |V2 as np.save writes ml_dtypes.bfloat16); widened to float32 "
        "exactly. float16/32/64 need none. Not for JSON bodies."
    ),
]


@dataclass
class AppState:
    """Everything the lifespan builds; one per app, reached through ``StateDep``."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    arrays: ArrayStore
    fits: Fits
    serving: ServingCache
    metrics: ServiceMetrics
    #: Threads that compute predictions at once (``Settings.predict_threads``).
    predict_limiter: anyio.CapacityLimiter
    #: The predicted classes this process served, until its flusher writes them.
    served_counts: ServedCounts
    #: The hold-out rows' predicted and true classes of each version label shift read.
    holdouts: HoldoutCache
    #: Computes big datasets' metrics after their upload's answer (None: not started).
    dataset_metrics: MetricsFiller | None = None


def get_app_state(request: Request) -> AppState:
    return request.app.state.welltempered


async def get_state(request: Request) -> AppState:  # async: no thread hop for a lookup
    return get_app_state(request)


StateDep = Annotated[AppState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    """The request's session; its end never raises (:func:`retry.end_session`): it may
    run after the answer has started."""
    session = state.sessions()
    try:
        yield session
    finally:
        retry.end_session(session)


SessionDep = Annotated[Session, Depends(get_session)]


async def get_quotas(state: StateDep) -> Quotas:
    return Quotas.from_settings(state.settings)


QuotasDep = Annotated[Quotas, Depends(get_quotas)]


def get_model(
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str, Path(description="The model's name.")],
) -> Model:
    """The caller's namespace's model: another namespace's is a 404 like a missing one.

    The lookup's transaction ends here (it took no lock), so the connection goes back
    to the pool while the route reads its body: an upload may stream for minutes, and
    15 slow ones must not hold the whole pool. The session takes a connection again,
    checked, at its next query."""
    row = registry.find_model(session, model, principal.namespace)
    session.commit()
    return row


ModelDep = Annotated[Model, Depends(get_model)]


def get_dataset(
    session: SessionDep, model: ModelDep, dataset_id: Annotated[int, Path(ge=1, le=MAX_ID)]
) -> Dataset:
    return registry.find_dataset(session, model, dataset_id)


DatasetDep = Annotated[Dataset, Depends(get_dataset)]


def get_version(
    session: SessionDep, model: ModelDep, version: Annotated[int, Path(ge=1, le=MAX_ID)]
) -> CalibratorVersion:
    return registry.find_version(session, model, version)


VersionDep = Annotated[CalibratorVersion, Depends(get_version)]


def get_alias(
    session: SessionDep, model: ModelDep, alias: str
) -> tuple[Alias, CalibratorVersion]:
    """The alias and the version it points at."""
    return registry.find_alias(session, model, alias)


AliasDep = Annotated[tuple[Alias, CalibratorVersion], Depends(get_alias)]
