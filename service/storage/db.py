"""The registry's tables (SQLAlchemy 2.0 typed models) and the engine factory.

Fifteen tables: ``models`` (a classifier to calibrate), ``datasets`` (immutable
labelled scores; the arrays are content-addressed files, see
:mod:`service.storage.arrays`), ``calibrator_versions`` (one immutable fit per row,
numbered per model; the row is also the background job), ``aliases``
((model, alias) -> version, moved in one UPDATE), ``feedback_bins``
(time-bucketed reliability sums of labelled feedback, for live calibration),
``feedback_nll_bins`` (the same feedback's per-row NLL histogram, for its quantiles),
``served_classes`` (time-bucketed served rows per predicted class, for label shift),
``api_keys`` (the sha256 of each key, its namespace and scope), ``namespaces``
(the row a quota check locks, :mod:`service.storage.usage`), ``array_files``
(the row that guards an array file's removal, :mod:`service.storage.array_refs`),
``idempotency_keys`` (writes made under an ``Idempotency-Key`` and their answers,
:mod:`service.storage.idempotency`), and the recalibration loop's four
(:mod:`service.storage.loops`): ``feedback_loops`` (a model's opt-in and settings),
``feedback_batches`` (kept feedback rows), ``loop_runs`` and ``loop_events``. The closed lists
the CHECK constraints name come from :mod:`service.vocabulary`; the queries live in
the other modules of this package.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import orjson
from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    false,
    true,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.storage.retry import track_writes
from service.vocabulary import (
    ARGMAX_POLICIES,
    DEFAULT_NAMESPACE,
    IDEMPOTENCY_STATES,
    KINDS,
    LOOP_DEFAULTS,
    LOOP_STATES,
    LOOP_STEPS,
    LOOP_TRIGGERS,
    SCOPES,
    STATUSES,
)

#: Deterministic constraint names, so migrations can refer to them (and SQLite
#: batch mode can recreate tables) on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime | None) -> datetime | None:
    """A stored time as an aware datetime: SQLite gives naive ones back; every stored
    time is UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment


def _in(column: str, values: tuple[str, ...]) -> str:
    # The CHECK of a closed list of service.vocabulary (a changed list needs a migration).
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar = {
        dict[str, Any]: JSON,
        list[str]: JSON,
        datetime: DateTime(timezone=True),
    }


