"""The model registry's queries: models, datasets, calibrator versions and aliases.

Each function that writes is one transaction (it commits); each lookup by name
or number raises :class:`service.errors.NotFound` when the row is missing, so
the API turns it into a 404 without a check of its own. A name that cannot
exist (it fails the pattern of :mod:`service.vocabulary`) is not looked up: a
NUL byte would be a driver error, not a 404.

Deletes (the rules are in docs/api.md, "Deleting"): an alias always goes; a version
only when no alias points at it and its fit is finished; a dataset only when no
version was fitted on it (or, with ``cascade``, together with those versions, which
must be unaliased and finished); a model with everything it holds (datasets,
versions, feedback) when it has no alias and no unfinished fit. Each is one
transaction; the array files the deleted datasets named are released after it
commits (:mod:`service.storage.array_refs`). What is checked before a delete is also
enforced by the database while it runs: ``aliases.version_id`` and
``calibrator_versions.dataset_id`` have no ON DELETE action, so a concurrent alias
move or fit makes the delete fail (409) instead of leaving a dangling reference; a
version is deleted with ``WHERE status NOT IN ('queued', 'running')``; and a model is
locked first (``SELECT ... FOR UPDATE``; on SQLite the write lock), so no alias, fit
or upload can slip in between the checks and the delete.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, undefer

from calibrators import topk
from calibrators.evaluation import entropy, metrics
from service.errors import ArgmaxChanged, Conflict, InUse, InvalidInput, NotFound, NotReady
from service.storage import array_refs, usage
from service.storage.arrays import ArrayStore, Staged
from service.storage.db import (
    Alias,
    CalibratorVersion,
    Dataset,
    FeedbackBin,
    FeedbackNllBin,
    Model,
    ServedClass,
    json_bytes,
    utcnow,
)
from service.storage.pages import PageRequest, paged
from service.storage.usage import Quotas
from service.vocabulary import (
    ALIAS_PATTERN,
    ARGMAX_CHANGED,
    DEFAULT_ALIAS,
    FROM_PARAMS,
    NAME_PATTERN,
    UNFINISHED,
)

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
    quotas: Quotas | None = None,
    description: str | None = None,
) -> Model:
    """A new model of ``namespace``; 409 if the namespace has one of that name, or (with
    ``quotas``) as many models as its quota allows (checked under the namespace's lock)."""
    model = Model(
        namespace=namespace,
        name=name,
        num_classes=num_classes,
        class_names=class_names,
        argmax_policy=argmax_policy,
        description=description,
    )
    try:
        if quotas is not None:
            usage.lock(session, namespace)
            usage.check_model(session, namespace, quotas)
        session.add(model)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"A model named {name!r} already exists.") from None
    except BaseException:
        session.rollback()
        raise
    return model


def update_model(session: Session, model: Model, changes: dict[str, Any]) -> Model:
    """Set ``changes`` (class_names, argmax_policy, description) of ``model`` in one
    UPDATE; 422 for class names that are not one per class, 404 if it was deleted."""
    names = changes.get("class_names")
    if names is not None and len(names) != model.num_classes:
        raise InvalidInput(
            f"class_names must have one name per class: model {model.name!r} has "
            f"num_classes={model.num_classes} (its datasets and versions have that many "
            f"columns). Got {len(names)}."
        )
    if changes:
        updated = session.execute(
            update(Model).where(Model.id == model.id).values(**changes, updated_at=utcnow())
        ).rowcount
        session.commit()
        if not updated:
            raise NotFound(f"No model named {model.name!r}; GET /v1/models lists them.")
    session.refresh(model)
    return model


def list_models(
    session: Session, namespace: str, page: PageRequest | None = None
) -> list[Model]:
    """The namespace's models by id (oldest first)."""
    stmt = select(Model).where(Model.namespace == namespace)
    return list(session.scalars(paged(stmt, Model.id, page)))


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


