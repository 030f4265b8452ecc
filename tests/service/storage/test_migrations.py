"""Schema changes are code: migrations match the models, on both backends."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import text

from service.api.app import create_app
from service.settings import Settings
from service.storage import migrate
from service.storage.db import Base, make_engine
from tests.service.helpers import BACKENDS


@pytest.fixture(params=BACKENDS)
def empty_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    return request.getfixturevalue("pg_schema")


def test_models_and_migrations_do_not_drift(empty_url):
    """`alembic check`: upgrade head, then autogenerate must find nothing to do."""
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={
                    "compare_type": True,
                    "compare_server_default": True,
                    "include_name": migrate.include_name,
                },
            )
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; write a revision: {diff}"
    command.check(migrate.alembic_config(empty_url))  # the same, as the CLI runs it


def test_downgrade_and_upgrade_again(empty_url):
    migrate.upgrade(empty_url)
    command.downgrade(migrate.alembic_config(empty_url), "base")
    engine = make_engine(empty_url)
    try:
        assert migrate.current_revision(engine) is None
        migrate.upgrade(empty_url)
        assert migrate.current_revision(engine) == migrate.head_revision(empty_url)
    finally:
        engine.dispose()


def test_sqlite_migrates_itself(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    settings = Settings(database_url=url, data_dir=tmp_path / "data", fit_executor="thread")
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").json()["revision"] == migrate.head_revision(url)


@pytest.mark.postgres
def test_postgres_refuses_to_start_unmigrated(pg_schema, tmp_path):
    settings = Settings(database_url=pg_schema, data_dir=tmp_path / "data", fit_executor="thread")
    with pytest.raises(migrate.NotMigrated, match="welltempered migrate"):
        with TestClient(create_app(settings)):
            pass


def test_upgrading_a_populated_database_keeps_every_row(empty_url):
    """SQLite batch mode recreates tables (DROP + rename): with foreign keys on, dropping
    ``models`` would cascade to every dataset, version and alias (env.py turns them off
    while migrating, and checks them after)."""
    migrate.upgrade(empty_url, "20261202_0002")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for sql in (
                "INSERT INTO models (id, name, num_classes, argmax_policy, next_version, "
                "created_at) VALUES (1, 'm', 3, 'require', 2, '2026-01-01')",
                "INSERT INTO datasets (id, model_id, sha256, kind, n_rows, n_classes, dtype, "
                "scores_sha256, labels_sha256, metrics, created_at) VALUES (1, 1, 'a', "
                "'logits', 10, 3, 'float32', 'b', 'c', '{}', '2026-01-01')",
                "INSERT INTO calibrator_versions (id, model_id, version, dataset_id, method, "
                "holdout, seed, options, status, progress, created_at) VALUES (1, 1, 1, 1, "
                "'temperature', 0.2, 0, '{}', 'succeeded', 1.0, '2026-01-01')",
                "INSERT INTO aliases (model_id, alias, version_id, updated_at) VALUES "
                "(1, 'production', 1, '2026-01-01')",
            ):
                conn.execute(text(sql))
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            counts = [
                conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
                for table in ("models", "datasets", "calibrator_versions", "aliases")
            ]
            n_bytes = conn.execute(text("SELECT n_bytes FROM datasets")).scalar()
    finally:
        engine.dispose()
    assert counts == [1, 1, 1, 1]
    assert n_bytes == 256 + 10 * 8 + 10 * 3 * 4  # estimated by 20261203_0004


def test_version_bytes_are_backfilled_from_the_stored_params(empty_url):
    """20261204_0008: an existing version counts the bytes of its stored params JSON
    (UTF-8), a version without params 0."""
    migrate.upgrade(empty_url, "20261203_0100")
    params = '{"method":"temperature","weight":0.5,"fit_info":{"note":"é"}}'
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for sql in (
                "INSERT INTO models (id, name, num_classes, argmax_policy, next_version, "
                "created_at) VALUES (1, 'm', 3, 'require', 3, '2026-01-01')",
                "INSERT INTO datasets (id, model_id, sha256, kind, n_rows, n_classes, dtype, "
                "scores_sha256, labels_sha256, metrics, created_at) VALUES (1, 1, 'a', "
                "'logits', 10, 3, 'float32', 'b', 'c', '{}', '2026-01-01')",
            ):
                conn.execute(text(sql))
            for version, value in ((1, params), (2, None)):
                conn.execute(
                    text(
                        "INSERT INTO calibrator_versions (id, model_id, version, dataset_id, "
                        "method, holdout, seed, options, status, progress, created_at, "
                        "params) VALUES (:v, 1, :v, 1, 'temperature', 0.2, 0, '{}', "
                        "'succeeded', 1.0, '2026-01-01', :p)"
                    ),
                    {"v": version, "p": value},
                )
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            n_bytes = conn.execute(
                text("SELECT n_bytes FROM calibrator_versions ORDER BY version")
            ).scalars().all()
    finally:
        engine.dispose()
    assert n_bytes == [len(params.encode()), 0]


def test_idempotency_keys_from_before_fingerprints_stay_feedback_answers(empty_url):
    """20261204_0010: a key stored before fingerprints is a feedback post, done,
    answered 200, without a fingerprint; downgrading keeps only such rows."""
    migrate.upgrade(empty_url, "20261203_0100")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO models (id, name, num_classes, argmax_policy, next_version, "
                    "created_at) VALUES (1, 'm', 3, 'require', 1, '2026-01-01')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO idempotency_keys (namespace, key, model_id, response, "
                    "created_at) VALUES ('default', 'old', 1, '{\"rows\": 5}', '2026-01-01')"
                )
            )
        migrate.upgrade(empty_url)
        with engine.begin() as conn:
            row = conn.execute(
                text(
                    "SELECT route, fingerprint, state, status_code FROM idempotency_keys "
                    "WHERE key = 'old'"
                )
            ).one()
            conn.execute(
                text(
                    "INSERT INTO idempotency_keys (namespace, key, model_id, route, state, "
                    "created_at) VALUES ('default', 'new', 1, "
                    "'POST /v1/models/{model}/datasets', 'in_flight', '2026-01-01')"
                )
            )
        command.downgrade(migrate.alembic_config(empty_url), "20261203_0100")
        with engine.connect() as conn:
            keys = conn.execute(text("SELECT key FROM idempotency_keys")).scalars().all()
    finally:
        engine.dispose()
    assert tuple(row) == ("POST /v1/models/{model}/feedback", None, "done", 200)
    assert keys == ["old"]


def test_version_kind_is_backfilled_from_the_dataset(empty_url):
    """20261205_0011: an existing version takes its dataset's kind (a fit was fitted on
    it, posted params of format 1 were evaluated on it), so a vector or matrix version of
    format 1 keeps serving that kind."""
    migrate.upgrade(empty_url, "20261204_0010")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO models (id, name, num_classes, argmax_policy, next_version, "
                "created_at) VALUES (1, 'm', 3, 'off', 3, '2026-01-01')"
            ))
            for dataset, kind in ((1, "logits"), (2, "probabilities")):
                conn.execute(text(
                    "INSERT INTO datasets (id, model_id, sha256, kind, n_rows, n_classes, "
                    "dtype, scores_sha256, labels_sha256, metrics, created_at) VALUES (:d, 1, "
                    ":s, :k, 10, 3, 'float32', 'b', 'c', '{}', '2026-01-01')"
                ), {"d": dataset, "s": f"a{dataset}", "k": kind})
                conn.execute(text(
                    "INSERT INTO calibrator_versions (id, model_id, version, dataset_id, "
                    "method, holdout, seed, options, status, progress, created_at) VALUES "
                    "(:d, 1, :d, :d, 'vector', 0.2, 0, '{}', 'succeeded', 1.0, '2026-01-01')"
                ), {"d": dataset})
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            kinds = conn.execute(
                text("SELECT kind FROM calibrator_versions ORDER BY version")
            ).scalars().all()
    finally:
        engine.dispose()
    assert kinds == ["logits", "probabilities"]
