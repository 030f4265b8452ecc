"""Per-namespace quotas: what a namespace holds, and the checks before anything is written.

Five quotas, the same for every namespace (:class:`Quotas`, from the settings):

========================  ==================================  ==============================
quota                     counts                              refused with
========================  ==================================  ==============================
``stored_bytes``          bytes of the .npy files of the      409 ``quota-exceeded``; 413
                          namespace's datasets (each dataset  ``request-over-quota`` for one
                          in full, even if it shares a file)  dataset or import larger than
                          and of its versions' params as      the quota
                          stored JSON, and of the feedback
                          rows its models keep (``n_bytes``
                          columns)
``datasets``              datasets of the namespace           409 ``quota-exceeded``
``models``                models of the namespace             409 ``quota-exceeded``
``versions``              calibrator versions of one model    409 ``quota-exceeded``
``dataset_rows``          rows of one dataset                 413 ``request-over-quota``
========================  ==================================  ==============================

A version's params are counted from its creation when they are posted (an import: the
check refuses what would pass the quota), from its outcome for a fit (their size is
not known before): a fit can take a namespace past ``stored_bytes`` by its own params,
and then no version is created there (fit or import) until something is deleted.

Each refusal names the quota, its setting, its limit, the namespace's usage and what
the request would add (:class:`service.errors.QuotaExceeded`).

Atomicity. The usage is counted from ``models``, ``datasets``,
``calibrator_versions`` and ``feedback_batches`` (no counter to drift). A writer first
takes the namespace's row of ``namespaces`` with an upsert (:func:`lock`): on PostgreSQL
the row lock is held to the end of the transaction, and a waiting writer counts again
after it (READ COMMITTED gives each statement a new snapshot); on SQLite the upsert
takes the database's write lock, so the count that follows sees every committed write
and no other writer can commit before this one. Then count, compare, insert, commit:
two uploads that each fit alone, but not together, cannot both pass. The check is also
made once without the lock, before any array file is written, so a refused upload
usually writes nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.errors import QuotaExceeded, RequestOverQuota
from service.settings import Settings
from service.storage.db import (
    CalibratorVersion,
    Dataset,
    FeedbackBatch,
    Model,
    Namespace,
    utcnow,
)


@dataclass(frozen=True)
class Quotas:
    """The limits of one namespace (every namespace has the same)."""

    stored_bytes: int
    datasets: int
    models: int
    dataset_rows: int
    versions: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Quotas:
        return cls(
            stored_bytes=settings.quota_stored_bytes,
            datasets=settings.quota_datasets,
            models=settings.quota_models,
            dataset_rows=settings.max_dataset_rows,
            versions=settings.quota_versions,
        )


#: The environment variable of each quota, named in every refusal.
SETTINGS = {
    "stored_bytes": "WELLTEMPERED_QUOTA_STORED_BYTES",
    "datasets": "WELLTEMPERED_QUOTA_DATASETS",
    "models": "WELLTEMPERED_QUOTA_MODELS",
    "dataset_rows": "WELLTEMPERED_MAX_DATASET_ROWS",
    "versions": "WELLTEMPERED_QUOTA_VERSIONS",
}


@dataclass(frozen=True)
class Usage:
    """What a namespace holds now."""

    stored_bytes: int
    datasets: int
    models: int


def lock(session: Session, namespace: str) -> None:
    """Take ``namespace``'s quota lock until the transaction ends (the row is created by
    its first lock). Call it before counting; the caller commits or rolls back."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(Namespace).values(namespace=namespace, checked_at=utcnow())
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[Namespace.namespace], set_={"checked_at": stmt.excluded.checked_at}
        )
    )


def usage(session: Session, namespace: str) -> Usage:
    """The namespace's stored bytes (datasets, versions and kept feedback rows), datasets
    and models, counted from the tables."""
    datasets, stored = session.execute(
        select(func.count(Dataset.id), func.coalesce(func.sum(Dataset.n_bytes), 0))
        .join(Model, Model.id == Dataset.model_id)
        .where(Model.namespace == namespace)
    ).one()
    params = session.scalar(
        select(func.coalesce(func.sum(CalibratorVersion.n_bytes), 0))
        .join(Model, Model.id == CalibratorVersion.model_id)
        .where(Model.namespace == namespace)
    )
    kept = session.scalar(
        select(func.coalesce(func.sum(FeedbackBatch.n_bytes), 0))
        .join(Model, Model.id == FeedbackBatch.model_id)
        .where(Model.namespace == namespace)
    )
    models = session.scalar(select(func.count(Model.id)).where(Model.namespace == namespace))
    return Usage(
        stored_bytes=int(stored) + int(params) + int(kept),
        datasets=int(datasets),
        models=int(models),
    )


