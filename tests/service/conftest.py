"""Service fixtures: the same tests on SQLite and PostgreSQL, each test isolated.

Isolation: SQLite gets a new database file per test, a copy of one Alembic
migrated once per test process; PostgreSQL an empty, migrated schema per test in
the `test` database (URL from WELLTEMPERED_TEST_POSTGRES_URL): a schema is emptied
after its test and handed to the next, or dropped if the test changed its structure
(tests/service/helpers.py, SchemaPool). The savepoint-per-test recipe does not fit:
fits run in worker threads/processes with their own connections, which must see the
committed job rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from service.api.app import create_app
from service.settings import Settings
from tests.helpers import skip_or_fail
from tests.service import helpers
from tests.service.helpers import (
    BACKENDS,
    PG_URL,
    make_settings,
    migrated_database,
    new_schema,
)


@pytest.fixture(scope="session")
def pg_admin():
    engine = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any connection problem: skip here, fail in CI
        engine.dispose()
        skip_or_fail(f"PostgreSQL is not reachable at {PG_URL}: {type(exc).__name__}: {exc}")
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def pg_schemas(pg_admin) -> Iterator[helpers.SchemaPool]:
    pool = helpers.SchemaPool(pg_admin)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Iterator[Path]:
    with helpers.sqlite_template(tmp_path_factory.mktemp("template")) as path:
        yield path


@pytest.fixture
def pg_schema(pg_admin) -> Iterator[str]:
    """A fresh, empty schema; its URL puts it first on the search_path."""
    with new_schema(pg_admin) as url:
        yield url


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database of each backend."""
    with migrated_database(request, request.param, tmp_path) as url:
        yield url


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module", params=BACKENDS)
def module_client(request, tmp_path_factory) -> Iterator[TestClient]:
    """One app of each backend for a whole test module, like ``client``: for tests that
    read what a module fixture made, or send requests that must be refused (and check
    that nothing changed). A test that changes what others read uses ``client``."""
    tmp = tmp_path_factory.mktemp("module")
    with migrated_database(request, request.param, tmp) as url:
        app = create_app(make_settings(url, tmp))
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c