def dataset_sha256(
    kind: str,
    scores_sha: str,
    labels_sha: str | None,
    sequences_sha: str | None = None,
    topk_ids_sha: str | None = None,
) -> str:
    """The content hash of a dataset: the same scores with other sequence ids (or none),
    or without labels, are another dataset; one with labels and without sequence ids
    keeps the hash it always had. Top-k rows add their ids' hash."""
    text = f"{kind}\n{scores_sha}\n{labels_sha or 'unlabelled'}"
    if sequences_sha is not None:
        text += f"\n{sequences_sha}"
    if topk_ids_sha is not None:
        text += f"\ntopk {topk_ids_sha}"
    return hashlib.sha256(text.encode()).hexdigest()


#: Up to this many scores (rows x classes) a dataset's metrics are computed in its
#: upload's request and come with the answer (about 10 ms); a bigger dataset is
#: answered first and its metrics follow (:func:`fill_metrics`, run by
#: service/jobs/dataset_metrics.py): at a language model's K they were 72 % of the
#: upload's time (bench/README.md, "Uploads at language-model K").
INLINE_METRICS_SCORES = 1 << 22


def add_dataset(
    session: Session,
    model: Model,
    arrays: ArrayStore,
    scores: np.ndarray,
    labels: np.ndarray | None,
    kind: str,
    quotas: Quotas | None = None,
    before_commit: Callable[[Session, Dataset], None] | None = None,
    sequences: np.ndarray | None = None,
    metrics_later: Callable[[int], None] | None = None,
    scores_file: Staged | None = None,
    topk_ids: np.ndarray | None = None,
) -> tuple[Dataset, bool]:
    """Store validated arrays (files first, fsynced), then commit the row; dedupe by content.

    Returns the dataset and whether it is new. The files are written first, hashed as
    they are written; identical content of the same model then returns the existing
    dataset before anything is counted. With ``quotas``, the namespace's quotas
    (:mod:`service.storage.usage`) are checked under the namespace's lock in the
    transaction that inserts the row; a refusal releases the files it wrote.
    ``before_commit(session, dataset)`` runs after a new row is flushed, in its
    transaction (an idempotency key's answer commits with it). ``sequences``: the
    sequence id of each row (validated), a third file; the metrics then add the NLL per
    sequence. ``labels`` None: scores alone, for label-free fits; the metrics are then
    the entropies of the rows (:func:`calibrators.evaluation.entropy.entropy_report`).
    Over :data:`INLINE_METRICS_SCORES` scores the row is stored without its metrics
    (NULL), and ``metrics_later(dataset_id)`` is called once it is committed (to hand it
    to :func:`fill_metrics`). ``scores_file``: the scores' ``.npy`` bytes already written
    and hashed (an upload's member, :class:`~service.storage.arrays.Staged`), stored as
    they are instead of writing ``scores`` again.

    ``topk_ids``: the token ids (N, k) of top-k rows (``calibrators.topk``, validated,
    the vocabulary size the model's K), whose log-probabilities are ``scores``; their
    metrics are :func:`calibrators.topk.report` of the rows as given.
    """

    # Written first, hashed and sized while written: one pass over each array. Content
    # uploaded before is then found by its hash; its files were rewritten with the same
    # bytes (the price of a repeated upload, against a hashing pass for every new one).
    def written(array: np.ndarray | None, staged: Staged | None = None) -> array_refs.Held | None:
        if array is None:
            return None
        return array_refs.Held(*(arrays.write(array) if staged is None else arrays.adopt(staged)),
                               array)

    named = [
        written(scores, scores_file), written(labels), written(sequences), written(topk_ids)
    ]
    files = [f for f in named if f is not None]
    shas = [f.sha256 for f in files]
    score_sha, label_sha, sequence_sha, ids_sha = (
        None if f is None else f.sha256 for f in named
    )
    sha = dataset_sha256(kind, score_sha, label_sha, sequence_sha, ids_sha)
    existing = _dataset_by_sha(session, model, sha)
    if existing is not None:
        return existing, False
    rows, n_bytes = int(scores.shape[0]), sum(f.n_bytes for f in files)
    dataset = Dataset(
        model_id=model.id,
        sha256=sha,
        kind=kind,
        n_rows=rows,
        n_classes=int(scores.shape[1]) if topk_ids is None else model.num_classes,
        dtype=str(scores.dtype),
        scores_sha256=score_sha,
        labels_sha256=label_sha,
        sequences_sha256=sequence_sha,
        n_sequences=None if sequences is None else int(np.unique(sequences).size),
        n_bytes=n_bytes,
        top_k=None if topk_ids is None else int(scores.shape[1]),
        topk_ids_sha256=ids_sha,
    )
    later = scores.size > INLINE_METRICS_SCORES
    try:
        if not later:
            dataset.metrics = dataset_report(
                scores, labels, kind, sequences, topk_ids, dataset.n_classes
            )
        if quotas is not None:
            usage.lock(session, model.namespace)
            usage.check_dataset(session, model.namespace, rows, n_bytes, quotas)
        array_refs.hold(session, arrays, files)
        session.add(dataset)
        if before_commit is not None:
            session.flush()
            before_commit(session, dataset)
        session.commit()
    except IntegrityError:  # the same content uploaded concurrently, or the model deleted
        session.rollback()
        existing = _dataset_by_sha(session, model, sha)
        if existing is not None:
            return existing, False
        array_refs.release(session, arrays, shas)
        if session.get(Model, model.id, populate_existing=True) is None:
            raise NotFound(f"Model {model.name!r} was deleted during the upload.") from None
        raise
    except BaseException:
        session.rollback()
        array_refs.release(session, arrays, shas)
        raise
    if later and metrics_later is not None:
        metrics_later(dataset.id)
    return dataset, True


