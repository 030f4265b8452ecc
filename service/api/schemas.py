"""Request and response bodies (pydantic), i.e. the API's contract in /docs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from calibrators.holdout import DEFAULT_HOLDOUT
from service.storage.db import as_utc
from service.vocabulary import (
    ARGMAX_POLICIES,
    AUTO,
    DEFAULT_ARGMAX_POLICY,
    KINDS,
    MAX_ID,
    METHODS,
    NAME_PATTERN,
    STATUSES,
)

# The closed lists of service.vocabulary as types: Literal[("a", "b")] is Literal["a", "b"].
Method = Literal[METHODS]  # type: ignore[valid-type]
Status = Literal[STATUSES]  # type: ignore[valid-type]
Kind = Literal[KINDS]  # type: ignore[valid-type]
ArgmaxPolicy = Literal[ARGMAX_POLICIES]  # type: ignore[valid-type]


class Out(BaseModel):
    """Base of the response bodies: datetimes go out in UTC."""

    @field_serializer("*", when_used="json", check_fields=False)
    def _utc(self, value: Any) -> Any:
        return as_utc(value) if isinstance(value, datetime) else value


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="URL-safe, unique.")
    num_classes: int = Field(ge=2, le=1_000_000)
    class_names: list[str] | None = Field(None, description="One per class, in order.")
    argmax_policy: ArgmaxPolicy = Field(
        DEFAULT_ARGMAX_POLICY,
        description="require: a calibrator that changes any held-out predicted class is "
        "stored 'rejected' and cannot be aliased; warn: allowed with a warning; off: allowed.",
    )

    @model_validator(mode="after")
    def _names(self) -> ModelCreate:
        if self.class_names is not None:
            if len(self.class_names) != self.num_classes:
                raise ValueError(
                    f"class_names must have num_classes={self.num_classes} entries. "
                    f"Got {len(self.class_names)}."
                )
            if len(set(self.class_names)) != len(self.class_names):
                raise ValueError("class_names must be distinct.")
        return self


class ModelOut(Out):
    name: str
    num_classes: int
    class_names: list[str] | None
    argmax_policy: str
    created_at: datetime


class ModelList(BaseModel):
    models: list[ModelOut]


class DatasetOut(Out):
    id: int
    model: str
    n: int = Field(description="Rows (N).")
    k: int = Field(description="Classes (K).")
    kind: Kind
    dtype: str
    sha256: str = Field(description="sha256 over the kind and the stored .npy arrays.")
    created_at: datetime
    metrics: dict[str, Any] | None = Field(
        None, description="calibrators.metrics.report of the raw scores."
    )


class DatasetList(BaseModel):
    datasets: list[DatasetOut]


class FitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_id: int = Field(ge=1, le=MAX_ID)
    method: Method = AUTO
    holdout: float = Field(
        DEFAULT_HOLDOUT, gt=0, lt=1,
        description="Share of rows held out to evaluate (and police argmax)."
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the holdout permutation.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of calibrators.create(method, ...); for 'auto', "
        'keyed by method: {"matrix": {...}}.',
    )


class FitAccepted(BaseModel):
    model: str
    version: int
    status: Status
    status_url: str


class VersionOut(Out):
    model: str
    version: int
    status: Status
    progress: float
    dataset_id: int
    method: str
    chosen_method: str | None
    holdout: float
    seed: int
    options: dict[str, Any]
    params: dict[str, Any] | None = Field(
        None, description="Exactly what calibrators.from_params accepts."
    )
    metrics: dict[str, Any] | None = Field(
        None, description="Held-out metrics: {'before': raw scores, 'after': calibrated}."
    )
    argmax: dict[str, Any] | None = None
    candidates: dict[str, Any] | None = None
    warning: str | None = None
    error: str | None = None
    fit_seconds: float | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class VersionSummary(Out):
    version: int
    status: Status
    method: str
    chosen_method: str | None
    dataset_id: int
    created_at: datetime
    finished_at: datetime | None


class VersionList(BaseModel):
    calibrators: list[VersionSummary]


class AliasPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=MAX_ID)


class AliasOut(Out):
    model: str
    alias: str
    version: int
    updated_at: datetime


class AliasList(BaseModel):
    aliases: list[AliasOut]
