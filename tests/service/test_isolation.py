"""The isolation the service tests rely on (tests/service/conftest.py): every test gets
an empty database migrated to head, although neither backend is migrated per test."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect, text

from service.api.app import create_app
from service.storage import migrate
from tests.service.helpers import create_model, fit, logits_data, make_settings, upload


def _rows(url: str) -> dict[str, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            tables = inspect(conn).get_table_names()
            return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar() for t in tables}
    finally:
        engine.dispose()


def _schema(url: str) -> str:
    return url.rsplit("search_path%3D", 1)[1]


def _use(url: str, tmp_path) -> dict:
    """A model, a dataset and a fitted version: rows in most tables, ids drawn."""
    with TestClient(create_app(make_settings(url, tmp_path))) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(100, 4))
        return {"dataset": ds["id"], "version": fit(c, "m", ds["id"])["version"]}


def test_every_database_is_empty_and_at_head(database_url, tmp_path):
    engine = create_engine(database_url)
    try:
        assert migrate.current_revision(engine) == migrate.head_revision(database_url)
    finally:
        engine.dispose()
    rows = _rows(database_url)
    assert rows.pop("alembic_version") == 1
    assert len(rows) >= 9 and set(rows.values()) == {0}, rows
    assert _use(database_url, tmp_path) == {"dataset": 1, "version": 1}


@pytest.mark.postgres
def test_a_schema_handed_back_is_emptied_and_its_sequences_restart(pg_schemas, tmp_path):
    with pg_schemas.schema() as first:
        assert _use(first, tmp_path / "a") == {"dataset": 1, "version": 1}
        used = _rows(first)
        assert used["datasets"] == used["calibrator_versions"] == 1, used
    with pg_schemas.schema() as again:
        assert again == first  # the same schema, reused
        rows = _rows(again)
        assert rows.pop("alembic_version") == 1 and set(rows.values()) == {0}, rows
        assert _use(again, tmp_path / "b") == {"dataset": 1, "version": 1}


@pytest.mark.postgres
def test_a_schema_whose_structure_changed_is_dropped_not_reused(pg_schemas, pg_admin):
    with pg_schemas.schema() as changed:
        engine = create_engine(changed)
        try:
            with engine.begin() as conn:
                conn.execute(text("CREATE INDEX ix_extra ON models (description)"))
        finally:
            engine.dispose()
    with pg_admin.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": _schema(changed)}
        ).scalar()
        assert left == 0
        with pg_schemas.schema() as other:
            assert other != changed
            extra = conn.execute(
                text("SELECT count(*) FROM pg_indexes WHERE schemaname = :s AND indexname = :i"),
                {"s": _schema(other), "i": "ix_extra"},
            ).scalar()
            assert extra == 0
