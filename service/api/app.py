"""The FastAPI application: ``create_app(settings)``; nothing is built at import time."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from sqlalchemy.orm import sessionmaker

from service.api import auth, docs, openapi
from service.api.deps import AppState
from service.api.routers import (
    aliases,
    calibrators,
    compare,
    datasets,
    health,
    keys,
    label_shift,
    loop,
    models,
    monitoring,
    predict,
    v2,
)
from service.jobs.dataset_metrics import MetricsFiller
from service.jobs.queue import Fits
from service.jobs.sweeper import Sweeper
from service.observe.access import AccessLog
from service.observe.label_shift import HoldoutCache
from service.observe.metrics import ServiceMetrics
from service.observe.monitoring import (
    observe_array_cache,
    observe_finished_fit,
)
from service.observe.served import Flusher, ServedCounts
from service.server import budget, problems
from service.server.faults import DatabaseFaultMiddleware
from service.server.hotpath import ServingApp
from service.server.requests import MetricsMiddleware
from service.server.timeouts import BodyTimeoutMiddleware
from service.serving.inference import ServingCache, SessionCache
from service.settings import Settings
from service.storage import array_refs
from service.storage.arrays import ArrayStore
from service.storage.db import make_engine
from service.storage.migrate import ensure_schema


def create_app(settings: Settings | None = None, metrics: ServiceMetrics | None = None) -> FastAPI:
    """The service. The lifespan connects, checks the schema, recovers jobs, starts the pool.

    ``metrics`` defaults to a new :class:`ServiceMetrics` (which reads
    ``PROMETHEUS_MULTIPROC_DIR`` now, and raises if it contradicts prometheus_client's
    mode); the app hands it to everything that observes events.
    """
    settings = settings if settings is not None else Settings()
    metrics = metrics if metrics is not None else ServiceMetrics()
    access = AccessLog() if settings.access_log else None  # standard output

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.mark_dead_workers()  # metric files of workers killed without a shutdown
        engine = make_engine(settings.database_url)
        try:
            ensure_schema(
                engine, settings.database_url, settings.startup_database_wait_seconds
            )
            sessions = sessionmaker(engine, expire_on_commit=False)
            arrays = ArrayStore(
                settings.data_dir, settings.array_store, settings.array_cache_bytes
            )
            arrays.ensure()
            if settings.recover_jobs and settings.is_sqlite:
                # The only process of this database file, nothing in flight yet: every
                # orphan goes, however young. (PostgreSQL: other replicas may be
                # uploading; the periodic sweep's grace period applies.)
                array_refs.sweep(sessions, arrays, grace_seconds=0)
            fits = Fits(
                settings,
                sessions,
                functools.partial(observe_finished_fit, metrics, sessions),
                functools.partial(observe_array_cache, metrics),
            )
            onnx = SessionCache(settings.onnx_threads, settings.onnx_cache_size)
            serving = ServingCache(sessions, onnx, settings.alias_cache_seconds)
            limiter = anyio.CapacityLimiter(settings.predict_threads or os.cpu_count() or 1)
            served_counts = ServedCounts(settings.feedback_bucket_seconds)
            filler = MetricsFiller(sessions, arrays, settings.sweep_interval_seconds).start()
            app.state.welltempered = AppState(
                settings, engine, sessions, arrays, fits, serving, metrics, limiter,
                served_counts, HoldoutCache(), filler,
            )
            flusher = Flusher(served_counts, sessions, settings.served_flush_seconds).start()
            sweeper = None
            if settings.sweep_interval_seconds > 0:
                sweeper = Sweeper(
                    sessions,
                    arrays,
                    settings.sweep_interval_seconds,
                    settings.orphan_grace_seconds,
                ).start()
            await fits.start()
            try:
                yield
            finally:
                if sweeper is not None:
                    sweeper.stop()
                filler.stop()
                await fits.stop()
                flusher.stop()
        finally:
            engine.dispose()
            metrics.mark_process_dead()
            if access is not None:
                access.flush()

    app = ServingApp(
        title="welltempered",
        summary="Fit, compare, promote and serve post-hoc calibrators.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # service.api.docs serves them, with their assets
        redoc_url=None,
        generate_unique_id_function=openapi.operation_id,
    )
    problems.install(app)
    docs.install(app)  # open, like /openapi.json: before auth
    # predict first, on the app itself (matched first: the hot path), authorising
    # inline; then the auth dependency, which every route added later gets.
    predict.install(app)
    v2.install(app)  # the Open Inference Protocol, its infer authorising inline too
    auth.install(app, settings, on_rate_limited=metrics.observe_rate_limited)
    openapi.install(app)  # problem+json errors and Bearer auth in /openapi.json
    # Innermost first: a database fault is replayed (reads) or answered 503 inside the
    # body guards, and every answer of theirs (503, 413, 408) is counted.
    app.add_middleware(DatabaseFaultMiddleware)
    # Every route's body, encoding and answer limits (service.server.budget); a route that
    # declares none is refused below, when the routers are in.
    app.add_middleware(
        budget.BudgetMiddleware,
        default=budget.UNROUTED.resolve(settings),
        routes=lambda: app.routes,
    )
    app.add_middleware(
        BodyTimeoutMiddleware,
        idle=settings.body_timeout_seconds,
        min_rate=settings.body_min_bytes_per_second,
    )
    # Outermost: 413s and 401s are counted and logged too.
    app.add_middleware(MetricsMiddleware, metrics=metrics, access=access)
    for module in (
        models, datasets, compare, calibrators, aliases, keys, monitoring, label_shift, loop,
        health,
    ):
        app.include_router(module.router)
    budget.attach(app.routes, settings)
    return app


def app_from_env() -> FastAPI:
    """For ``uvicorn --factory service.api.app:app_from_env`` (settings from the environment)."""
    return create_app(Settings())