class Model(Base):
    """A classifier whose scores are calibrated. Its name, namespace and number of classes
    never change; its class names, argmax policy and description can (PATCH)."""

    __tablename__ = "models"
    __table_args__ = (
        CheckConstraint(_in("argmax_policy", ARGMAX_POLICIES), name="argmax_policy"),
        CheckConstraint("num_classes >= 2", name="num_classes"),
        UniqueConstraint("namespace", "name"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    #: The tenant: an API key sees only the models of its namespace (service.security.auth).
    namespace: Mapped[str] = mapped_column(String(64), server_default=DEFAULT_NAMESPACE)
    name: Mapped[str] = mapped_column(String(128))
    num_classes: Mapped[int]
    class_names: Mapped[list[str] | None]
    argmax_policy: Mapped[str] = mapped_column(String(16))
    #: The number the next calibrator version gets; bumped with UPDATE ... RETURNING
    #: so concurrent fits never get the same number.
    next_version: Mapped[int] = mapped_column(Integer, server_default="1")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    description: Mapped[str | None] = mapped_column(Text)
    #: When class names, policy or description last changed (None: never).
    updated_at: Mapped[datetime | None]


class Dataset(Base):
    """Scores of one model, labelled or not; the arrays live in ``data_dir`` by sha256."""

    __tablename__ = "datasets"
    __table_args__ = (
        UniqueConstraint("model_id", "sha256"),
        CheckConstraint(_in("kind", KINDS), name="kind"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    #: Content hash of the dataset: sha256 over kind, scores .npy and labels .npy (or
    #: "unlabelled") and the sequence ids' .npy when it has them.
    sha256: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    n_rows: Mapped[int]
    n_classes: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    #: Array files by content hash; indexed: "does any dataset still refer to this file".
    scores_sha256: Mapped[str] = mapped_column(String(64), index=True)
    #: None: scores without labels, for label-free fits only (an entropy target).
    labels_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    #: The sequence (text) of each row, when rows are tokens: every hold-out split of the
    #: dataset is then by sequence. None: rows are independent.
    sequences_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    #: Distinct sequences (None without sequence ids).
    n_sequences: Mapped[int | None]
    #: A dataset of top-k log-probabilities (``calibrators.topk``): the width k of its
    #: rows, and the file of their token ids (N, k) beside the log-probabilities in
    #: ``scores_sha256``; ``n_classes`` is the vocabulary size V. None: full scores.
    top_k: Mapped[int | None]
    topk_ids_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    #: Bytes of its .npy files: what the dataset counts against its namespace's
    #: stored-bytes quota (in full, even when another dataset shares a file).
    n_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    #: metrics.scores_report of the raw scores, computed once: in the upload's request
    #: for a small dataset, after its answer for a big one (NULL until then;
    #: service/jobs/dataset_metrics.py).
    metrics: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), deferred=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CalibratorVersion(Base):
    """One fit: queued -> running -> succeeded | rejected | failed | cancelled, then frozen.

    ``params`` and the metrics are written in the same transaction as the final
    status, so no reader ever sees a half-fitted calibrator. A version from posted
    parameters (``source`` ``params``) holds them from its creation, as the input of
    its job; like a fit's, they are answered, exported and served only once its status
    is fitted.
    """

    __tablename__ = "calibrator_versions"
    __table_args__ = (
        UniqueConstraint("model_id", "version"),
        CheckConstraint(_in("status", STATUSES), name="status"),
        CheckConstraint(_in("kind", KINDS), name="kind"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    version: Mapped[int]
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"), index=True)
    method: Mapped[str] = mapped_column(String(16))
    #: The kind of scores its params were fitted on (KINDS): its dataset's for a fit; for
    #: posted params, theirs, else the kind of the dataset that evaluates them. Every
    #: version of params format 2 serves both kinds with one answer; one of format 1 of
    #: vector or matrix scaling serves this kind only (docs/design.md).
    kind: Mapped[str] = mapped_column(String(16))
    chosen_method: Mapped[str | None] = mapped_column(String(16))
    holdout: Mapped[float] = mapped_column(Float)
    seed: Mapped[int] = mapped_column(BigInteger)
    options: Mapped[dict[str, Any]]
    #: Fit the chosen method again on every row after the hold-out evaluation (the fit
    #: request's ``refit``; always false for a version from posted params).
    refit: Mapped[bool] = mapped_column(default=False, server_default=false())
    status: Mapped[str] = mapped_column(String(16), index=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    params: Mapped[dict[str, Any] | None] = mapped_column(deferred=True)
    metrics_before: Mapped[dict[str, Any] | None] = mapped_column(deferred=True)
    metrics_after: Mapped[dict[str, Any] | None] = mapped_column(deferred=True)
    argmax: Mapped[dict[str, Any] | None]
    candidates: Mapped[dict[str, Any] | None] = mapped_column(deferred=True)
    warning: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    fit_seconds: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    #: Attempts started (a worker that died or was stopped hands the job back: the next
    #: attempt counts 2). Only the current attempt may write the outcome.
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    #: The worker of the current (or last) attempt: ``host:pid``.
    worker: Mapped[str | None] = mapped_column(String(128))
    #: The job engine's id of this fit (PostgreSQL: procrastinate_jobs.id; None on SQLite).
    job_id: Mapped[int | None] = mapped_column(BigInteger)
    #: Why it was rejected (one sentence per reason), set with the outcome.
    rejection: Mapped[list[str] | None]
    #: The reasons of a rejection, machine-readable (REJECTION_REASONS), set with the
    #: outcome; None for a version not rejected (or rejected before the column existed:
    #: by the argmax policy, the only reason then).
    rejected_for: Mapped[list[str] | None]
    #: Where its params came from: a fit here, or posted parameters (VERSION_SOURCES).
    source: Mapped[str] = mapped_column(String(16), server_default="fit")
    #: Bytes of its params as stored (:func:`json_bytes`; fit_info included): what the
    #: version counts against its namespace's stored-bytes quota. Posted params count
    #: from the version's creation, a fit's from its outcome (0 until then).
    n_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Alias(Base):
    """A movable name for one version of a model (MLflow's registry aliases)."""

    __tablename__ = "aliases"

    model_id: Mapped[int] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), primary_key=True
    )
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("calibrator_versions.id"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class FeedbackBin(Base):
    """Reliability statistics of labelled feedback: one row per (version, time bucket, bin).

    Sums only (no raw rows), so any window is a ``SUM ... GROUP BY bin_index``, and
    every writer adds with ``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``
    (atomic per row on SQLite and PostgreSQL, whichever worker or replica writes).
    ``bucket_start`` is Unix seconds, a multiple of the bucket width; ``bin_index``
    the equal-width confidence bin (15 bins, as the hold-out ECE).
    """

    __tablename__ = "feedback_bins"

    version_id: Mapped[int] = mapped_column(
        ForeignKey("calibrator_versions.id", ondelete="CASCADE"), primary_key=True
    )
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)
    bin_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    correct_count: Mapped[int] = mapped_column(BigInteger)
    confidence_sum: Mapped[float] = mapped_column(Float)
    nll_sum: Mapped[float] = mapped_column(Float)
    entropy_sum: Mapped[float] = mapped_column(Float)
    brier_sum: Mapped[float] = mapped_column(Float)


class FeedbackNllBin(Base):
    """Labelled feedback rows per bin of a fixed log-spaced histogram of their NLL
    (:data:`service.observe.served.NLL_EDGES`): one row per (version, time bucket, bin),
    added to like ``feedback_bins``, so a window's NLL quantiles need no rows."""

    __tablename__ = "feedback_nll_bins"

    version_id: Mapped[int] = mapped_column(
        ForeignKey("calibrator_versions.id", ondelete="CASCADE"), primary_key=True
    )
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)
    bin_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class ServedClass(Base):
    """Served rows per predicted class: one row per (version, time bucket, class).

    Flushed periodically from each process's in-process counts
    (:class:`service.observe.served.ServedCounts`) with ``count = count +
    excluded.count``, so processes and replicas add up and predict writes nothing.
    ``class_index`` -1 is the rows of the classes a flush did not keep (models of more
    than :data:`service.observe.served.EXACT_CLASSES` classes).
    """

    __tablename__ = "served_classes"

    version_id: Mapped[int] = mapped_column(
        ForeignKey("calibrator_versions.id", ondelete="CASCADE"), primary_key=True
    )
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)
    class_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class ApiKey(Base):
    """An API key: only its sha256 is stored (the key itself is shown once, at creation).

    ``prefix`` is the key's first characters, enough to recognise it in ``keys list``
    and in logs without being usable. ``scope`` is hierarchical: predict < write < admin.
    """

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_in("scope", SCOPES), name="scope"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    namespace: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(16))
    description: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Namespace(Base):
    """One row per namespace that stored something: the row a quota check locks.

    The usage itself is counted from ``models`` and ``datasets`` (never a counter that
    could drift); the lock makes "count, compare with the quota, insert" atomic for
    every upload of the namespace (:mod:`service.storage.usage`).
    """

    __tablename__ = "namespaces"

    namespace: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: The last time a quota check locked the row (each lock is a write of it).
    checked_at: Mapped[datetime] = mapped_column(default=utcnow)


class ArrayFile(Base):
    """An array file that committed datasets refer to (by ``sha256``), and its lock.

    An upload upserts the row in the transaction that inserts its dataset; a release
    (after a delete, or the orphan sweep) locks it, counts the datasets that refer to the
    file and removes the file only when none does (:mod:`service.storage.array_refs`).
    """

    __tablename__ = "array_files"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    n_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class IdempotencyKey(Base):
    """A request made under an ``Idempotency-Key`` header: what it was, and its answer.

    Committed ``in_flight`` (with ``attempt``, the token of the request holding it)
    before the write starts, so a concurrent retry sees it; set ``done`` with its
    answer in the transaction of the write itself, so the answer exists exactly when
    the write was applied. ``fingerprint`` is the sha256 of the request (route, path
    and query parameters, body digest): a retry with the same key and fingerprint gets
    the stored answer, another request with the key is refused. Rows from before
    fingerprints have none (feedback posts, judged by route and model). Keys are per
    namespace and expire (:mod:`service.storage.idempotency`).
    """

    __tablename__ = "idempotency_keys"
    __table_args__ = (CheckConstraint(_in("state", IDEMPOTENCY_STATES), name="state"),)

    namespace: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    #: The method and route template, ``POST /v1/models/{model}/datasets``.
    route: Mapped[str] = mapped_column(String(255))
    fingerprint: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[str | None] = mapped_column(String(32))
    #: The answer: status, JSON body and the headers a replay repeats (``Location``);
    #: None while in flight.
    status_code: Mapped[int | None]
    response: Mapped[dict[str, Any] | None]
    headers: Mapped[dict[str, Any] | None]
    #: When the row was claimed (or taken over): its lease and its lifetime start here.
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class FeedbackLoop(Base):
    """A model's recalibration loop settings: one row once the model opted in (no row:
    feedback rows are not kept, no run starts). Defaults:
    :data:`service.vocabulary.LOOP_DEFAULTS`."""

    __tablename__ = "feedback_loops"
    __table_args__ = (
        CheckConstraint("retention_rows >= 1", name="retention_rows"),
        CheckConstraint("retention_days >= 1", name="retention_days"),
        CheckConstraint("holdout > 0 AND holdout < 1", name="holdout"),
        CheckConstraint("margin >= 0", name="margin"),
    )

    model_id: Mapped[int] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), primary_key=True
    )
    #: Keep the rows of every feedback post (scores as posted and labels), bounded.
    keep_feedback: Mapped[bool] = mapped_column(default=True, server_default=true())
    retention_rows: Mapped[int] = mapped_column(
        BigInteger, server_default=str(LOOP_DEFAULTS["retention_rows"])
    )
    retention_days: Mapped[int] = mapped_column(
        server_default=str(LOOP_DEFAULTS["retention_days"])
    )
    holdout: Mapped[float] = mapped_column(Float, server_default=str(LOOP_DEFAULTS["holdout"]))
    margin: Mapped[float] = mapped_column(Float, server_default=str(LOOP_DEFAULTS["margin"]))
    #: Move the default alias to a candidate that beats production by the margin.
    auto_promote: Mapped[bool] = mapped_column(default=False, server_default=false())
    #: Start a run when a feedback post finds the served version drifted.
    on_drift: Mapped[bool] = mapped_column(default=False, server_default=false())
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class FeedbackBatch(Base):
    """The rows of one feedback post, kept under the model's loop settings.

    Scores as posted (their kind and dtype) and labels, each an ``.npy`` image: a post is
    written and dropped whole, so a batch is the unit of retention. ``n_bytes`` (both
    images) counts against the namespace's ``stored_bytes`` quota.
    """

    __tablename__ = "feedback_batches"
    __table_args__ = (CheckConstraint(_in("kind", KINDS), name="kind"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), index=True
    )
    #: The number of the version that served the rows (for the record; rows are raw scores).
    version: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    n_rows: Mapped[int]
    scores: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    labels: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    n_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class LoopRun(Base):
    """One run of the recalibration loop: a candidate fitted on the kept rows, compared
    with the version production served when the run started, promoted or not."""

    __tablename__ = "loop_runs"
    __table_args__ = (
        CheckConstraint(_in("trigger", LOOP_TRIGGERS), name="trigger"),
        CheckConstraint(_in("state", LOOP_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), index=True
    )
    trigger: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    #: The version the default alias pointed at when the run started (by id: promotion
    #: moves the alias only if it still points there) and its number.
    production_id: Mapped[int | None] = mapped_column(
        ForeignKey("calibrator_versions.id", ondelete="SET NULL")
    )
    production_version: Mapped[int]
    #: The candidate's version (its fit is the run's job).
    candidate_id: Mapped[int | None] = mapped_column(
        ForeignKey("calibrator_versions.id", ondelete="SET NULL"), index=True
    )
    candidate_version: Mapped[int]
    #: The settings the run was started under.
    margin: Mapped[float] = mapped_column(Float)
    auto_promote: Mapped[bool]
    #: The paired comparison on the held-back rows (:func:`service.jobs.loop.compare`).
    comparison: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class LoopEvent(Base):
    """One step of a run (:data:`service.vocabulary.LOOP_STEPS`), with its figures."""

    __tablename__ = "loop_events"
    __table_args__ = (CheckConstraint(_in("step", LOOP_STEPS), name="step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), index=True
    )
    run_id: Mapped[int] = mapped_column(ForeignKey("loop_runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[str] = mapped_column(String(16))
    #: One sentence: what happened and why.
    message: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


def _json_dumps(obj: Any) -> str:
    # orjson: exact float round trip, numpy scalars/arrays, NaN -> null (valid JSON).
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def json_bytes(obj: Any) -> int:
    """Bytes of ``obj`` as a JSON column stores it (UTF-8)."""
    return len(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY))


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    # WAL: the API reads while a fit worker (another process) writes progress.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


#: ``application_name`` of the service's PostgreSQL connections (pg_stat_activity), unless
#: the URL names one.
APPLICATION_NAME = "welltempered"
#: Seconds a new PostgreSQL connection may take (libpq's connect_timeout): a database
#: that does not answer is a 503 within this time, not a request hanging for minutes.
CONNECT_TIMEOUT_SECONDS = 10


def make_engine(url: str, application_name: str = APPLICATION_NAME) -> Engine:
    """An engine with the service's JSON codec; SQLite gets WAL and a busy timeout.

    PostgreSQL connections are checked when they leave the pool (``pool_pre_ping``: a
    connection the server dropped while idle is replaced, not handed to a request), take
    at most :data:`CONNECT_TIMEOUT_SECONDS` to open, and carry ``application_name`` (a
    URL's own ``application_name`` wins). Every engine reports its transactions to the
    write log of the current request (:func:`service.storage.retry.track_writes`).
    """
    kwargs: dict[str, Any] = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}
    parsed = make_url(url)
    if url.startswith("sqlite"):
        database = parsed.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
    else:
        kwargs["pool_pre_ping"] = True
        if parsed.get_backend_name() == "postgresql":
            connect_args: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
            if "application_name" not in parsed.query:
                connect_args["application_name"] = application_name
            kwargs["connect_args"] = connect_args
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    track_writes(engine)
    return engine
