"""Request and response bodies (pydantic), i.e. the API's contract in /docs."""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    WithJsonSchema,
    model_validator,
)

from calibrators.evaluation.holdout import DEFAULT_HOLDOUT
from service.api.fit_options import OPTIONS_SCHEMA
from service.api.pagination import NextCursor
from service.storage.db import as_utc
from service.vocabulary import (
    ARGMAX_POLICIES,
    AUTO,
    DEFAULT_ARGMAX_POLICY,
    KEY_STATES,
    KINDS,
    LOOP_DEFAULTS,
    LOOP_STATES,
    LOOP_STEPS,
    LOOP_TRIGGERS,
    MAX_CLASS_NAME_CHARS,
    MAX_CLASS_NAMES_BYTES,
    MAX_DESCRIPTION_CHARS,
    MAX_ID,
    MAX_KEY_DESCRIPTION_CHARS,
    MAX_LOOP_HOLDOUT,
    MAX_LOOP_MARGIN,
    MAX_RETENTION_DAYS,
    METHODS,
    MIN_LOOP_HOLDOUT,
    NAME_PATTERN,
    REJECTION_REASONS,
    SCOPES,
    SCORE_DTYPES,
    STATUSES,
    TENANT_SCOPES,
    VERSION_SOURCES,
    check_names,
    check_text,
)

# The closed lists of service.vocabulary as types: Literal[("a", "b")] is Literal["a", "b"].
Method = Literal[METHODS]  # type: ignore[valid-type]
Status = Literal[STATUSES]  # type: ignore[valid-type]
Kind = Literal[KINDS]  # type: ignore[valid-type]
#: ``?dtype=`` of a binary body (read by service.api.codecs).
ScoreDtype = Literal[SCORE_DTYPES]  # type: ignore[valid-type]
ArgmaxPolicy = Literal[ARGMAX_POLICIES]  # type: ignore[valid-type]
Scope = Literal[SCOPES]  # type: ignore[valid-type]
#: What an admin key may create over HTTP: a metrics key is the operator's (the CLI's).
TenantScope = Literal[TENANT_SCOPES]  # type: ignore[valid-type]
KeyState = Literal[KEY_STATES]  # type: ignore[valid-type]
VersionSource = Literal[VERSION_SOURCES]  # type: ignore[valid-type]
RejectionReason = Literal[REJECTION_REASONS]  # type: ignore[valid-type]


#: A stored time: ISO 8601 in UTC on the wire (SQLite gives naive datetimes back).
Timestamp = Annotated[datetime, PlainSerializer(as_utc, return_type=datetime, when_used="json")]


def _text(what: str, max_chars: int) -> Any:
    """Free text a tenant stores and the service echoes: checked by
    :func:`service.vocabulary.check_text` (documented with its limit)."""
    return Annotated[
        str,
        AfterValidator(partial(check_text, what=what, max_chars=max_chars)),
        Field(json_schema_extra={"maxLength": max_chars}),
    ]


#: A model's class names, checked by :func:`service.vocabulary.check_names`.
ClassNames = Annotated[
    list[
        Annotated[str, Field(json_schema_extra={"minLength": 1, "maxLength": MAX_CLASS_NAME_CHARS})]
    ],
    AfterValidator(check_names),
]
_CLASS_NAMES = (
    f"One per class, in order, distinct; each one line of at most {MAX_CLASS_NAME_CHARS} "
    f"characters, {MAX_CLASS_NAMES_BYTES} bytes of UTF-8 in all (docs/api.md)."
)
ModelDescription = _text("description", MAX_DESCRIPTION_CHARS)
KeyDescription = _text("description", MAX_KEY_DESCRIPTION_CHARS)


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="URL-safe, unique.")
    num_classes: int = Field(ge=2, le=1_000_000)
    class_names: ClassNames | None = Field(None, description=_CLASS_NAMES)
    argmax_policy: ArgmaxPolicy = Field(
        DEFAULT_ARGMAX_POLICY,
        description="require: a calibrator that changes any held-out predicted class is "
        "stored 'rejected' and cannot be aliased; warn: allowed with a warning; off: allowed.",
    )
    description: ModelDescription | None = None

    @model_validator(mode="after")
    def _names(self) -> ModelCreate:
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"class_names must have num_classes={self.num_classes} entries. "
                f"Got {len(self.class_names)}."
            )
        return self


