"""Database faults: reads replayed once, writes answered 503 with ``applied`` and
``Retry-After``, feedback counted once under an Idempotency-Key (service/server/faults.py,
service/storage/retry.py, service/storage/idempotency.py).

In-process tests inject faults into the app's engine; the PostgreSQL test runs a real
server while a thread keeps terminating its connections (pg_terminate_backend) and a
client loop keeps reading and writing: no 5xx but 503 problems with Retry-After.
"""

from __future__ import annotations

import collections
import sqlite3
import threading
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.storage import migrate, retry
from service.vocabulary import DEFAULT_ALIAS
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    logits_data,
    make_settings,
    new_schema,
    upload,
)
from tests.service.servers import Server

MODEL = "/v1/models/m"


def dropped() -> OperationalError:
    """What SQLAlchemy raises for a connection the server closed."""
    exc = OperationalError("SELECT 1", {}, sqlite3.OperationalError("server closed the connection"))
    exc.connection_invalidated = True
    return exc


@pytest.fixture
def served(client):
    """A model with a fitted, aliased version, and feedback rows to post."""
    create_model(client, "m", k=3)
    z, y = logits_data(300, 3)
    dataset = upload(client, "m", z, y)
    v = fit(client, "m", dataset["id"], method="temperature")
    r = client.put(f"{MODEL}/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert r.status_code == 200, r.text
    return {"logits": z[:20].tolist(), "labels": y[:20].tolist()}


def engine_of(client):
    return client.app.state.welltempered.engine


class FailNext:
    """Raise ``make()`` from the next ``n`` statements matching ``sql`` on the engine."""

    def __init__(self, engine, sql: str, n: int = 1, make=dropped):
        self.engine, self.sql, self.left, self.make, self.hits = engine, sql, n, make, 0
        event.listen(engine, "before_cursor_execute", self)

    def __call__(self, conn, cursor, statement, parameters, context, executemany):
        if self.left and self.sql in statement:
            self.left -= 1
            self.hits += 1
            raise self.make()

    def remove(self):
        event.remove(self.engine, "before_cursor_execute", self)


def test_transient_errors_are_told_from_bugs():
    assert retry.is_transient(dropped())
    assert retry.is_transient(OperationalError("x", {}, sqlite3.OperationalError("locked")))
    assert not retry.is_transient(IntegrityError("x", {}, sqlite3.IntegrityError("dup")))
    assert not retry.is_transient(ValueError("bug"))


def test_retry_read_tries_once_more_and_only_for_transient_errors():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise dropped()
        return "ok"

    assert retry.retry_read(flaky) == "ok" and len(calls) == 2
    calls.clear()
    with pytest.raises(OperationalError):
        retry.retry_read(lambda: (calls.append(1), (_ for _ in ()).throw(dropped()))[1])
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ValueError):
        retry.retry_read(lambda: (calls.append(1), int("x")))
    assert len(calls) == 1


def test_a_read_that_loses_its_connection_is_replayed(client, served):
    fault = FailNext(engine_of(client), "FROM calibrator_versions")
    try:
        r = client.get(f"{MODEL}/calibrators/1")
    finally:
        fault.remove()
    assert r.status_code == 200 and fault.hits == 1
    fault = FailNext(engine_of(client), "FROM calibrator_versions", n=2)
    try:
        r = client.get(f"{MODEL}/calibrators/1")
    finally:
        fault.remove()
    body = assert_problem(r, 503, "nothing of this request was applied")
    assert body["type"] == "/problems/database-unavailable" and body["applied"] == "no"
    assert r.headers["retry-after"] == "1"
    assert "SELECT" not in r.text and "server closed" not in r.text  # no driver text


def test_a_write_that_fails_before_its_commit_is_not_applied(client, served):
    fault = FailNext(engine_of(client), "INSERT INTO feedback_bins")
    try:
        r = client.post(f"{MODEL}/feedback", json=served)
    finally:
        fault.remove()
    body = assert_problem(r, 503)
    assert body["applied"] == "no" and r.headers["retry-after"] == "1"
    monitoring = client.get(f"{MODEL}/monitoring").json()
    assert monitoring["live"]["n"] == 0  # nothing was recorded