def dataset_report(
    scores: np.ndarray,
    labels: np.ndarray | None,
    kind: str,
    sequences: np.ndarray | None,
    topk_ids: np.ndarray | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """A dataset's metrics: :func:`calibrators.evaluation.metrics.scores_report` of
    labelled scores; without labels, the entropies of the rows
    (:func:`calibrators.evaluation.entropy.entropy_report`); for top-k rows (``scores``
    their log-probabilities, ``topk_ids`` their ids), :func:`calibrators.topk.report` as
    given (beta 1, the default tail)."""
    if topk_ids is not None:
        rows = topk.as_topk(topk_ids, scores, vocab_size)
        return topk.report(rows, labels, sequences=sequences)
    if labels is None:
        return entropy.entropy_report(scores, kind)
    return metrics.scores_report(scores, labels, kind, sequences=sequences)


def fill_metrics(sessions: Callable[[], Session], arrays: ArrayStore, dataset_id: int) -> bool:
    """Compute the metrics of a dataset stored without them, from its stored arrays
    (memory-mapped), and store them: True when this call wrote them. False when the
    dataset is gone or has its metrics (another process computed them first: the
    update takes only a row still without)."""
    with sessions() as session:
        dataset = session.scalar(
            select(Dataset)
            .where(Dataset.id == dataset_id, Dataset.metrics.is_(None))
            .options(undefer(Dataset.metrics))
        )
        if dataset is None:
            return False
        kind, scores_sha, labels_sha = dataset.kind, dataset.scores_sha256, dataset.labels_sha256
        ids_sha, vocab_size = dataset.topk_ids_sha256, dataset.n_classes
        sequences = dataset_sequences(arrays, dataset)
    labels = None if labels_sha is None else arrays.load(labels_sha)
    ids = None if ids_sha is None else arrays.load(ids_sha)
    report = dataset_report(arrays.load(scores_sha), labels, kind, sequences, ids, vocab_size)
    with sessions() as session:
        written = session.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id, Dataset.metrics.is_(None))
            .values(metrics=report)
        ).rowcount
        session.commit()
    return bool(written)


