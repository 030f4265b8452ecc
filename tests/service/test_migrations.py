"""Schema changes are code: migrations match the models, on both backends."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient

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
                conn, opts={"compare_type": True, "compare_server_default": True}
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