def test_a_failed_post_frees_its_key_even_when_the_first_tries_are_cut(
    client, served, monkeypatch
):
    """A feedback post under an Idempotency-Key fails before its commit (503, nothing
    applied) and the first four tries to free its key lose their connections too (as
    under a cut every 50 ms): later tries free it, so the client's retry with the same
    key is counted now instead of answered 409 until the key's lease passes."""
    from service.storage import idempotency

    real, cut = idempotency.release, []

    def flaky_release(session, attempt):
        if len(cut) < 4:
            cut.append(attempt.key)
            raise dropped()
        real(session, attempt)

    monkeypatch.setattr(idempotency, "release", flaky_release)
    key = {"Idempotency-Key": "cut-release"}
    fault = FailNext(engine_of(client), "INSERT INTO feedback_bins")
    try:
        r = client.post(f"{MODEL}/feedback", json=served, headers=key)
    finally:
        fault.remove()
    assert assert_problem(r, 503)["applied"] == "no"
    assert cut == ["cut-release"] * 4
    again = client.post(f"{MODEL}/feedback", json=served, headers=key)
    assert again.status_code == 200, again.text
    assert client.get(f"{MODEL}/monitoring").json()["live"]["n"] == 20


def test_a_failed_commit_is_unknown_and_the_idempotency_key_makes_the_retry_safe(client, served):
    """The COMMIT itself fails after the server applied it: the caller is told
    'unknown'; its retry with the same key is answered from the stored answer and the
    rows are counted once."""
    engine = engine_of(client)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    real = engine.dialect.do_commit
    armed = []  # set by the feedback's write, so the read-only commits before it pass

    def arm(conn, cursor, statement, parameters, context, executemany):
        if "INSERT INTO feedback_bins" in statement:
            armed.append(1)

    def commit_then_fail(dbapi_connection):
        real(dbapi_connection)  # applied...
        if armed:
            armed.clear()
            event.remove(engine, "before_cursor_execute", arm)
            # ...unconfirmed: the driver's own error, as a dropped connection raises it
            raise engine.dialect.loaded_dbapi.OperationalError("server closed the connection")

    event.listen(engine, "before_cursor_execute", arm)
    engine.dialect.do_commit = commit_then_fail
    try:
        r = client.post(f"{MODEL}/feedback", json=served, headers=key)
    finally:
        engine.dialect.do_commit = real
    body = assert_problem(r, 503, "Idempotency-Key")
    assert body["applied"] == "unknown"
    again = client.post(f"{MODEL}/feedback", json=served, headers=key)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["rows"] == 20
    assert client.get(f"{MODEL}/monitoring").json()["live"]["n"] == 20  # once, not twice


@pytest.mark.postgres
def test_a_commit_the_server_refused_is_not_applied(pg_admin, tmp_path):
    """PostgreSQL answered the COMMIT with an error (here: its backend was terminated
    while idle in the transaction): it did not commit, so 'no', not 'unknown'."""
    import psycopg

    with new_schema(pg_admin) as url:
        migrate.upgrade(url)
        app = create_app(make_settings(url, tmp_path))
        with TestClient(app, raise_server_exceptions=False) as c:
            create_model(c, "m", k=3)
            engine = engine_of(c)
            real = engine.dialect.do_commit
            engine.dialect.do_commit = lambda dbapi_connection: (_ for _ in ()).throw(
                psycopg.errors.AdminShutdown("terminating connection due to administrator command")
            )
            try:
                r = c.post("/v1/models", json={"name": "n", "num_classes": 3})
            finally:
                engine.dialect.do_commit = real
            assert assert_problem(r, 503)["applied"] == "no"


def test_feedback_with_an_idempotency_key_is_counted_once(client, served):
    key = {"Idempotency-Key": "post-0001"}
    first = client.post(f"{MODEL}/feedback", json=served, headers=key)
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    second = client.post(f"{MODEL}/feedback", json=served, headers=key)
    assert second.json() == first.json() and second.headers["idempotent-replayed"] == "true"
    assert client.post(f"{MODEL}/feedback", json=served).status_code == 200  # no key: counted
    assert client.get(f"{MODEL}/monitoring").json()["live"]["n"] == 40
    create_model(client, "other", k=3)
    r = client.post("/v1/models/other/feedback", json=served, headers=key)
    body = assert_problem(r, 422, "post-0001")  # another model: another request
    assert body["type"] == "/problems/idempotency-key-reused"
    for bad in ("", "a" * 256, "has space"):
        r = client.post(f"{MODEL}/feedback", json=served, headers={"Idempotency-Key": bad})
        assert r.status_code == 422, (bad, r.text)