def datasets_without_metrics(session: Session, older_than: float) -> list[int]:
    """The ids of datasets still without metrics, created over ``older_than`` seconds
    ago (younger ones are an upload's own to fill), oldest first."""
    cutoff = utcnow() - timedelta(seconds=older_than)
    return list(
        session.scalars(
            select(Dataset.id)
            .where(Dataset.metrics.is_(None), Dataset.created_at <= cutoff)
            .order_by(Dataset.id)
        )
    )


def _dataset_by_sha(session: Session, model: Model, sha: str) -> Dataset | None:
    return session.scalar(
        select(Dataset).where(Dataset.model_id == model.id, Dataset.sha256 == sha)
    )


def dataset_sequences(arrays: ArrayStore, dataset: Dataset) -> np.ndarray | None:
    """The sequence id of each row of ``dataset`` (memory-mapped), or None without them:
    the ``groups`` of every hold-out split of it."""
    if dataset.sequences_sha256 is None:
        return None
    return arrays.load(dataset.sequences_sha256)


def list_datasets(
    session: Session, model: Model, page: PageRequest | None = None
) -> list[Dataset]:
    stmt = select(Dataset).where(Dataset.model_id == model.id)
    return list(session.scalars(paged(stmt, Dataset.id, page)))


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
    enqueue: Callable[[Session, CalibratorVersion], None] | None = None,
    params: dict[str, Any] | None = None,
    quotas: Quotas | None = None,
    kind: str | None = None,
    refit: bool = False,
) -> CalibratorVersion:
    """A queued version with the next number of this model (atomic UPDATE ... RETURNING).

    ``enqueue(session, version)`` runs after the row is flushed and before the commit:
    the job queue writes its job in the same transaction (:mod:`service.jobs.engine`).
    With ``params`` (posted ``to_params`` JSON, checked by the caller), a version from
    parameters (source :data:`~service.vocabulary.FROM_PARAMS`): its job evaluates them
    instead of fitting, and its outcome replaces them with the canonical ones; their
    bytes count against the namespace's quota from now on. ``kind``: the kind of scores
    the params were fitted on (:attr:`CalibratorVersion.kind`; default the dataset's,
    what a fit is fitted on). ``refit``: the fit request's (:attr:`CalibratorVersion.refit`).
    With ``quotas``, the
    ``versions`` and ``stored_bytes`` quotas (:func:`service.storage.usage.check_version`)
    are checked under the namespace's lock, in the transaction that inserts the row.
    """
    n_bytes = json_bytes(params) if params is not None else 0
    if quotas is not None:
        try:
            usage.lock(session, model.namespace)
            usage.check_version(session, model, n_bytes, quotas)
        except BaseException:
            session.rollback()
            raise
    after = session.execute(
        update(Model)
        .where(Model.id == model.id)
        .values(next_version=Model.next_version + 1)
        .returning(Model.next_version)
    ).scalar_one_or_none()
    if after is None:
        session.rollback()
        raise NotFound(f"Model {model.name!r} was deleted.")
    number = after - 1
    row = CalibratorVersion(
        model_id=model.id,
        version=number,
        dataset_id=dataset.id,
        method=method,
        kind=dataset.kind if kind is None else kind,
        holdout=holdout,
        seed=seed,
        options=options,
        refit=refit,
        status="queued",
        progress=0.0,
    )
    if params is not None:
        row.params, row.source, row.n_bytes = params, FROM_PARAMS, n_bytes
    session.add(row)
    try:
        session.flush()
        if enqueue is not None:
            enqueue(session, row)
        session.commit()
    except IntegrityError:  # the dataset was deleted meanwhile
        session.rollback()
        raise NotFound(f"Model {model.name!r} has no dataset {dataset.id} any more.") from None
    return row