class ModelPatch(BaseModel):
    """A change of a model: only the fields given change (JSON merge patch, RFC 7396);
    null clears class_names or the description."""

    model_config = ConfigDict(extra="forbid")

    class_names: ClassNames | None = Field(
        None, description=f"{_CLASS_NAMES} num_classes of them; null removes them."
    )
    argmax_policy: ArgmaxPolicy | None = Field(
        None,
        description="Applies to fits that start from now on; a version keeps the outcome "
        "of the policy it was fitted under (refit to apply a new policy).",
    )
    description: ModelDescription | None = None

    @model_validator(mode="after")
    def _fields(self) -> ModelPatch:
        if "argmax_policy" in self.model_fields_set and self.argmax_policy is None:
            raise ValueError("argmax_policy cannot be null: give require, warn or off.")
        return self

    def changes(self) -> dict[str, Any]:
        """The columns this patch sets (the fields given, nulls included)."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class ModelOut(BaseModel):
    name: str
    num_classes: int
    class_names: list[str] | None
    argmax_policy: ArgmaxPolicy
    description: str | None = None
    created_at: Timestamp
    updated_at: Timestamp | None = None


class ModelList(BaseModel):
    models: list[ModelOut]
    next_cursor: NextCursor = None


class DatasetOut(BaseModel):
    id: int
    model: str
    n: int = Field(description="Rows (N).")
    k: int = Field(description="Classes (K).")
    kind: Kind
    dtype: str
    sha256: str = Field(description="sha256 over the kind and the stored .npy arrays.")
    n_sequences: int | None = Field(
        None,
        description="Distinct sequence ids (texts) when the rows carry them: every hold-out "
        "split is then by sequence. Null: the rows are independent.",
    )
    labelled: bool = Field(
        True,
        description="Whether the rows carry labels. A dataset without labels serves "
        "label-free fits only (an entropy target: temperature with target_entropy, "
        "row-entropy).",
    )
    format: Literal["scores", "topk"] = Field(
        "scores",
        description="scores: full (N, K) scores. topk: top-k log-probabilities of a "
        "language model's tokens (calibrators.topk): k is then the vocabulary size V and "
        "top_k the width of the rows; fitted by temperature only, served top-k in and out.",
    )
    top_k: int | None = Field(None, description="The width k of top-k rows (format topk).")
    created_at: Timestamp
    metrics: dict[str, Any] | None = Field(
        None,
        description="calibrators.evaluation.metrics.report of the raw scores (with "
        "sequence ids, plus 'sequences': the NLL per token and per sequence); without "
        "labels, calibrators.evaluation.entropy.entropy_report (the rows' entropies); top-k "
        "rows, calibrators.topk.report as given (beta 1, the decay tail). Null in lists, "
        "and while the metrics of a dataset of over 4,194,304 scores are being "
        "computed after its upload's answer.",
    )


class DatasetList(BaseModel):
    datasets: list[DatasetOut]
    next_cursor: NextCursor = None


class FitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_id: int = Field(ge=1, le=MAX_ID)
    method: Method = AUTO
    holdout: float = Field(
        DEFAULT_HOLDOUT,
        gt=0,
        lt=1,
        description="Share of rows held out to evaluate (and police argmax).",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the holdout permutation.")
    options: Annotated[dict[str, Any], WithJsonSchema(OPTIONS_SCHEMA)] = Field(
        default_factory=dict,
        description="Keyword options of calibrators.create(method, ...); for 'auto', "
        'keyed by method: {"matrix": {...}}.',
    )
    refit: StrictBool | None = Field(
        None,
        description="After the hold-out evaluation (and, for 'auto', the choice), fit the "
        "chosen method again on every row of the dataset and serve that. Default: true for "
        "'auto', false for a named method. The version's metrics stay the hold-out "
        "estimate of the method fitted without the held-out rows; its argmax report is "
        "the served calibrator's on the held-out rows.",
    )


class ParamsImport(BaseModel):
    """A calibrator fitted elsewhere: evaluated on a dataset's hold-out and policed by the
    model's argmax policy like a fit, without fitting."""

    model_config = ConfigDict(extra="forbid")

    dataset_id: int = Field(
        ge=1, le=MAX_ID, description="The dataset whose hold-out rows evaluate the calibrator."
    )
    params: dict[str, Any] = Field(
        description="What calibrators' to_params() gives (the 'params' of a method in the "
        "JSON of `welltempered fit --json`): exactly what calibrators.from_params takes."
    )
    holdout: float = Field(
        DEFAULT_HOLDOUT, gt=0, lt=1, description="Share of the dataset's rows held out."
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the holdout permutation.")


class CompareRequest(BaseModel):
    """Two datasets of the model: the scores of two models on the same positions."""

    model_config = ConfigDict(extra="forbid")

    a: int = Field(ge=1, le=MAX_ID, description="Dataset of model A (the one tempered).")
    b: int = Field(ge=1, le=MAX_ID, description="Dataset of model B, on A's positions.")
    top_k: int = Field(10, ge=2, description="B's top classes the rank agreement looks at "
                       "(at most K).")


class Spread(BaseModel):
    mean: float
    median: float
    p95: float


class CompareOut(BaseModel):
    """calibrators.evaluation.pair.temperature_explains of A's and B's scores."""

    model: str
    a: int
    b: int
    n: int
    beta: float | None = Field(
        description="The inverse temperature that brings A closest to B in KL "
        "(null: infinite, B is A's argmax one-hot)."
    )
    kl_before: Spread = Field(description="Per-row KL(B || A), nats.")
    kl_after: Spread | None = Field(description="Per-row KL(B || A tempered by beta).")
    explained: float | None = Field(description="1 - KL after / KL before (means).")
    explained_beyond_flat: float | None = Field(
        description="1 - KL after / KL(B || uniform): the gain over flattening A alone."
    )
    top1_agreement: float
    top_k: int
    discordance: Spread = Field(
        description="Per row, the share of B's top-k class pairs that A orders the other way."
    )


class FitAccepted(BaseModel):
    model: str
    version: int
    status: Status
    status_url: str


class VersionOut(BaseModel):
    model: str
    version: int
    status: Status
    progress: float
    dataset_id: int
    method: str
    kind: Kind = Field(
        description="The kind of scores its params were fitted on. A version of params "
        "format 2 gives one answer per distribution for both kinds; vector and matrix "
        "scaling of format 1 serve this kind only."
    )
    format: Literal["scores", "topk"] | None = Field(
        None,
        description="What it serves once fitted: scores, full (N, K) scores; topk, top-k "
        "rows (its params calibrators.topk.TopKTemperature's, format welltempered.topk/1). "
        "Null until it has params.",
    )
    chosen_method: str | None
    holdout: float
    seed: int
    options: dict[str, Any]
    refit: bool = Field(
        description="Its params were fitted again on every row after the hold-out "
        "evaluation (the fit request's refit)."
    )
    params: dict[str, Any] | None = Field(
        None, description="Exactly what calibrators.from_params accepts."
    )
    metrics: dict[str, Any] | None = Field(
        None, description="Held-out metrics: {'before': raw scores, 'after': calibrated}."
    )
    argmax: dict[str, Any] | None = None
    candidates: dict[str, Any] | None = None
    warning: str | None = None
    rejection: list[str] | None = Field(
        None,
        description="Why this version was rejected (status 'rejected'): one sentence per "
        "candidate method and reason.",
    )
    rejected_for: list[RejectionReason] | None = Field(
        None,
        description="The reasons of a rejection, machine-readable: 'argmax-changed' (the "
        "argmax policy 'require'), 'nll-worse-than-uncalibrated' (its held-out NLL is worse "
        "than the raw scores' beyond the tolerance). Null unless rejected (and for versions "
        "rejected before this field existed, by the argmax policy).",
    )
    error: str | None = None
    source: VersionSource = Field(
        "fit", description="'fit': fitted here; 'params': posted parameters, evaluated here."
    )
    fit_seconds: float | None = None
    attempts: int = Field(
        0,
        description="Attempts started: more than 1 when a worker died or was stopped during "
        "the fit and another one took it over.",
    )
    worker: str | None = Field(None, description="The worker of the last attempt (host:pid:role).")
    created_at: Timestamp
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None


class VersionSummary(BaseModel):
    version: int
    status: Status
    method: str
    chosen_method: str | None
    dataset_id: int
    created_at: Timestamp
    finished_at: Timestamp | None


class VersionList(BaseModel):
    calibrators: list[VersionSummary]
    next_cursor: NextCursor = None


class PredictOut(BaseModel):
    """The JSON answer of predict (documentation: the route serialises it itself)."""

    probabilities: list[list[float]] | None = Field(
        None, description="(n, K) calibrated probabilities; absent with top_k."
    )
    top_k_indices: list[list[int]] | None = Field(
        None, description="With top_k: (n, k) classes, most probable first."
    )
    top_k_probabilities: list[list[float]] | None = Field(
        None, description="With top_k: (n, k) their probabilities."
    )
    labels: list[int] = Field(description="(n) predicted class of each row.")
    confidence: list[float] = Field(description="(n) its probability.")
    entropy: list[float] = Field(description="(n) entropy of each row, in nats.")
    model: str
    version: int = Field(description="The calibrator version that answered.")
    label_names: list[str] | None = Field(
        None, description="When the model has class_names: (n) the name of each label."
    )
    top_k_names: list[list[str]] | None = Field(
        None, description="When the model has class_names, with top_k: (n, k) their names."
    )


class FeedbackOut(BaseModel):
    """What a feedback post recorded."""

    model: str
    version: int = Field(description="The version whose calibration the rows were scored by.")
    rows: int = Field(description="Labelled rows recorded.")
    correct: int = Field(description="Of them, rows whose predicted class is the label.")
    bucket_start: int = Field(description="Unix time of the bucket they were added to.")
    bucket_seconds: int = Field(description="The width of a bucket (FEEDBACK_BUCKET_SECONDS).")
    kept: int = Field(
        0, description="Of them, rows kept for the model's recalibration loop (0 unless it "
        "keeps feedback: PUT /v1/models/{model}/loop)."
    )


_OPTIONAL_FIGURE = partial(Field, None)


class LiveReport(BaseModel):
    """Live calibration over the window, from the feedback's per-bin sums: the keys of
    the hold-out report, those that need the rows themselves null (not_from_aggregates)."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(description="Labelled rows in the window (0: every figure is null).")
    n_classes: int
    accuracy: float | None = _OPTIONAL_FIGURE()
    nll: float | None = _OPTIONAL_FIGURE(description="Mean negative log-likelihood, nats.")
    brier: float | None = _OPTIONAL_FIGURE()
    entropy: float | None = _OPTIONAL_FIGURE(description="Mean entropy, nats.")
    ece: float | None = _OPTIONAL_FIGURE(description="Expected calibration error, n_bins bins.")
    mce: float | None = _OPTIONAL_FIGURE()
    ece_debiased: float | None = _OPTIONAL_FIGURE()
    ece_debiased_lower: float | None = _OPTIONAL_FIGURE()
    ece_debiased_upper: float | None = _OPTIONAL_FIGURE()
    bins: dict[str, Any] = Field(
        description="The reliability bins: edges, count, mean_confidence, accuracy."
    )
    n_bins: int
    interval_level: float
    not_from_aggregates: list[str] = Field(description="Keys that are null here by nature.")


class HoldoutReport(BaseModel):
    """The version's calibrated hold-out figures, measured when it was fitted, with its
    argmax agreement (older versions lack the figures added since)."""

    model_config = ConfigDict(extra="allow")

    n: int
    accuracy: float | None = _OPTIONAL_FIGURE()
    nll: float | None = _OPTIONAL_FIGURE()
    ece: float | None = _OPTIONAL_FIGURE()
    argmax_agreement: float | None = _OPTIONAL_FIGURE()


class DriftVerdict(BaseModel):
    """``calibrators.evaluation.drift.detect_drift`` of the window against the hold-out."""

    model_config = ConfigDict(extra="allow")

    verdict: Literal["ok", "drift", "insufficient_data"]
    method: str
    live_ece: float | None = _OPTIONAL_FIGURE()
    holdout_ece: float | None = _OPTIONAL_FIGURE()
    bound: float | None = _OPTIONAL_FIGURE(description="The live ECE above which it is drift.")
    p_value: float | None = _OPTIONAL_FIGURE()
    n_live: int
    n_holdout: int


class LiveNllQuantiles(BaseModel):
    """The median and p95 of the window's per-row NLL (per token, for a language model),
    read from the fixed histogram each feedback post adds to (``live`` keeps its exact
    ``nll_median`` and ``nll_p95`` null: the rows are not kept)."""

    n: int = Field(description="Rows in the histogram.")
    complete: bool = Field(
        description="Whether every row of the live report is in it (feedback posted before "
        "the histogram was kept is not)."
    )
    median: float | None = _OPTIONAL_FIGURE(description="Nats.")
    p95: float | None = _OPTIONAL_FIGURE(description="Nats.")
    relative_error: float = Field(
        description="Each figure is within this factor of the exact one (above "
        "absolute_error_below nats; below it, within that many nats)."
    )
    absolute_error_below: float


class MonitoringOut(BaseModel):
    """Live calibration of a version over a window, its hold-out figures, and drift."""

    model: str
    version: int
    window: str = Field(description="The window, as given (?window=).")
    window_seconds: int
    since: int = Field(description="Unix time of the window's first bucket.")
    bucket_seconds: int
    live: LiveReport
    live_nll: LiveNllQuantiles
    holdout: HoldoutReport
    drift: DriftVerdict


class ShiftVerdict(BaseModel):
    """``calibrators.evaluation.shift.shift_test``: the served predicted-class counts
    against the hold-out's."""

    verdict: Literal["shift", "no_shift", "insufficient_data"]
    statistic: float | None = _OPTIONAL_FIGURE(description="Pearson's chi-square.")
    df: int | None = None
    p_value: float | None = _OPTIONAL_FIGURE()
    alpha: float
    n: int = Field(description="Served rows in the window.")


class PriorEstimate(BaseModel):
    """``calibrators.evaluation.shift.bbse``: the production class priors, one entry per
    class of ``classes``, with their interval."""

    priors: list[float]
    lower: list[float]
    upper: list[float]
    std: list[float]
    source_priors: list[float] = Field(description="The hold-out's class frequencies.")
    weights: list[float] = Field(
        description="The correction's weights: add-one smoothed priors over source_priors."
    )
    level: float
    n: int
    m: int
    prior_l1_distance: float = Field(
        description="sum |priors - source_priors|: 0 without shift, at most 2."
    )


class LabelShiftOut(BaseModel):
    """The label shift of a version's served rows over a window (BBSE from counts)."""

    model: str
    version: int
    window: str
    window_seconds: int
    since: int = Field(description="Unix time of the window's first bucket.")
    bucket_seconds: int
    classes: list[int] = Field(
        description="The classes estimated: every class up to 1,000 classes; above, the "
        "1,000 most served and -1 for all the others together."
    )
    served_rows: int
    holdout_rows: int
    verdict: ShiftVerdict
    estimate: PriorEstimate | None
    unidentified: str | None = Field(
        None, description="Why there is no estimate (no served rows, a singular confusion "
        "matrix), when there is none."
    )


class AliasPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=MAX_ID)


