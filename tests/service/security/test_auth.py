"""API keys with auth ON: 401/403, scopes, namespaces, expiry, revocation, logs, CLI."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from service import cli
from service.api.app import create_app
from service.security import keys
from service.security.auth import key_digest
from service.storage import keys as key_rows
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_ALIAS, METRICS_SCOPE, SCOPES, TENANT_SCOPES
from tests.service.helpers import (
    Clock,
    assert_problem,
    fit,
    logits_data,
    make_settings,
    rate_limited_total,
)


@pytest.fixture
def sessions(database_url):
    engine = make_engine(database_url)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture
def make_key(sessions):
    def make(namespace: str = "team-a", scope: str = "write", expires=None) -> str:
        with sessions() as s:
            return keys.create_key(s, namespace, scope, expires)[1]

    return make


@pytest.fixture
def app_client(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, auth="on", key_cache_seconds=0.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def limited_client(database_url, tmp_path):
    """Auth on, 1 request per second per key, bursts of 3, on a clock the test moves."""
    settings = make_settings(
        database_url, tmp_path, auth="on", rate_limit_per_second=1.0, rate_limit_burst=3
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        c.app.state.welltempered_auth.limiter.clock = Clock()
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_scope_rules_cover_every_route(tmp_path):
    """The scope each route's budget declares is the rule of the scopes: probes and the
    API's description open, /metrics its own scope, keys admin, reads and scoring
    (predict, feedback, infer) predict, every other change write."""
    app = create_app(make_settings("sqlite://", tmp_path))
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            need = route.limits.scope
            path = route.path
            if path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
                assert need is None
            elif path in ("/openapi.json", "/docs", "/redoc"):
                assert need is None
            elif path == "/metrics":
                assert need == METRICS_SCOPE
            elif path.startswith("/v1/keys"):
                assert need == "admin", (method, path)
            elif method in ("GET", "HEAD") or path.endswith(
                ("/predict", "/predict.npy", "/feedback", "/infer")
            ):
                assert need == "predict", (method, path)
            else:
                assert need == "write", (method, path)
            assert need is None or need in SCOPES


def test_missing_invalid_and_malformed_keys_are_401(app_client):
    for headers in ({}, bearer("wt_" + "x" * 43), {"Authorization": "Basic abc"}, bearer("")):
        r = app_client.get("/v1/models", headers=headers)
        assert_problem(r, 401)
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_open_routes_need_no_key(app_client):
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs"):
        assert app_client.get(path).status_code == 200, path


def test_scopes_are_hierarchical(app_client, make_key):
    predict, write, admin = (make_key("team-a", s) for s in TENANT_SCOPES)
    body = {"name": "m", "num_classes": 3}
    body_403 = assert_problem(
        app_client.post("/v1/models", json=body, headers=bearer(predict)), 403
    )
    assert predict not in str(body_403) and "write" in body_403["detail"]
    assert app_client.post("/v1/models", json=body, headers=bearer(write)).status_code == 201
    assert app_client.get("/v1/models/m", headers=bearer(predict)).status_code == 200
    assert_problem(app_client.get("/v1/keys", headers=bearer(write)), 403, "admin")
    assert app_client.get("/v1/keys", headers=bearer(admin)).status_code == 200
    r = app_client.post("/v1/models", json={**body, "name": "m2"}, headers=bearer(admin))
    assert r.status_code == 201


def test_namespaces_are_isolated_and_foreign_models_look_missing(app_client, make_key):
    a, b, c = make_key("team-a"), make_key("team-b"), make_key("team-c")
    z, y = logits_data(200, 3)
    assert app_client.post("/v1/models", json={"name": "m", "num_classes": 3}, headers=bearer(a))
    app_client.headers.update(bearer(a))
    r = app_client.post("/v1/models/m/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    v = fit(app_client, "m", r.json()["id"])
    assert app_client.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    app_client.headers.pop("Authorization")
    paths = [
        ("GET", "/v1/models/m", None),
        ("GET", "/v1/models/m/datasets/1", None),
        ("GET", "/v1/models/m/calibrators/1", None),
        ("GET", f"/v1/models/m/aliases/{DEFAULT_ALIAS}", None),
        ("POST", "/v1/models/m/predict", {"logits": z[:2].tolist()}),
        ("PUT", f"/v1/models/m/aliases/{DEFAULT_ALIAS}", {"version": 1}),
    ]
    for method, path, json in paths:
        foreign = app_client.request(method, path, json=json, headers=bearer(b))
        missing = app_client.request(method, path, json=json, headers=bearer(c))
        assert foreign.status_code == 404, (path, foreign.text)
        assert foreign.content == missing.content, path  # the same bytes: nothing leaks
        assert app_client.request(method, path, json=json, headers=bearer(a)).status_code < 300
    listed = app_client.get("/v1/models", headers=bearer(b)).json()
    assert listed == {"models": [], "next_cursor": None}
    # the same name in another namespace is another model
    r = app_client.post("/v1/models", json={"name": "m", "num_classes": 5}, headers=bearer(b))
    assert r.status_code == 201
    assert app_client.get("/v1/models/m", headers=bearer(a)).json()["num_classes"] == 3


def test_expired_and_revoked_keys_are_401(app_client, make_key, sessions):
    expired = make_key("team-a", "admin", expires=timedelta(seconds=-1))
    assert_problem(app_client.get("/v1/models", headers=bearer(expired)), 401, "expired")
    live = make_key("team-a", "admin", expires=timedelta(days=1))
    assert app_client.get("/v1/models", headers=bearer(live)).status_code == 200
    with sessions() as s:
        key_rows.revoke_key(s, key_rows.live_key(s, key_digest(live)).id)
    assert_problem(app_client.get("/v1/models", headers=bearer(live)), 401, "revoked")


def test_admin_manages_keys_of_its_namespace_over_http(app_client, make_key, sessions):
    admin = make_key("team-a", "admin")
    make_key("team-b", "admin")
    r = app_client.post("/v1/keys", json={"scope": "predict"}, headers=bearer(admin))
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["namespace"] == "team-a" and new["key"].startswith(new["prefix"])
    listed = app_client.get("/v1/keys", headers=bearer(admin)).json()["keys"]
    assert {k["namespace"] for k in listed} == {"team-a"} and len(listed) == 2
    assert all("key" not in k for k in listed)
    assert app_client.get("/v1/models", headers=bearer(new["key"])).status_code == 200
    assert app_client.delete(f"/v1/keys/{new['id']}", headers=bearer(admin)).status_code == 204
    assert_problem(app_client.get("/v1/models", headers=bearer(new["key"])), 401)
    with sessions() as s:  # only the digest is stored
        stored = {(r.key_sha256, r.prefix) for r in key_rows.list_keys(s)}
    assert all(new["key"] not in "".join(pair) for pair in stored)


def test_keys_never_reach_the_logs(app_client, make_key, caplog):
    good, bad = make_key("team-a", "predict"), "wt_not-a-real-key-but-secret-looking-0123456789"
    with caplog.at_level(logging.DEBUG):
        app_client.get("/v1/models", headers=bearer(good))
        app_client.post("/v1/models", json={"name": "x", "num_classes": 2}, headers=bearer(good))
        r = app_client.get("/v1/models", headers=bearer(bad))
        app_client.get("/v1/models/none", headers=bearer(good))
    assert caplog.records, "nothing was logged: the capture is not working"
    assert good not in caplog.text and bad not in caplog.text
    assert bad not in r.text


def test_cli_keys_create_list_revoke(database_url, monkeypatch, capsys, app_client):
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", database_url)
    assert (
        cli.main(["keys", "create", "--namespace", "ns1", "--scope", "write", "--expires", "30d"])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    key = out[-1]
    assert key.startswith("wt_") and len(key) == 46 and key not in "\n".join(out[:-1])
    assert app_client.get("/v1/models", headers=bearer(key)).status_code == 200
    assert cli.main(["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert key not in listing and key[:11] in listing and "ns1" in listing
    key_id = int(listing.splitlines()[1].split()[0])
    assert cli.main(["keys", "revoke", str(key_id)]) == 0
    assert cli.main(["keys", "revoke", str(key_id)]) == 2  # no live key of that id
    capsys.readouterr()
    assert_problem(app_client.get("/v1/models", headers=bearer(key)), 401)
    assert (
        cli.main(["keys", "create", "--namespace", "ns1", "--scope", "write", "--expires", "soon"])
        == 2
    )
    assert cli.main(["keys", "create", "--namespace", "bad/ns", "--scope", "write"]) == 2


def test_serve_with_auth_off_refuses_a_public_address(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WELLTEMPERED_AUTH", "off")
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", f"sqlite:///{tmp_path / 'x.sqlite3'}")
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        assert cli.main(["serve", "--host", host, "--port", "1"]) == 2
        assert "loopback" in capsys.readouterr().err
    assert not (tmp_path / "x.sqlite3").exists()  # refused before touching anything
    assert cli.is_loopback("127.0.0.1") and cli.is_loopback("::1") and cli.is_loopback("localhost")


def test_rate_limit_per_key(limited_client, make_key):
    c, clock = limited_client, limited_client.app.state.welltempered_auth.limiter.clock
    a, b = make_key("rl-team-a", "write"), make_key("rl-team-b", "predict")
    predict_key = make_key("rl-team-a", "predict")
    scraper = bearer(make_key(None, METRICS_SCOPE))
    before = rate_limited_total("rl-team-a", c.get("/metrics", headers=scraper).text)
    for _ in range(10):  # open routes: never limited, even with a key
        assert c.get("/healthz", headers=bearer(a)).status_code == 200
    assert [c.get("/v1/models", headers=bearer(a)).status_code for _ in range(3)] == [200] * 3
    r = c.get("/v1/models", headers=bearer(a))
    body = assert_problem(
        r, 429, "rate limit of 1/s", "bursts of 3", "WELLTEMPERED_RATE_LIMIT_PER_SECOND"
    )
    assert r.headers["retry-after"] == "1"
    assert a not in r.text and body["rate_limit_burst"] == 3
    assert c.get("/v1/models", headers=bearer(b)).status_code == 200  # another key: unaffected
    for _ in range(5):  # an unknown key is a 401, whatever the rate
        assert_problem(c.get("/v1/models", headers=bearer("wt_" + "x" * 43)), 401)
    assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
    clock.now += 1.0  # one token back
    assert c.get("/v1/models", headers=bearer(a)).status_code == 200
    assert_problem(c.get("/v1/models", headers=bearer(a)), 429)
    # predict authorises itself, and is limited too (404: authorised, no such model)
    url, scores = "/v1/models/nothing/predict", {"logits": [[0.0, 1.0]]}
    for _ in range(3):
        assert_problem(c.post(url, json=scores, headers=bearer(predict_key)), 404)
    r = c.post(url, json=scores, headers=bearer(predict_key))
    assert_problem(r, 429, "WELLTEMPERED_RATE_LIMIT_BURST")
    assert r.headers["retry-after"] == "1"
    # counted by the key's namespace (two refusals of `a`, one of predict_key), not by key
    exposition = c.get("/metrics", headers=scraper).text
    assert rate_limited_total("rl-team-a", exposition) == before + 3
    assert rate_limited_total("rl-team-b", exposition) == 0
    assert a[:11] not in exposition and predict_key[:11] not in exposition
