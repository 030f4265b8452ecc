"""Service fixtures: the same tests on SQLite and PostgreSQL, each test isolated.

Isolation: SQLite gets a new database file per test; PostgreSQL a new schema
per test in the `test` database (URL from WELLTEMPERED_TEST_POSTGRES_URL),
migrated with Alembic and dropped afterwards. The savepoint-per-test recipe
does not fit: fits run in worker threads/processes with their own connections,
which must see the committed job rows.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.api.app import create_app
from service.settings import Settings
from service.storage import migrate
from tests.conftest import skip_or_fail

PG_URL = os.environ.get(
    "WELLTEMPERED_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
FINISHED = ("succeeded", "rejected", "failed")


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


def pg_schema_url(schema: str) -> str:
    url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


@contextmanager
def new_schema(pg_admin) -> Iterator[str]:
    """A fresh, empty schema, dropped on exit; its URL puts it first on the search_path."""
    schema = f"wt_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield pg_schema_url(schema)
    finally:
        with pg_admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


@contextmanager
def migrated_database(request, backend: str, directory: Path) -> Iterator[str]:
    """The URL of a migrated, empty database of ``backend`` (a BACKENDS value), for
    fixtures of any scope: a file in ``directory``, or a new PostgreSQL schema."""
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'registry.sqlite3'}"
        return
    with new_schema(request.getfixturevalue("pg_admin")) as url:
        migrate.upgrade(url)
        yield url


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


def make_settings(database_url: str, tmp_path: Path, **overrides) -> Settings:
    values = {
        "database_url": database_url,
        "data_dir": tmp_path / "data",
        "fit_executor": "thread",
        "progress_interval_seconds": 0.05,
        # The API tests predate keys: they run with auth off (namespace "default");
        # tests/service/test_auth.py runs with it on.
        "auth": "off",
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


# -- helpers ---------------------------------------------------------------


def logits_data(n: int = 300, k: int = 4, seed: int = 0, scale: float = 3.0):
    """Over-confident synthetic logits with labels: a true signal times ``scale``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), labels] += 1.5
    return logits * scale, labels


def create_model(client: TestClient, name: str = "m", k: int = 4, **extra) -> dict:
    r = client.post("/v1/models", json={"name": name, "num_classes": k, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def upload(client: TestClient, model: str, logits, labels, kind: str = "logits") -> dict:
    r = client.post(
        f"/v1/models/{model}/datasets",
        json={kind: np.asarray(logits).tolist(), "labels": np.asarray(labels).tolist()},
    )
    assert r.status_code in (200, 201), r.text
    return r.json()


def wait_for(client: TestClient, model: str, version: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/models/{model}/calibrators/{version}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["status"] in FINISHED:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"fit still {body['status']} after {timeout}s: {body}")
        time.sleep(0.02)


def fit(client: TestClient, model: str, dataset_id: int, method: str = "temperature", **extra):
    r = client.post(
        f"/v1/models/{model}/calibrators",
        json={"dataset_id": dataset_id, "method": method, **extra},
    )
    assert r.status_code == 202, r.text
    return wait_for(client, model, r.json()["version"])


def assert_problem(r, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["status"] == status
    assert {"type", "title", "status", "detail", "instance"} <= set(body), body
    for word in words:
        assert word.lower() in body["detail"].lower(), body["detail"]
    return body
