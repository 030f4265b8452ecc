"""Helpers shared by the service tests: settings, synthetic data, API steps,
problem checks, request-body strategies and databases of each backend.

Test files import from here, never from each other or from a conftest.
"""

from __future__ import annotations

import graphlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.settings import Settings
from service.storage import migrate
from service.vocabulary import DEFAULT_ALIAS
from tests.oracles import softmax, wait_for_version

PG_URL = os.environ.get(
    "WELLTEMPERED_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


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
def sqlite_template(directory: Path) -> Iterator[Path]:
    """A SQLite file migrated to head, the template of :func:`migrated_database`'s files."""
    path = directory / "template.sqlite3"
    migrate.upgrade(f"sqlite:///{path}")
    yield path


@contextmanager
def migrated_database(request, backend: str, directory: Path) -> Iterator[str]:
    """The URL of a migrated, empty database of ``backend`` (a BACKENDS value), for
    fixtures of any scope: a file in ``directory``, or a PostgreSQL schema.

    Neither is migrated here: the file is a copy of one Alembic migrated once per test
    process (the ``sqlite_template`` fixture), the schema an emptied one of the
    ``pg_schemas`` pool (:class:`SchemaPool`); both take a fraction of the migrations'
    time. tests/service/storage/test_migrations.py migrates empty databases and checks that
    models and migrations agree; tests/service/test_isolation.py that these are empty
    and at head."""
    if backend == "sqlite":
        path = directory / "registry.sqlite3"
        template = request.getfixturevalue("sqlite_template")
        with closing(sqlite3.connect(template)) as source, closing(sqlite3.connect(path)) as copy:
            source.backup(copy)
        yield f"sqlite:///{path}"
        return
    with request.getfixturevalue("pg_schemas").schema() as url:
        yield url


#: One line per object of a schema: tables, columns, constraints, indexes, triggers,
#: functions, types, sequences, and the Alembic revision. Equal lines, equal schemas.
_SCHEMA_OBJECTS = """
SELECT coalesce(string_agg(line, E'\\n' ORDER BY line), '') FROM (
  SELECT 'relation ' || relname || ' ' || relkind::text AS line
    FROM pg_class WHERE relnamespace = :ns
  UNION ALL
  SELECT 'column ' || c.relname || '.' || a.attname || ' '
         || format_type(a.atttypid, a.atttypmod) || ' ' || a.attnotnull || ' '
         || a.attidentity::text || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE c.relnamespace = :ns AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid)
    FROM pg_constraint WHERE connamespace = :ns
  UNION ALL
  SELECT 'index ' || pg_get_indexdef(i.indexrelid)
    FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid WHERE c.relnamespace = :ns
  UNION ALL
  SELECT 'trigger ' || pg_get_triggerdef(t.oid)
    FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
    WHERE c.relnamespace = :ns AND NOT t.tgisinternal
  UNION ALL
  SELECT 'function ' || p.oid::regprocedure::text || ' ' || md5(pg_get_functiondef(p.oid))
    FROM pg_proc p WHERE p.pronamespace = :ns
  UNION ALL
  SELECT 'type ' || t.typname || ' ' || coalesce(e.enumlabel, '')
    FROM pg_type t LEFT JOIN pg_enum e ON e.enumtypid = t.oid WHERE t.typnamespace = :ns
  UNION ALL
  SELECT 'revision ' || version_num FROM alembic_version
) objects
"""

_NAMESPACE = "SELECT oid FROM pg_namespace WHERE nspname = :s"

#: Tables of a schema, and the tables each one's foreign keys reference.
_FOREIGN_KEYS = """
SELECT c.relname, coalesce(array_agg(r.relname) FILTER (WHERE r.relname IS NOT NULL), '{}')
  FROM pg_class c
  LEFT JOIN pg_constraint k ON k.conrelid = c.oid AND k.contype = 'f'
  LEFT JOIN pg_class r ON r.oid = k.confrelid
  WHERE c.relnamespace = :ns AND c.relkind IN ('r', 'p')
  GROUP BY c.relname
"""


class SchemaPool:
    """Migrated PostgreSQL schemas of one test process, each used by one test at a time
    and reused: :meth:`schema` hands out an empty one, migrated to head.

    Migrating a schema takes most of a second (the migrations, and the job engine's
    schema); emptying one, milliseconds. A schema handed back is emptied (every row
    of every table but ``alembic_version`` deleted, every sequence restarted, in one
    transaction) only if its structure is still what Alembic made of it (every table,
    column, constraint, index, trigger, function, type and the revision): a schema a
    test changed is dropped, and the next test gets a newly migrated one.
    """

    def __init__(self, pg_admin):
        self.admin = pg_admin
        self.engine = create_engine(PG_URL)
        self.free: list[tuple[str, str]] = []  # (schema, its objects when migrated)

    def _objects(self, conn, schema: str) -> str:
        conn.execute(text(f'SET LOCAL search_path TO "{schema}"'))
        ns = conn.execute(text(_NAMESPACE), {"s": schema}).scalar()
        return conn.execute(text(_SCHEMA_OBJECTS), {"ns": ns}).scalar()

    def _empty(self, conn, schema: str) -> None:
        """Delete every row (children before parents) and restart every sequence."""
        ns = conn.execute(text(_NAMESPACE), {"s": schema}).scalar()
        graph = {
            table: {parent for parent in parents if parent != table}
            for table, parents in conn.execute(text(_FOREIGN_KEYS), {"ns": ns})
        }
        children_first = reversed(list(graphlib.TopologicalSorter(graph).static_order()))
        for table in children_first:
            if table != "alembic_version":
                conn.execute(text(f'DELETE FROM "{schema}"."{table}"'))
        conn.execute(
            text(
                "SELECT setval(format('%I.%I', schemaname, sequencename), start_value, false) "
                "FROM pg_sequences WHERE schemaname = :s"
            ),
            {"s": schema},
        )

    @contextmanager
    def schema(self) -> Iterator[str]:
        if self.free:
            schema, objects = self.free.pop()
        else:
            schema = f"wt_{uuid.uuid4().hex[:12]}"
            with self.admin.connect() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            migrate.upgrade(pg_schema_url(schema))
            with self.engine.begin() as conn:
                objects = self._objects(conn, schema)
        reusable = False
        try:
            yield pg_schema_url(schema)
            with self.engine.begin() as conn:
                if self._objects(conn, schema) == objects:
                    self._empty(conn, schema)
                    reusable = True
        finally:
            if reusable:
                self.free.append((schema, objects))
            else:
                self.drop(schema)

    def drop(self, schema: str) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))

    def close(self) -> None:
        while self.free:
            self.drop(self.free.pop()[0])
        self.engine.dispose()