def list_versions(
    session: Session, model: Model, page: PageRequest | None = None
) -> list[CalibratorVersion]:
    """The model's versions by number (the order of their ids: numbers only grow)."""
    return list(
        session.scalars(
            paged(
                select(CalibratorVersion).where(CalibratorVersion.model_id == model.id),
                CalibratorVersion.version,
                page,
            )
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
    """409 unless ``row`` may be served: succeeded (a version rejected by the argmax policy
    carries its argmax report; one rejected for its held-out NLL, its reason)."""
    if row.status == "rejected" and ARGMAX_CHANGED not in (row.rejected_for or [ARGMAX_CHANGED]):
        raise NotReady(
            f"Version {row.version} of {model.name!r} is rejected: "
            f"{' '.join(row.rejection or [])}",
            version_status=row.status,
        )
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
    try:
        session.execute(stmt)
        session.commit()
    except IntegrityError:  # the version (or the model) was deleted meanwhile
        session.rollback()
        raise NotFound(
            f"Model {model.name!r} has no calibrator version {version.version} any more."
        ) from None
    return session.get(Alias, (model.id, alias), populate_existing=True)


def list_aliases(
    session: Session, model: Model, page: PageRequest | None = None
) -> list[tuple[Alias, CalibratorVersion]]:
    """The aliases of ``model`` by name (their key), each with the version it points at."""
    rows = session.execute(
        paged(
            select(Alias, CalibratorVersion)
            .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
            .where(Alias.model_id == model.id),
            Alias.alias,
            page,
        )
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


def version_top_k(session: Session, row: CalibratorVersion) -> int | None:
    """The width k of the top-k rows ``row`` serves (its dataset's ``top_k``), or None
    when it serves full scores. A version is top-k exactly when its dataset is: a fit on
    a top-k dataset is a top-k temperature, and posted params are refused there."""
    return session.scalar(select(Dataset.top_k).where(Dataset.id == row.dataset_id))


# ---------------------------------------------------------------------------
# deletes


@dataclass(frozen=True)
class Deleted:
    """What one delete removed: dataset ids, version numbers (and their row ids, for the
    serving caches), alias names, and the bytes of the deleted datasets and versions,
    released from the namespace's stored-bytes quota (whether files were shared or not)."""

    model: str
    datasets: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version_ids: list[int] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    stored_bytes_released: int = 0


def _aliases_of(session: Session, version_ids: Iterable[int]) -> list[tuple[str, int]]:
    """(alias, version number) of every alias that points at one of ``version_ids``."""
    ids = list(version_ids)
    if not ids:
        return []
    rows = session.execute(
        select(Alias.alias, CalibratorVersion.version)
        .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
        .where(Alias.version_id.in_(ids))
        .order_by(Alias.alias)
    )
    return [(a, v) for a, v in rows]


class _Changed(Exception):
    """Rows a delete counted on changed under it (e.g. a version started being deleted)."""


def _changed(what: str, model: Model) -> InUse:
    return InUse(f"{what} of {model.name!r} changed while it was being deleted; try again.")


def _names(items: Iterable) -> str:
    return ", ".join(str(i) for i in items)


def _refuse_aliased(what: str, model: Model, aliased: list[tuple[str, int]]) -> None:
    if aliased:
        names = _names(f"{a!r} (version {v})" for a, v in aliased)
        raise InUse(
            f"{what} of {model.name!r} is in use: alias {names} points at it. Move or DELETE "
            f"/v1/models/{model.name}/aliases/{{alias}} first.",
            aliases=[a for a, _ in aliased],
            versions=sorted({v for _, v in aliased}),
        )


def _refuse_unfinished(what: str, model: Model, unfinished: list[tuple[int, str]]) -> None:
    if unfinished:
        names = _names(f"{v} ({status})" for v, status in unfinished)
        raise InUse(
            f"{what} of {model.name!r} is in use: the fit of version {names} is not finished. "
            "Wait for it to finish (GET its status), then delete.",
            fits=[v for v, _ in unfinished],
        )


def delete_alias(session: Session, model: Model, alias: str) -> Deleted:
    """Remove ``alias`` (predict without a version stops finding it at once here, and in
    other processes within ``ALIAS_CACHE_SECONDS``). 404 if it is gone already."""
    removed = session.execute(
        delete(Alias).where(Alias.model_id == model.id, Alias.alias == alias)
    ).rowcount
    session.commit()
    if not removed:
        raise NotFound(f"Model {model.name!r} has no alias {alias!r}.")
    return Deleted(model=model.name, aliases=[alias])


def delete_version(session: Session, model: Model, row: CalibratorVersion) -> Deleted:
    """Delete one version and its feedback sums: 409 while an alias points at it or its fit
    is queued or running."""
    what = f"Version {row.version}"
    _refuse_aliased(what, model, _aliases_of(session, [row.id]))
    _refuse_unfinished(what, model, [(row.version, row.status)] if row.status in UNFINISHED else [])
    try:
        _delete_sums(session, [row.id])
        removed = session.execute(
            delete(CalibratorVersion).where(
                CalibratorVersion.id == row.id, CalibratorVersion.status.not_in(UNFINISHED)
            )
        ).rowcount
        if removed != 1:
            session.rollback()
            raise NotFound(f"Model {model.name!r} has no calibrator version {row.version}.")
        session.commit()
    except IntegrityError:  # an alias was pointed at it meanwhile
        session.rollback()
        _refuse_aliased(what, model, _aliases_of(session, [row.id]))
        raise _changed(what, model) from None
    return Deleted(
        model=model.name,
        versions=[row.version],
        version_ids=[row.id],
        stored_bytes_released=row.n_bytes,
    )


def _versions_of(session: Session, *where) -> list[tuple[int, int, str]]:
    """(id, number, status) of the versions matching ``where``, by number."""
    rows = session.execute(
        select(CalibratorVersion.id, CalibratorVersion.version, CalibratorVersion.status)
        .where(*where)
        .order_by(CalibratorVersion.version)
    )
    return [(i, v, s) for i, v, s in rows]


def _bytes_of(session: Session, ids: list[int]) -> int:
    """The stored bytes of the versions ``ids``."""
    if not ids:
        return 0
    return int(
        session.scalar(
            select(func.coalesce(func.sum(CalibratorVersion.n_bytes), 0)).where(
                CalibratorVersion.id.in_(ids)
            )
        )
    )


#: The tables of per-version sums, removed with their version.
_VERSION_SUMS = (FeedbackBin, FeedbackNllBin, ServedClass)


def _delete_sums(session: Session, ids: list[int]) -> None:
    for table in _VERSION_SUMS:
        session.execute(delete(table).where(table.version_id.in_(ids)))


def _delete_versions(session: Session, ids: list[int]) -> int:
    if not ids:
        return 0
    _delete_sums(session, ids)
    return session.execute(
        delete(CalibratorVersion).where(
            CalibratorVersion.id.in_(ids), CalibratorVersion.status.not_in(UNFINISHED)
        )
    ).rowcount


def delete_dataset(
    session: Session, model: Model, dataset: Dataset, arrays: ArrayStore, cascade: bool = False
) -> Deleted:
    """Delete a dataset; its array files go when no other dataset names them.

    409 while versions fitted on it exist, unless ``cascade``: then they are deleted in
    the same transaction, and it is a 409 while any of them has an alias or an
    unfinished fit.
    """
    what = f"Dataset {dataset.id}"
    for attempt in (1, 2):
        versions = _versions_of(session, CalibratorVersion.dataset_id == dataset.id)
        if versions and not cascade:
            raise InUse(
                f"{what} of {model.name!r} is in use: version {_names(v for _, v, _ in versions)} "
                "was fitted on it. DELETE those versions first, or add ?cascade=true to delete "
                "them with the dataset.",
                versions=[v for _, v, _ in versions],
            )
        _refuse_unfinished(what, model, [(v, s) for _, v, s in versions if s in UNFINISHED])
        _refuse_aliased(what, model, _aliases_of(session, [i for i, _, _ in versions]))
        ids = [i for i, _, _ in versions]
        released = dataset.n_bytes + _bytes_of(session, ids)
        try:
            if _delete_versions(session, ids) != len(ids):
                raise _Changed
            removed = session.execute(delete(Dataset).where(Dataset.id == dataset.id)).rowcount
            if removed != 1:
                session.rollback()
                raise NotFound(f"Model {model.name!r} has no dataset {dataset.id}.")
            session.commit()
        except (IntegrityError, _Changed):  # a fit or an alias arrived meanwhile: again
            session.rollback()
            if attempt == 2:
                raise _changed(what, model) from None
            continue
        array_refs.release(session, arrays, array_refs.dataset_files(dataset))
        return Deleted(
            model=model.name,
            datasets=[dataset.id],
            versions=[v for _, v, _ in versions],
            version_ids=ids,
            stored_bytes_released=released,
        )
    raise AssertionError("unreachable")


def _lock_model(session: Session, model: Model) -> None:
    """Hold ``model``'s row until the transaction ends: aliases, fits and uploads of the
    model wait (their foreign keys need it); 404 if it is gone."""
    if session.get_bind().dialect.name == "postgresql":
        found = session.scalar(select(Model.id).where(Model.id == model.id).with_for_update())
    else:  # a write takes SQLite's write lock: no other connection writes until we end
        found = session.execute(
            update(Model).where(Model.id == model.id).values(next_version=Model.next_version)
        ).rowcount
    if not found:
        session.rollback()
        raise NotFound(f"No model named {model.name!r}; GET /v1/models lists them.")


def delete_model(session: Session, model: Model, arrays: ArrayStore) -> Deleted:
    """Delete a model with its datasets, versions and feedback, in one transaction; its
    array files go when no other dataset names them. 409 while it has an alias (delete
    the aliases first: a model in service does not vanish in one call) or a queued or
    running fit."""
    what = f"Model {model.name!r}"
    _lock_model(session, model)
    try:
        aliases = session.execute(
            select(Alias.alias, CalibratorVersion.version)
            .join(CalibratorVersion, CalibratorVersion.id == Alias.version_id)
            .where(Alias.model_id == model.id)
            .order_by(Alias.alias)
        ).all()
        if aliases:
            names = _names(f"{a!r} (version {v})" for a, v in aliases)
            raise InUse(
                f"{what} is in use: it has alias {names}. DELETE "
                f"/v1/models/{model.name}/aliases/{{alias}} first.",
                aliases=[a for a, _ in aliases],
            )
        versions = _versions_of(session, CalibratorVersion.model_id == model.id)
        unfinished = [(v, s) for _, v, s in versions if s in UNFINISHED]
        if unfinished:
            raise InUse(
                f"{what} is in use: the fit of version "
                f"{_names(f'{v} ({s})' for v, s in unfinished)} is not finished. Wait for it "
                "to finish, then delete.",
                fits=[v for v, _ in unfinished],
            )
        datasets = session.execute(
            select(
                Dataset.id,
                Dataset.scores_sha256,
                Dataset.labels_sha256,
                Dataset.sequences_sha256,
                Dataset.topk_ids_sha256,
                Dataset.n_bytes,
            )
            .where(Dataset.model_id == model.id)
            .order_by(Dataset.id)
        ).all()
        ids = [i for i, _, _ in versions]
        released = sum(d.n_bytes for d in datasets) + _bytes_of(session, ids)
        _delete_versions(session, ids)
        session.execute(delete(Dataset).where(Dataset.model_id == model.id))
        session.execute(delete(Model).where(Model.id == model.id))
        session.commit()
    except BaseException:
        session.rollback()
        raise
    shas = [sha for d in datasets for sha in array_refs.dataset_files(d)]
    array_refs.release(session, arrays, shas)
    return Deleted(
        model=model.name,
        datasets=[d.id for d in datasets],
        versions=[v for _, v, _ in versions],
        version_ids=ids,
        stored_bytes_released=released,
    )
