"""The registry's operations on the database: each function is one transaction's worth.

Routers call these with a session from :mod:`service.api.deps`; nothing here knows
about HTTP except the :mod:`service.api.problems` it raises.
"""

from __future__ import annotations

import hashlib
import re

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from calibrators import metrics
from calibrators.validation import to_probabilities
from service.api.ingest import Labelled
from service.api.problems import ArgmaxChanged, Conflict, InvalidInput, NotFound, NotReady
from service.api.schemas import ALIAS_PATTERN, NAME_PATTERN, FitRequest, ModelCreate
from service.storage.arrays import ArrayStore
from service.storage.db import Alias, CalibratorVersion, Dataset, Model, utcnow

_NAME = re.compile(NAME_PATTERN)
_ALIAS = re.compile(ALIAS_PATTERN)


def create_model(session: Session, body: ModelCreate, namespace: str) -> Model:
    model = Model(
        namespace=namespace,
        name=body.name,
        num_classes=body.num_classes,
        class_names=body.class_names,
        argmax_policy=body.argmax_policy,
    )
    session.add(model)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"A model named {body.name!r} already exists.") from None
    return model


def dataset_sha256(kind: str, scores_sha: str, labels_sha: str) -> str:
    return hashlib.sha256(f"{kind}\n{scores_sha}\n{labels_sha}".encode()).hexdigest()


def add_dataset(
    session: Session, model: Model, data: Labelled, arrays: ArrayStore
) -> tuple[Dataset, bool]:
    """Store the arrays (files first, fsynced), then commit the row; dedupe by content.

    Returns the dataset and whether it is new.
    """
    scores_sha = arrays.put(data.scores)
    labels_sha = arrays.put(data.labels)
    sha = dataset_sha256(data.kind, scores_sha, labels_sha)
    existing = session.scalar(
        select(Dataset).where(Dataset.model_id == model.id, Dataset.sha256 == sha)
    )
    if existing is not None:
        return existing, False
    report = metrics.report(to_probabilities(data.scores, data.kind), data.labels)
    dataset = Dataset(
        model_id=model.id,
        sha256=sha,
        kind=data.kind,
        n_rows=int(data.scores.shape[0]),
        n_classes=int(data.scores.shape[1]),
        dtype=str(data.scores.dtype),
        scores_sha256=scores_sha,
        labels_sha256=labels_sha,
        metrics=report,
    )
    session.add(dataset)
    try:
        session.commit()
    except IntegrityError:  # the same content, uploaded concurrently
        session.rollback()
        existing = session.scalar(
            select(Dataset).where(Dataset.model_id == model.id, Dataset.sha256 == sha)
        )
        if existing is None:
            raise
        return existing, False
    return dataset, True


def create_version(
    session: Session, model: Model, dataset: Dataset, body: FitRequest
) -> CalibratorVersion:
    """A queued version with the next number of this model (atomic UPDATE ... RETURNING)."""
    number = (
        session.execute(
            update(Model)
            .where(Model.id == model.id)
            .values(next_version=Model.next_version + 1)
            .returning(Model.next_version)
        ).scalar_one()
        - 1
    )
    row = CalibratorVersion(
        model_id=model.id,
        version=number,
        dataset_id=dataset.id,
        method=body.method,
        holdout=body.holdout,
        seed=body.seed,
        options=body.options,
        status="queued",
        progress=0.0,
    )
    session.add(row)
    session.commit()
    return row


def list_versions(session: Session, model: Model) -> list[CalibratorVersion]:
    return list(
        session.scalars(
            select(CalibratorVersion)
            .where(CalibratorVersion.model_id == model.id)
            .order_by(CalibratorVersion.version)
        )
    )


def set_alias(session: Session, model: Model, alias: str, version: CalibratorVersion) -> Alias:
    """Point ``alias`` at ``version``: one INSERT ... ON CONFLICT DO UPDATE, one transaction."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    now = utcnow()
    stmt = insert(Alias).values(
        model_id=model.id, alias=alias, version_id=version.id, updated_at=now
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[Alias.model_id, Alias.alias],
        set_={"version_id": stmt.excluded.version_id, "updated_at": stmt.excluded.updated_at},
    )
    session.execute(stmt)
    session.commit()
    return session.get(Alias, (model.id, alias), populate_existing=True)


def list_aliases(session: Session, model: Model) -> list[tuple[Alias, int]]:
    rows = session.execute(
        select(Alias, CalibratorVersion.version)
        .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
        .where(Alias.model_id == model.id)
        .order_by(Alias.alias)
    )
    return [(a, v) for a, v in rows]


def check_servable(row: CalibratorVersion, model: Model) -> None:
    """409 unless ``row`` may be served: succeeded (a rejected fit carries its argmax report)."""
    if row.status == "rejected":
        raise ArgmaxChanged(
            f"Version {row.version} of {model.name!r} changed the predicted class of "
            f"{(row.argmax or {}).get('changed')} held-out rows; the model's argmax_policy "
            "is 'require', so it cannot be served.",
            argmax=row.argmax,
        )
    if row.status != "succeeded":
        raise NotReady(
            f"Version {row.version} of {model.name!r} is {row.status}; only a succeeded "
            "version can be served.",
            version_status=row.status,
        )


def find_model(session: Session, name: str, namespace: str) -> Model:
    """The model ``name`` of ``namespace``; another namespace's model is exactly as missing."""
    # A name that cannot exist is not looked up (a NUL byte would be a driver error).
    row = (
        session.scalar(select(Model).where(Model.namespace == namespace, Model.name == name))
        if _NAME.match(name)
        else None
    )
    if row is None:
        raise NotFound(f"No model named {name!r}; GET /v1/models lists them.")
    return row


def find_version(session: Session, model: Model, version: int) -> CalibratorVersion:
    row = session.scalar(
        select(CalibratorVersion).where(
            CalibratorVersion.model_id == model.id, CalibratorVersion.version == version
        )
    )
    if row is None:
        raise NotFound(f"Model {model.name!r} has no calibrator version {version}.")
    return row


def resolve_served(
    session: Session, name: str, alias: str | None, version: int | None, namespace: str
) -> tuple[Model, CalibratorVersion]:
    """The version predict serves: ``version`` if given, else ``alias`` (default production)."""
    model = find_model(session, name, namespace)
    if alias is not None and version is not None:
        raise InvalidInput("Give either ?alias= or ?version=, not both.")
    if version is not None:
        row = find_version(session, model, version)
    else:
        alias = alias or "production"
        row = (
            session.scalar(
                select(CalibratorVersion)
                .join(Alias, Alias.version_id == CalibratorVersion.id)
                .where(Alias.model_id == model.id, Alias.alias == alias)
            )
            if _ALIAS.match(alias)
            else None
        )
        if row is None:
            raise NotFound(
                f"Model {model.name!r} has no alias {alias!r}: PUT /v1/models/{model.name}"
                f"/aliases/{alias} with a version first, or pass ?version=N."
            )
    check_servable(row, model)
    return model, row
