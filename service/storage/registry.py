"""The model registry's queries: models, datasets, calibrator versions and aliases.

Each function that writes is one transaction (it commits); each lookup by name
or number raises :class:`service.errors.NotFound` when the row is missing, so
the API turns it into a 404 without a check of its own. A name that cannot
exist (it fails the pattern of :mod:`service.vocabulary`) is not looked up: a
NUL byte would be a driver error, not a 404.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from calibrators import metrics
from calibrators.validation import to_probabilities
from service.errors import ArgmaxChanged, Conflict, InvalidInput, NotFound, NotReady
from service.storage.arrays import ArrayStore
from service.storage.db import Alias, CalibratorVersion, Dataset, Model, utcnow
from service.vocabulary import ALIAS_PATTERN, DEFAULT_ALIAS, NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)
_ALIAS = re.compile(ALIAS_PATTERN)


# ---------------------------------------------------------------------------
# models


def create_model(
    session: Session,
    namespace: str,
    name: str,
    num_classes: int,
    class_names: list[str] | None,
    argmax_policy: str,
) -> Model:
    """A new model of ``namespace``; 409 if the namespace has one of that name."""
    model = Model(
        namespace=namespace,
        name=name,
        num_classes=num_classes,
        class_names=class_names,
        argmax_policy=argmax_policy,
    )
    session.add(model)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"A model named {name!r} already exists.") from None
    return model


def list_models(session: Session, namespace: str) -> list[Model]:
    return list(
        session.scalars(select(Model).where(Model.namespace == namespace).order_by(Model.name))
    )


def find_model(session: Session, name: str, namespace: str) -> Model:
    """The model ``name`` of ``namespace``; another namespace's model is exactly as missing."""
    row = (
        session.scalar(select(Model).where(Model.namespace == namespace, Model.name == name))
        if _NAME.match(name)
        else None
    )
    if row is None:
        raise NotFound(f"No model named {name!r}; GET /v1/models lists them.")
    return row


# ---------------------------------------------------------------------------
# datasets


def dataset_sha256(kind: str, scores_sha: str, labels_sha: str) -> str:
    return hashlib.sha256(f"{kind}\n{scores_sha}\n{labels_sha}".encode()).hexdigest()


def add_dataset(
    session: Session,
    model: Model,
    arrays: ArrayStore,
    scores: np.ndarray,
    labels: np.ndarray,
    kind: str,
) -> tuple[Dataset, bool]:
    """Store validated arrays (files first, fsynced), then commit the row; dedupe by content.

    Returns the dataset and whether it is new.
    """
    scores_sha = arrays.put(scores)
    labels_sha = arrays.put(labels)
    sha = dataset_sha256(kind, scores_sha, labels_sha)
    existing = _dataset_by_sha(session, model, sha)
    if existing is not None:
        return existing, False
    dataset = Dataset(
        model_id=model.id,
        sha256=sha,
        kind=kind,
        n_rows=int(scores.shape[0]),
        n_classes=int(scores.shape[1]),
        dtype=str(scores.dtype),
        scores_sha256=scores_sha,
        labels_sha256=labels_sha,
        metrics=metrics.report(to_probabilities(scores, kind), labels),
    )
    session.add(dataset)
    try:
        session.commit()
    except IntegrityError:  # the same content, uploaded concurrently
        session.rollback()
        existing = _dataset_by_sha(session, model, sha)
        if existing is None:
            raise
        return existing, False
    return dataset, True


def _dataset_by_sha(session: Session, model: Model, sha: str) -> Dataset | None:
    return session.scalar(
        select(Dataset).where(Dataset.model_id == model.id, Dataset.sha256 == sha)
    )


def list_datasets(session: Session, model: Model) -> list[Dataset]:
    return list(
        session.scalars(select(Dataset).where(Dataset.model_id == model.id).order_by(Dataset.id))
    )


def find_dataset(session: Session, model: Model, dataset_id: int) -> Dataset:
    """Dataset ``dataset_id`` of ``model`` (another model's is a 404 like a missing one)."""
    row = session.get(Dataset, dataset_id)
    if row is None or row.model_id != model.id:
        raise NotFound(f"Model {model.name!r} has no dataset {dataset_id}.")
    return row


# ---------------------------------------------------------------------------
# calibrator versions


def create_version(
    session: Session,
    model: Model,
    dataset: Dataset,
    *,
    method: str,
    holdout: float,
    seed: int,
    options: dict[str, Any],
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
        method=method,
        holdout=holdout,
        seed=seed,
        options=options,
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


def find_version(session: Session, model: Model, version: int) -> CalibratorVersion:
    row = session.scalar(
        select(CalibratorVersion).where(
            CalibratorVersion.model_id == model.id, CalibratorVersion.version == version
        )
    )
    if row is None:
        raise NotFound(f"Model {model.name!r} has no calibrator version {version}.")
    return row


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


# ---------------------------------------------------------------------------
# aliases


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


def list_aliases(session: Session, model: Model) -> list[tuple[Alias, CalibratorVersion]]:
    """Every alias of ``model`` (by name), each with the version it points at."""
    rows = session.execute(
        select(Alias, CalibratorVersion)
        .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
        .where(Alias.model_id == model.id)
        .order_by(Alias.alias)
    )
    return [(a, v) for a, v in rows]


def find_alias(session: Session, model: Model, alias: str) -> tuple[Alias, CalibratorVersion]:
    """``alias`` of ``model`` and the version it points at: the one alias -> version lookup."""
    row = (
        session.execute(
            select(Alias, CalibratorVersion)
            .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
            .where(Alias.model_id == model.id, Alias.alias == alias)
        ).one_or_none()
        if _ALIAS.match(alias)
        else None
    )
    if row is None:
        raise NotFound(
            f"Model {model.name!r} has no alias {alias!r}: PUT /v1/models/{model.name}"
            f"/aliases/{alias} with a version first."
        )
    return row[0], row[1]


def served_version(
    session: Session, model: Model, alias: str | None = None, version: int | None = None
) -> CalibratorVersion:
    """The version a request names: ``version`` if given, else the one ``alias`` (default:
    :data:`service.vocabulary.DEFAULT_ALIAS`) points at. 404 if missing, 422 if both given."""
    if alias is not None and version is not None:
        raise InvalidInput("Give either ?alias= or ?version=, not both.")
    if version is not None:
        return find_version(session, model, version)
    return find_alias(session, model, alias or DEFAULT_ALIAS)[1]


def resolve_served(
    session: Session, name: str, alias: str | None, version: int | None, namespace: str
) -> tuple[Model, CalibratorVersion]:
    """The model and version predict serves (:func:`served_version`), 409 unless servable."""
    model = find_model(session, name, namespace)
    row = served_version(session, model, alias, version)
    check_servable(row, model)
    return model, row