class AliasOut(BaseModel):
    model: str
    alias: str
    version: int
    updated_at: Timestamp


class AliasList(BaseModel):
    aliases: list[AliasOut]
    next_cursor: NextCursor = None


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: TenantScope
    expires_in_seconds: int | None = Field(
        None, ge=1, le=10 * 365 * 86400, description="Lifetime; none: never expires."
    )
    description: KeyDescription | None = None


class KeyOut(BaseModel):
    id: int
    prefix: str = Field(description="The key's first characters: enough to recognise it.")
    namespace: str
    scope: Scope
    state: KeyState
    description: str | None
    created_at: Timestamp
    expires_at: Timestamp | None


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown in this response only.")


class KeyList(BaseModel):
    keys: list[KeyOut]
    next_cursor: NextCursor = None


class DeletedOut(BaseModel):
    """What a DELETE removed (docs/api.md, "Deleting")."""

    model: str
    datasets: list[int] = Field(description="Ids of the deleted datasets.")
    versions: list[int] = Field(description="Numbers of the deleted calibrator versions.")
    aliases: list[str] = Field(description="Names of the deleted aliases.")
    stored_bytes_released: int = Field(
        description="Bytes of the deleted datasets and versions, no longer counted against "
        "the namespace's stored-bytes quota."
    )


