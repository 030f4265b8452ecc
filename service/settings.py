"""Service settings, read from ``WELLTEMPERED_*`` environment variables.

Nothing reads the environment at import time: :func:`service.api.app.create_app`
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
    array_store: str | None = Field(
        None,
        description="Where dataset arrays live: a folder (in a fleet, a volume every replica "
        "and worker mounts at the same path) or a URL fsspec opens (s3://bucket/prefix, "
        "gs://..., local:///path; pip install 'welltempered[object-store]' and the backend). "
        "Default: <data_dir>/arrays. Temp files and read caches stay in data_dir.",
    )
    array_cache_bytes: int = Field(
        4 * 1024 * MiB,
        ge=0,
        description="With an object-store array_store: the most bytes of the read copies "
        "under <data_dir>/cache, shared by every process using that data_dir. The least "
        "recently used copies not being read go first; an array that does not fit is read "
        "without being kept (0: nothing is kept). Default: twice QUOTA_STORED_BYTES's "
        "default, the arrays of two full namespaces.",
    )
    max_body_bytes: int = Field(
        1024 * MiB,
        gt=0,
        description="Largest request body for dataset uploads and binary predict (.npy, .npz).",
    )
    max_json_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="Largest JSON body (uploads, predict, calibrator imports): use .npz/.npy "
        "for big arrays.",
    )
    max_model_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="Largest classifier ONNX file POST .../calibrators/{version}/fuse takes "
        "(fusing holds a few copies of it in memory).",
    )
    max_fused_bytes: int = Field(
        128 * MiB,
        gt=0,
        description="Largest fused ONNX model that route answers: the classifier plus the "
        "calibrator's graph.",
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
        "least 1, so a fit leaves cores to the API; see bench/README.md).",
    )
    fit_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Memory one fit may use, its scores included. A fit estimated above it "
        "is refused at submission (422 fit-too-large); an 'auto' fit skips the candidates "
        "above it. Default: half the machine's physical memory divided by fit_workers.",
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
    predict_threads: int = Field(
        0,
        ge=0,
        description="Predictions computed in the thread pool at once (bodies over "
        "inline_predict_bytes); 0: one per CPU. More add memory (each holds its batch's "
        "intermediate arrays) and no speed once the cores are busy; others wait their turn.",
    )
    progress_interval_seconds: float = Field(
        0.5, ge=0, description="Smallest interval between two progress writes of a fit."
    )
    recover_jobs: bool = Field(
        True,
        description="SQLite: on startup, queue again the fits a dead process left running "
        "(`serve` does it once before its workers start). PostgreSQL: unused (workers that "
        "die are detected by their heartbeats).",
    )
    # -- fit jobs (service/jobs/; docs/operations.md, "Scaling") --
    run_fits: bool = Field(
        True,
        description="Whether this serve process runs fits. false: API only (PostgreSQL: "
        "`welltempered worker` processes run them; SQLite: fits stay queued).",
    )
    max_queued_fits_per_namespace: int = Field(
        16,
        ge=1,
        description="Fits queued or running in one namespace beyond which its new ones are "
        "refused with 429 and Retry-After.",
    )
    max_running_fits_per_namespace: int = Field(
        2,
        ge=1,
        description="Fits of one namespace running at once, fleet-wide; the others wait, "
        "and other namespaces' fits go first (round-robin).",
    )
    fit_max_attempts: int = Field(
        5,
        ge=1,
        description="Attempts of one fit (its workers died or were stopped) after which it "
        "is marked failed.",
    )
    fit_grace_seconds: float = Field(
        10.0,
        ge=0,
        description="On a clean stop of a process that runs fits, how long running fits "
        "may go on; then they are stopped and handed back to the queue (never failed).",
    )
    worker_heartbeat_seconds: float = Field(
        10.0, gt=0, description="Interval of a fit worker's heartbeat (PostgreSQL)."
    )
    worker_stalled_seconds: float = Field(
        30.0,
        gt=0,
        description="A fit worker silent for this long is presumed dead: its fits are "
        "retried by another worker (PostgreSQL).",
    )
    # -- monitoring (service/observe/monitoring.py, docs/operations.md) --
    feedback_bucket_seconds: int = Field(
        60,
        ge=1,
        le=86_400,
        description="Width of the time buckets feedback statistics are summed into: the "
        "resolution of a monitoring window.",
    )
    monitoring_window_seconds: int = Field(
        3600,
        ge=1,
        description="Window of the welltempered_live_* gauges of /metrics (and the default "
        "window of GET /v1/models/{model}/monitoring).",
    )
    served_flush_seconds: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="How often each serve process adds the predicted-class counts of the rows "
        "it served to the database (label shift): a window misses at most this much of the "
        "latest rows, and a killed process loses that much.",
    )
    # -- security and limits (service/security/auth.py, docs/security.md) --
    auth: Literal["on", "off"] = Field(
        "on",
        description="'on': every /v1 route needs an API key (Authorization: Bearer). 'off': "
        "no keys, everything in namespace 'default' (serve then binds to loopback only).",
    )
    key_cache_seconds: float = Field(
        5.0,
        ge=0,
        description="How long a process trusts a looked-up API key (a revocation takes "
        "effect within this time; expiry is checked on every request).",
    )
    max_predict_rows: int = Field(100_000, ge=1, description="Most rows in one predict.")
    max_feedback_rows: int = Field(
        100_000, ge=1, description="Most labelled rows in one feedback request."
    )
    rate_limit_per_second: float = Field(
        0.0,
        ge=0,
        description="Sustained requests per second allowed to one API key in one process "
        "(0: no limit). Requests over it get 429 with Retry-After.",
    )
    rate_limit_burst: int = Field(
        200, ge=1, description="Requests one API key may make at once (the bucket's capacity)."
    )
    max_dataset_rows: int = Field(
        1_000_000,
        ge=1,
        description="Most rows in one dataset (the dataset_rows quota, 413 past it): 20 times "
        "ImageNet's validation set; a 467 KB .npz of zeros can declare 10,000,000.",
    )
    max_classes: int = Field(
        262_144,
        ge=2,
        description="Largest num_classes (K) of a model: 262,144 holds the largest language-"
        "model vocabularies (Gemma 3). Each request is bounded by its bytes and rows, not by "
        "K; the fit cost guard (FIT_MEMORY_BYTES) refuses methods that cannot fit K at "
        "submission.",
    )
    max_queued_fits: int = Field(
        256,
        ge=1,
        description="Fits queued or running in all namespaces beyond which a new one is "
        "refused with 429 and Retry-After (the per-namespace limit comes first).",
    )
    startup_database_wait_seconds: float = Field(
        30.0,
        ge=0,
        description="How long a starting process keeps trying the database after a "
        "transient failure (a refused or cut connection) before it gives up; under "
        "several workers, one whose start fails stops the whole server.",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight requests may take to finish "
        "(uvicorn --timeout-graceful-shutdown).",
    )

    # -- quotas and storage lifecycle (service/storage/usage.py, array_refs.py; docs/api.md) --
    quota_stored_bytes: int = Field(
        2 * 1024 * MiB,
        ge=1,
        description="Bytes one namespace may store: the .npy files of its datasets (each "
        "dataset counted in full even when its content is shared) and the parameters of its "
        "calibrator versions (as stored JSON, fit_info included). An upload or an import "
        "past it is refused with 409 quota-exceeded (413 if it alone is larger). Default: "
        "twice MAX_BODY_BYTES's default, room for the largest upload and more.",
    )
    quota_datasets: int = Field(
        100, ge=1, description="Datasets one namespace may hold (409 quota-exceeded past it)."
    )
    quota_models: int = Field(
        100, ge=1, description="Models one namespace may hold (409 quota-exceeded past it)."
    )
    quota_versions: int = Field(
        1000,
        ge=1,
        description="Calibrator versions one model may hold, fitted and imported, whatever "
        "their status (409 quota-exceeded past it; deleting a version makes room). Default: "
        "a refit a day for almost three years.",
    )
    orphan_grace_seconds: float = Field(
        3600.0,
        ge=0,
        description="Age after which an array file no dataset refers to (an upload that "
        "never committed, a delete interrupted) and a temp file are removed by the sweep; "
        "younger ones may belong to an upload in flight.",
    )
    sweep_interval_seconds: float = Field(
        3600.0,
        ge=0,
        description="How often each serve process sweeps orphan array files (0: only at "
        "start-up and with `welltempered gc`).",
    )
    # -- exposure and slow clients (service/server/exporter.py, timeouts.py; docs/operations.md) --
    metrics_address: str = Field(
        "127.0.0.1:9464,9475-9483",
        description="host:port, or host:ports (a port, first-last, or several joined by "
        "commas), of the metrics listener started by `welltempered serve` (GET /metrics "
        "without a key, every namespace's series): keep it on loopback or an internal "
        "network. With several ports each serve takes its first free one (the log says "
        "which): the default's 9464 first, then 9475-9483, past the workers' 9465-9474, so "
        "up to ten servers of a host share it. A single port is that port or a refusal to "
        "start. Empty: no listener (scrape the API's /metrics with a metrics key).",
    )
    worker_metrics_address: str = Field(
        "127.0.0.1:9465-9474",
        description="host:port, or host:ports as for metrics_address, of the metrics "
        "listener of `welltempered worker` (GET /metrics without a key: the fits it ran, "
        "its array read cache, no database gauges and no tenant data). With a range each worker "
        "takes its first free port (the log says which), so workers on one host share the "
        "default; a single port is that port or a refusal to start. Empty: no listener.",
    )
    http_parser: Literal["httptools", "h11"] = Field(
        "httptools",
        description="HTTP/1.1 parser of `welltempered serve` and the metrics listener: "
        "httptools (llhttp, in C) or h11 (uvicorn's pure-Python parser, slower). Both "
        "apply header_timeout_seconds.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="Event loop of `welltempered serve`: uvloop where it is installed "
        "(auto; a runtime dependency except on Windows), or asyncio's own.",
    )
    access_log: bool = Field(
        True,
        description="One line per HTTP request on standard output (time, client, method, "
        "path, status, bytes, microseconds, namespace, key id; docs/operations.md), written "
        "in batches at most a second late. `welltempered serve --no-access-log` sets it "
        "false. uvicorn's own access log is always off.",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="How long a connection may take to send a request's headers (from when "
        "it opens, or from the end of the previous response), and to finish sending a body "
        "after the response; then it is closed.",
    )
    body_timeout_seconds: float = Field(
        20.0,
        gt=0,
        description="Longest wait for the next piece of a request body the service is "
        "reading, and the grace before body_min_bytes_per_second applies; then 408.",
    )
    body_min_bytes_per_second: int = Field(
        500,
        ge=0,
        description="Slowest average rate a request body may arrive at, over the time the "
        "service waits for it beyond body_timeout_seconds (0: no minimum); then 408.",
    )
    idempotency_key_seconds: float = Field(
        86_400.0,
        gt=0,
        description="How long an Idempotency-Key is remembered (feedback, dataset uploads, "
        "fits, imports): a retry of the same request with the key within this time gets "
        "the first answer and is not applied again.",
    )
    idempotency_lease_seconds: float = Field(
        60.0,
        gt=0,
        description="How long a request holding an Idempotency-Key counts as in progress "
        "after its body was read: a request with the key meanwhile is a 409; after it, the "
        "first is presumed lost and a retry takes the key over (the first, if it still "
        "ends, is rolled back).",
    )

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