def make_settings(database_url: str, tmp_path: Path, **overrides) -> Settings:
    values = {
        "database_url": database_url,
        "data_dir": tmp_path / "data",
        "fit_executor": "thread",
        "progress_interval_seconds": 0.05,
        # The API tests predate keys: they run with auth off (namespace "default");
        # tests/service/security/test_auth.py runs with it on.
        "auth": "off",
    }
    values.update(overrides)
    return Settings(**values)


def hold_queue(client: TestClient) -> None:
    """From now on, fits this client submits stay queued: the queue neither writes their
    job (PostgreSQL) nor hands them to a thread (SQLite)."""
    queue = client.app.state.welltempered.fits.queue
    queue.enqueue = lambda *args: None
    queue.submitted = lambda *args: None


def dead_process_temp(arrays, suffix: str = "") -> Path:
    """A temp file of the store as a process that has since died left it (its owner in
    the name is a pid that exited)."""
    path = arrays.temp_path(suffix)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, _, rest = path.name.split("-", 2)
    moved = path.with_name(f"{host}-{dead.pid}-{rest}")
    path.rename(moved)
    return moved


def logits_data(n: int = 300, k: int = 4, seed: int = 0, scale: float = 3.0):
    """Over-confident synthetic logits with labels: a true signal times ``scale``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), labels] += 1.5
    return logits * scale, labels


def tempered_rows(n: int, k: int, temperature: float, seed: int):
    """Logits and labels drawn from ``softmax(logits / temperature)``: rows whose labels
    follow a tempered version of the scores (temperature 1: the scores are calibrated;
    above 1: they are over-confident, the drift the recalibration loop corrects)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(n, k))
    probs = softmax(logits / temperature)
    labels = (rng.random((n, 1)) > np.cumsum(probs, axis=1)).sum(axis=1)
    return logits, np.minimum(labels, k - 1)


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