# ---------------------------------------------------------------------------
# the recalibration loop (service.jobs.loop)

LoopState = Literal[LOOP_STATES]  # type: ignore[valid-type]
LoopStep = Literal[LOOP_STEPS]  # type: ignore[valid-type]
LoopTrigger = Literal[LOOP_TRIGGERS]  # type: ignore[valid-type]


class LoopSettings(BaseModel):
    """A model's recalibration loop: the whole setting, each field its default when
    omitted (docs/api.md, "The recalibration loop")."""

    model_config = ConfigDict(extra="forbid")

    keep_feedback: StrictBool = Field(
        True,
        description="Keep the rows of every feedback post (scores and labels), bounded by "
        "the retention, counted in the namespace's stored_bytes quota. false deletes the "
        "rows kept.",
    )
    retention_rows: int = Field(
        LOOP_DEFAULTS["retention_rows"],
        ge=1,
        description="Most rows kept: the oldest posts go first. At most "
        "WELLTEMPERED_MAX_DATASET_ROWS (a run's rows become a dataset).",
    )
    retention_days: int = Field(
        LOOP_DEFAULTS["retention_days"],
        ge=1,
        le=MAX_RETENTION_DAYS,
        description="Days a post is kept.",
    )
    holdout: float = Field(
        LOOP_DEFAULTS["holdout"],
        ge=MIN_LOOP_HOLDOUT,
        le=MAX_LOOP_HOLDOUT,
        description="Share of the kept rows held back from the candidate's fit, on which "
        "it is compared with production.",
    )
    margin: float = Field(
        LOOP_DEFAULTS["margin"],
        ge=0,
        le=MAX_LOOP_MARGIN,
        description="Nats per row by which the candidate's held-back NLL must beat "
        "production's (and the gain's lower 95 % bound must be above 0, and its ECE not "
        "worse beyond noise) to be promoted.",
    )
    auto_promote: StrictBool = Field(
        False,
        description="Move the 'production' alias to a better candidate; false: the "
        "candidate waits for the user (PUT aliases/production).",
    )
    on_drift: StrictBool = Field(
        False,
        description="Start a run when a feedback post served by the 'production' version "
        "finds it drifted (at most one such run per monitoring window).",
    )


class LoopOut(LoopSettings):
    model: str
    kept_rows: int = Field(description="Rows kept now.")
    kept_bytes: int = Field(description="Their bytes, counted in the stored_bytes quota.")
    updated_at: Timestamp | None = Field(description="null: the model never set its loop.")


class LoopRunOut(BaseModel):
    run: int
    trigger: LoopTrigger
    state: LoopState
    production_version: int
    candidate_version: int
    margin: float
    auto_promote: bool
    comparison: dict[str, Any] | None = Field(
        description="The paired comparison on the held-back rows (null while fitting)."
    )
    created_at: Timestamp
    finished_at: Timestamp | None


class LoopRunList(BaseModel):
    runs: list[LoopRunOut]
    next_cursor: NextCursor = None


class LoopStarted(BaseModel):
    model: str
    run: int
    candidate_version: int
    status_url: str = Field(description="The candidate version's URL (its fit's status).")
    events_url: str


class LoopEventOut(BaseModel):
    id: int
    run: int
    step: LoopStep
    message: str
    details: dict[str, Any] | None
    created_at: Timestamp


class LoopEventList(BaseModel):
    events: list[LoopEventOut]
    next_cursor: NextCursor = None
