"""Service settings, read from ``WELLTEMPERED_*`` environment variables.

Nothing reads the environment at import time: :func:`service.app.create_app`
takes a :class:`Settings`, and only the entry points (CLI, ``app_from_env``,
Alembic's ``env.py``) build one from the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Every knob of ``welltempered serve``; the variable is ``WELLTEMPERED_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="WELLTEMPERED_", extra="ignore")

    database_url: str = Field(
        "sqlite:///welltempered.sqlite3",
        description="SQLAlchemy URL: sqlite:///file.sqlite3 or postgresql+psycopg://user@host/db.",
    )
    data_dir: Path = Field(
        Path("welltempered-data"),
        description="Where dataset arrays live, as content-addressed .npy files.",
    )
    max_body_bytes: int = Field(
        1024 * MiB,
        gt=0,
        description="Largest request body for dataset uploads and binary predict (.npy, .npz).",
    )
    max_json_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="Largest JSON body (uploads and predict): use .npz/.npy for big arrays.",
    )
    max_metadata_bytes: int = Field(
        1 * MiB, gt=0, description="Largest body for the other endpoints (model, fit, alias)."
    )
    fit_workers: int = Field(1, ge=1, description="Background fits that run at the same time.")
    fit_executor: Literal["process", "thread"] = Field(
        "process",
        description="'process': fits run in worker processes (API stays responsive); "
        "'thread': in threads of the serve process.",
    )
    fit_threads: int | None = Field(
        None,
        ge=1,
        description="BLAS/OpenMP threads of each fit worker (default: half the cores, at "
        "least 1, so a fit leaves cores to the API; measured in the README).",
    )
    onnx_threads: int = Field(1, ge=1, description="ONNX Runtime intra-op threads per session.")
    onnx_cache_size: int = Field(64, ge=1, description="ONNX Runtime sessions kept per process.")
    alias_cache_seconds: float = Field(
        1.0,
        ge=0,
        description="How long predict trusts its cached alias -> version (a PUT in the same "
        "process applies at once; other worker processes see it within this time).",
    )
    inline_predict_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Predict bodies up to this size are computed on the event loop (cheaper "
        "than a thread hop); larger ones in the thread pool.",
    )
    progress_interval_seconds: float = Field(
        0.5, ge=0, description="Smallest interval between two progress writes of a fit."
    )
    recover_jobs: bool = Field(
        True,
        description="On startup, mark fits left queued/running by a dead process as failed.",
    )

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