def fit(client: TestClient, model: str, dataset_id: int, method: str = "temperature", **extra):
    r = client.post(
        f"/v1/models/{model}/calibrators",
        json={"dataset_id": dataset_id, "method": method, **extra},
    )
    assert r.status_code == 202, r.text
    return wait_for_version(client, model, r.json()["version"], interval=0.02)


def import_params(client: TestClient, model: str, dataset_id: int, params: dict, **extra):
    """POST .../calibrators/import and wait for the version's outcome."""
    r = client.post(
        f"/v1/models/{model}/calibrators/import",
        json={"dataset_id": dataset_id, "params": params, **extra},
    )
    assert r.status_code == 202, r.text
    assert r.headers["location"] == r.json()["status_url"]
    return wait_for_version(client, model, r.json()["version"], interval=0.02)


def assert_problem(r, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["status"] == status
    assert {"type", "title", "status", "detail", "instance"} <= set(body), body
    for word in words:
        assert word.lower() in body["detail"].lower(), body["detail"]
    return body


def promote(client, model: str, dataset_id: int, seed: int = 0, **extra) -> dict:
    """Fit temperature scaling and point the default alias at it."""
    version = fit(client, model, dataset_id, seed=seed, **extra)
    assert version["status"] == "succeeded", version
    r = client.put(
        f"/v1/models/{model}/aliases/{DEFAULT_ALIAS}", json={"version": version["version"]}
    )
    assert r.status_code == 200, r.text
    return version


def answering_workers(mp_dir: Path) -> set[int]:
    """The worker processes that have answered an HTTP request: their prometheus_client
    multiprocess counter file holds a request count. (Every worker has a counter file
    from its start: the unlabelled counters write their zero then.)"""
    return {
        int(p.stem.rsplit("_", 1)[1])
        for p in mp_dir.glob("counter_*.db")
        if b"welltempered_http_requests_total" in p.read_bytes()
    }


def families(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


# -- request bodies ----------------------------------------------------------


def npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


keys = st.sampled_from(
    [
        "logits",
        "probabilities",
        "labels",
        "name",
        "num_classes",
        "dataset_id",
        "method",
        "holdout",
        "options",
        "version",
        "seed",
        "class_names",
        "argmax_policy",
    ]
)


json_objects = st.dictionaries(keys, json_values, max_size=4)


matrices = st.lists(
    st.lists(st.floats(width=32) | st.integers(-5, 5), min_size=0, max_size=5), max_size=4
)


shaped = st.fixed_dictionaries(
    {"logits": matrices, "labels": st.lists(st.integers(-2, 5), max_size=4)}
)


bodies = st.one_of(
    st.binary(max_size=64).map(lambda b: ("application/octet-stream", b)),
    st.binary(max_size=64).map(lambda b: ("application/x-npy", b)),
    st.binary(max_size=64).map(lambda b: ("multipart/form-data; boundary=xyz", b)),
    st.text(max_size=30).map(lambda t: ("application/json", t.encode())),
    st.sampled_from(["text/plain", "", "application/json; charset=utf-8"]).flatmap(
        lambda ct: json_values.map(lambda v: (ct, json.dumps(v).encode()))
    ),
    json_objects.map(lambda v: ("application/json", json.dumps(v).encode())),
    shaped.map(lambda v: ("application/json", json.dumps(v).encode())),
)


# -- time and metrics -------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def rate_limited_total(namespace: str, exposition: str) -> float:
    """``welltempered_rate_limited_requests_total{namespace=...}`` in /metrics (0 if absent)."""
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == "welltempered_rate_limited_requests_total":
                if s.labels == {"namespace": namespace}:
                    return s.value
    return 0.0


def race_leader(candidates: dict) -> str:
    """The method an ``auto`` version should have chosen from its ``candidates``: the
    race's leader (the lowest ``selection.nll`` among those scored on the most folds),
    or without a race (one allowed candidate, or none) the lowest hold-out NLL among
    the allowed (else all)."""
    raced = {m: c["selection"] for m, c in candidates.items() if "selection" in c}
    if raced:
        last = max(r["folds"] for r in raced.values())
        return min((m for m, r in raced.items() if r["folds"] == last),
                   key=lambda m: raced[m]["nll"])
    pool = [m for m, c in candidates.items() if c["allowed"]] or list(candidates)
    return min(pool, key=lambda m: candidates[m]["metrics"]["nll"])