def _members(quota: str, limit: int, used: int | None, requested: int) -> dict:
    members = {"quota": quota, "setting": SETTINGS[quota], "limit": limit}
    if used is not None:
        members["usage"] = used
    members["requested"] = requested
    return members


def check_dataset_rows(rows: int, limit: int) -> None:
    """413 for a dataset of more than ``limit`` rows (the ``dataset_rows`` quota; the body
    parsers call it as soon as they know the rows, before reading the data)."""
    if rows > limit:
        raise RequestOverQuota(
            f"A dataset holds at most {limit} rows (quota dataset_rows, "
            f"{SETTINGS['dataset_rows']}); split it. Got {rows}.",
            max_rows=limit,
            **_members("dataset_rows", limit, None, rows),
        )


def check_dataset(
    session: Session, namespace: str, rows: int, n_bytes: int, quotas: Quotas
) -> None:
    """Refuse a new dataset of ``rows`` rows and ``n_bytes`` bytes the namespace has no
    room for: 413 if no namespace could hold it (``dataset_rows``, or more bytes than the
    whole ``stored_bytes`` quota), 409 if this one is too full (``datasets``,
    ``stored_bytes``)."""
    check_dataset_rows(rows, quotas.dataset_rows)
    now = usage(session, namespace)
    if n_bytes > quotas.stored_bytes:
        raise RequestOverQuota(
            f"This dataset's arrays take {n_bytes} bytes, more than namespace {namespace!r} "
            f"may store at all ({quotas.stored_bytes} bytes, quota stored_bytes, "
            f"{SETTINGS['stored_bytes']}).",
            **_members("stored_bytes", quotas.stored_bytes, now.stored_bytes, n_bytes),
        )
    if now.datasets + 1 > quotas.datasets:
        raise QuotaExceeded(
            f"Namespace {namespace!r} holds {now.datasets} datasets, its quota (datasets, "
            f"{SETTINGS['datasets']}) is {quotas.datasets}: delete one first.",
            **_members("datasets", quotas.datasets, now.datasets, 1),
        )
    _check_stored(namespace, now, n_bytes, quotas, "this dataset")


def _check_stored(namespace: str, now: Usage, n_bytes: int, quotas: Quotas, what: str) -> None:
    if now.stored_bytes + n_bytes > quotas.stored_bytes:
        raise QuotaExceeded(
            f"Namespace {namespace!r} stores {now.stored_bytes} bytes of arrays and calibrator "
            f"parameters; {what} adds {n_bytes}, past its quota (stored_bytes, "
            f"{SETTINGS['stored_bytes']}) of {quotas.stored_bytes}: delete datasets or "
            "versions first.",
            **_members("stored_bytes", quotas.stored_bytes, now.stored_bytes, n_bytes),
        )


def check_stored(
    session: Session, namespace: str, n_bytes: int, quotas: Quotas, what: str
) -> None:
    """409 unless the namespace has room for ``n_bytes`` more stored bytes (``what``
    adds them: named in the refusal). Kept feedback rows are checked by it."""
    _check_stored(namespace, usage(session, namespace), n_bytes, quotas, what)


def check_model(session: Session, namespace: str, quotas: Quotas) -> None:
    """409 unless the namespace has room for one more model."""
    now = usage(session, namespace)
    if now.models + 1 > quotas.models:
        raise QuotaExceeded(
            f"Namespace {namespace!r} holds {now.models} models, its quota (models, "
            f"{SETTINGS['models']}) is {quotas.models}: delete one first.",
            **_members("models", quotas.models, now.models, 1),
        )


def check_version(session: Session, model: Model, n_bytes: int, quotas: Quotas) -> None:
    """Refuse a new version of ``model`` whose params take ``n_bytes`` (0 for a fit: its
    params are counted at its outcome): 409 when the model holds ``versions`` already or
    the namespace has no room for the bytes (``stored_bytes``), 413 when no namespace
    could hold them."""
    namespace = model.namespace
    held = session.scalar(
        select(func.count(CalibratorVersion.id)).where(CalibratorVersion.model_id == model.id)
    )
    if held + 1 > quotas.versions:
        raise QuotaExceeded(
            f"Model {model.name!r} holds {held} calibrator versions, its quota (versions, "
            f"{SETTINGS['versions']}) is {quotas.versions}: delete one first.",
            **_members("versions", quotas.versions, held, 1),
        )
    now = usage(session, namespace)
    if n_bytes > quotas.stored_bytes:
        raise RequestOverQuota(
            f"These parameters take {n_bytes} bytes, more than namespace {namespace!r} may "
            f"store at all ({quotas.stored_bytes} bytes, quota stored_bytes, "
            f"{SETTINGS['stored_bytes']}).",
            **_members("stored_bytes", quotas.stored_bytes, now.stored_bytes, n_bytes),
        )
    _check_stored(namespace, now, n_bytes, quotas, "this version")