def test_an_expired_idempotency_key_counts_again(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, idempotency_key_seconds=0.5)
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", k=3)
        z, y = logits_data(300, 3)
        v = fit(c, "m", upload(c, "m", z, y)["id"], method="temperature")
        c.put(f"{MODEL}/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
        body, key = {"logits": z[:5].tolist(), "labels": y[:5].tolist()}, {"Idempotency-Key": "k"}
        assert c.post(f"{MODEL}/feedback", json=body, headers=key).status_code == 200
        time.sleep(0.6)
        r = c.post(f"{MODEL}/feedback", json=body, headers=key)
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers
        assert c.get(f"{MODEL}/monitoring").json()["live"]["n"] == 10


# ---------------------------------------------------------------------------
# PostgreSQL: connections killed under traffic


def kill_loop(admin, application_name: str, interval: float, stop: threading.Event, kills: list):
    with admin.connect() as conn:
        while not stop.is_set():
            kills[0] += conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND application_name = :name"
                ),
                {"name": application_name},
            ).scalar()
            stop.wait(interval)


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("interval", [0.05, 0.5], ids=["every-50ms", "every-500ms"])
def test_no_500_while_the_database_connections_are_killed(pg_admin, tmp_path, interval):
    """A client loop (GET a version, POST feedback with an Idempotency-Key, predict, list
    models) against a 2-worker server while a thread terminates every connection of the
    server (its application_name) every ``interval``: every answer is a success or a
    503 problem with Retry-After and ``applied``; every feedback post, retried with its
    key until it succeeds, is counted exactly once."""
    name = f"wt-faults-{uuid.uuid4().hex[:8]}"
    with new_schema(pg_admin) as url:
        migrate.upgrade(url)
        server = Server(f"{url}&application_name={name}", tmp_path / "data", "--workers", "2")
        with server, server.client() as c:
            create_model(c, "m", k=3)
            z, y = logits_data(300, 3)
            v = fit(c, "m", upload(c, "m", z, y)["id"], method="temperature")
            r = c.put(f"{MODEL}/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
            assert r.status_code == 200, r.text
            feedback = {"logits": z[:20].tolist(), "labels": y[:20].tolist()}
            rows = z[:5].tolist()
            calls = [
                ("GET version", lambda: c.get(f"{MODEL}/calibrators/1")),
                ("GET models", lambda: c.get("/v1/models")),
                ("POST predict", lambda: c.post(f"{MODEL}/predict", json={"logits": rows})),
            ]
            stop, kills = threading.Event(), [0]
            args = (pg_admin, name, interval, stop, kills)
            killer = threading.Thread(target=kill_loop, args=args)
            killer.start()
            counts: collections.Counter = collections.Counter()
            bad, confirmed, start = [], 0, time.monotonic()

            last: list = []

            def post_feedback() -> bool:
                """One attempt of the current post, always under its own key."""
                r = c.post(
                    f"{MODEL}/feedback", json=feedback, headers={"Idempotency-Key": f"p{confirmed}"}
                )
                counts["POST feedback", r.status_code] += 1
                last[:] = [r.status_code, r.text]
                if r.status_code >= 500:
                    bad.append(("POST feedback", r))
                return r.status_code == 200

            try:
                while time.monotonic() - start < 20:
                    for label, call in calls:
                        r = call()
                        counts[label, r.status_code] += 1
                        if r.status_code >= 500:
                            bad.append((label, r))
                    confirmed += post_feedback()
            finally:
                stop.set()
                killer.join()
            # the last post, if still unconfirmed, retried with its key without the killer
            pending = 0
            while not post_feedback():
                pending += 1
                assert pending < 10, f"the last feedback post never succeeded: {last}"
            confirmed += 1
            total = sum(counts.values())
            print(
                f"\nkilled {kills[0]} connections every {interval}s; {total} requests: "
                f"{dict(sorted(counts.items()))}"
            )
            for label, r in bad:
                assert r.status_code == 503, (label, r.status_code, r.text)
                body = r.json()
                assert body["type"] == "/problems/database-unavailable", (label, r.text)
                assert body["applied"] in ("no", "yes", "unknown") and r.headers["retry-after"]
                if label.startswith("GET"):
                    assert body["applied"] == "no"
            assert kills[0] > 0
            assert counts["GET version", 200] > 0 and counts["POST feedback", 200] > 0
            # every post counted once, however often it was retried
            labelled = c.get(f"{MODEL}/monitoring", params={"window": "1h"}).json()["live"]["n"]
            assert labelled == 20 * confirmed


def test_a_failed_ping_replaces_the_connection(tmp_path, monkeypatch):
    """Whatever a pre-ping raises, the connection is discarded and a new one opened:
    psycopg's ping raised ProgrammingError ("can't change 'autocommit' now") on a
    connection the server had cut, which SQLAlchemy does not count as a disconnect."""
    engine = create_engine(f"sqlite:///{tmp_path / 'ping.db'}", pool_pre_ping=True)
    retry.track_writes(engine)
    opened = []
    event.listen(engine, "connect", lambda dbapi_conn, record: opened.append(dbapi_conn))
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    pings = []

    def broken_ping(dbapi_connection):
        pings.append(dbapi_connection)
        raise sqlite3.ProgrammingError("can't change 'autocommit' now")

    monkeypatch.setattr(engine.dialect, "do_ping", broken_ping)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
    assert pings == opened[:1] and len(opened) == 2
    engine.dispose()


def test_a_failed_rollback_at_the_end_of_a_session_is_logged_not_raised(tmp_path, caplog):
    engine = create_engine(f"sqlite:///{tmp_path / 'end.db'}")
    session = Session(engine)
    session.execute(text("SELECT 1"))  # a transaction is open: close() rolls it back

    def cut(dbapi_connection):
        raise sqlite3.OperationalError("server closed the connection unexpectedly")

    event.listen(engine, "rollback", lambda conn: cut(None))
    with caplog.at_level("WARNING", logger="welltempered.database"):
        retry.end_session(session)
    assert "rollback at its end failed" in caplog.text
    assert engine.pool.checkedout() == 0
    engine.dispose()


def test_a_read_whose_session_cannot_roll_back_still_answers(client, served, caplog):
    """The request's session ends after its answer is decided (perhaps sent): a rollback
    that fails then is a warning, not an unhandled error (which on a real server broke
    the connection of an answer already started), and the answer stands."""
    engine = engine_of(client)

    def cut(conn):
        raise dropped()

    event.listen(engine, "rollback", cut)
    try:
        with caplog.at_level("WARNING"):
            r = client.get(f"{MODEL}/calibrators")
    finally:
        event.remove(engine, "rollback", cut)
    assert r.status_code == 200, r.text
    assert [x.getMessage() for x in caplog.records if x.levelname == "ERROR"] == []
    assert "rollback at its end failed" in caplog.text
    assert r.json()["calibrators"][0]["version"] == 1


# ---------------------------------------------------------------------------
# start-up: a worker that loses its connection while it starts keeps starting


def test_start_up_steps_are_tried_again_while_the_database_is_unreachable():
    """until_reachable repeats a transient failure, with growing waits, until its time is
    up, then raises it; any other error at once."""
    now, waits = [0.0], []

    def sleep(seconds):
        waits.append(seconds)
        now[0] += seconds

    def down():
        raise dropped()

    with pytest.raises(OperationalError):
        retry.until_reachable(down, wait_seconds=10, what="a check", sleep=sleep,
                              clock=lambda: now[0])
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    assert sum(waits) + 2.0 > 10  # gave up when the next wait would pass the deadline

    def bug():
        raise ValueError("not the database's fault")

    with pytest.raises(ValueError):
        retry.until_reachable(bug, wait_seconds=5, what="a check", sleep=sleep)


def test_a_start_up_that_loses_its_connection_still_starts(database_url, tmp_path, monkeypatch):
    """The lifespan's schema check and (SQLite) the local queue's reads fail once each, as
    when connections are cut while a worker starts (uvicorn then stopped the whole
    server, every worker with it: the every-50ms test's 'connection reset' on
    PostgreSQL): the app starts and serves. (On PostgreSQL the job engine's pool
    reconnects by itself.)"""
    from service.jobs import local

    failed = collections.Counter()

    def once(name, real):
        def flaky(*args, **kwargs):
            if not failed[name]:
                failed[name] += 1
                raise dropped()
            return real(*args, **kwargs)

        return flaky

    # The schema check's database step: an upgrade on SQLite, a revision read elsewhere.
    monkeypatch.setattr(migrate, "upgrade", once("schema", migrate.upgrade))
    monkeypatch.setattr(migrate, "current_revision", once("schema", migrate.current_revision))
    monkeypatch.setattr(
        local.LocalQueue, "start", once("queue", local.LocalQueue.start)
    )
    app = create_app(make_settings(database_url, tmp_path))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/healthz").status_code == 200
        create_model(c, "m", k=3)
        assert c.get("/v1/models/m").status_code == 200
    sqlite = database_url.startswith("sqlite")
    assert failed == ({"schema": 1, "queue": 1} if sqlite else {"schema": 1})
