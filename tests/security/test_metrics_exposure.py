"""No tenant's names on an open endpoint: /metrics needs a key of the metrics scope on the
API's address, the keyless metrics listener is loopback by default, and a real serve
(one worker and two) adds up every worker on the listener.

The names checked are distinctive on purpose: each tenant's namespace and model name
must appear nowhere in what a caller without the metrics key receives (body or headers),
and must appear in what the scraper receives (or the check would prove nothing).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import sessionmaker

from service import cli
from service.api.app import create_app
from service.security import keys
from service.server.exporter import parse_address
from service.storage.db import ApiKey, make_engine
from service.vocabulary import DEFAULT_ALIAS, METRICS_NAMESPACE, METRICS_SCOPE, TENANT_SCOPES
from tests.helpers import skip_or_fail
from tests.service.helpers import answering_workers, logits_data, make_settings
from tests.service.servers import Server, free_port

ROOT = Path(__file__).resolve().parents[2]
#: namespace -> model name: what must never leak.
TENANTS = {"acme-secret-ns": "fraud-detector-x91", "globex-hidden-ns": "churn-model-q7"}
SECRETS = (*TENANTS, *TENANTS.values())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def leaks(response) -> list[str]:
    """The tenants' names found anywhere in a response (status line aside), except those
    the caller put in the URL itself (a problem's ``instance`` echoes it)."""
    seen = response.text + " ".join(f"{k}: {v}" for k, v in response.headers.items())
    asked = str(response.request.url)
    return [name for name in SECRETS if name in seen and name not in asked]


def new_keys(database_url: str) -> dict[str, str]:
    """Keys: per tenant a write, predict and admin key; one metrics key."""
    engine = make_engine(database_url)
    try:
        with sessionmaker(engine, expire_on_commit=False)() as s:
            made = {
                f"{ns}/{scope}": keys.create_key(s, ns, scope)[1]
                for ns in TENANTS
                for scope in TENANT_SCOPES
            }
            made[METRICS_SCOPE] = keys.create_key(s, None, METRICS_SCOPE)[1]
    finally:
        engine.dispose()
    return made


def tenant_traffic(c, made: dict[str, str]) -> None:
    """Each tenant: a model, a dataset, a fitted and aliased version, predictions and
    feedback, so every kind of series carries its names."""
    z, y = logits_data(300, 3)
    for ns, model in TENANTS.items():
        h = bearer(made[f"{ns}/write"])
        m = f"/v1/models/{model}"
        assert (
            c.post("/v1/models", json={"name": model, "num_classes": 3}, headers=h).status_code
            == 201
        )
        r = c.post(f"{m}/datasets", json={"logits": z.tolist(), "labels": y.tolist()}, headers=h)
        assert r.status_code == 201, r.text
        r = c.post(
            f"{m}/calibrators",
            json={"dataset_id": r.json()["id"], "method": "temperature"},
            headers=h,
        )
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 60
        while c.get(f"{m}/calibrators/1", headers=h).json()["status"] != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (
            c.put(f"{m}/aliases/{DEFAULT_ALIAS}", json={"version": 1}, headers=h).status_code == 200
        )
        assert c.post(f"{m}/predict", json={"logits": z[:5].tolist()}, headers=h).status_code == 200
        feedback = {"logits": z[:10].tolist(), "labels": y[:10].tolist()}
        assert c.post(f"{m}/feedback", json=feedback, headers=h).status_code == 200


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exposure")
    url = f"sqlite:///{tmp / 'registry.sqlite3'}"
    settings = make_settings(url, tmp, auth="on", key_cache_seconds=0.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        made = new_keys(url)
        tenant_traffic(c, made)
        yield c, made, url


# ---------------------------------------------------------------------------
# the API's address


def test_unauthenticated_metrics_on_the_api_port_name_no_tenant(tenants):
    c, made, _ = tenants
    scraped = c.get("/metrics", headers=bearer(made[METRICS_SCOPE]))
    assert scraped.status_code == 200 and set(leaks(scraped)) == set(SECRETS)  # they exist
    for method, path, headers in [
        ("GET", "/metrics", {}),
        ("HEAD", "/metrics", {}),
        ("GET", "/metrics/", {}),
        ("GET", "/metrics?name[]=welltempered_predictions_total", {}),
        ("GET", "/metrics", {"Authorization": "Bearer "}),
        ("GET", "/metrics", bearer("wt_" + "x" * 43)),
        ("GET", "/metrics", {"Authorization": "Basic YWRtaW46YWRtaW4="}),
        ("POST", "/metrics", {}),
    ]:
        r = c.request(method, path, headers=headers, follow_redirects=True)
        assert r.status_code in (401, 405), (method, path, r.status_code)
        assert leaks(r) == [], (method, path, leaks(r))
    r = c.get("/metrics")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert r.headers["content-type"].startswith("application/problem+json")


def test_every_open_route_names_no_tenant(tenants):
    """Every GET route without a path parameter (from /openapi.json, plus the docs'
    own), asked without a key: those that answer (probes, docs, the OpenAPI document)
    and those that refuse carry no tenant's namespace or model name."""
    c, _, _ = tenants
    paths = [p for p, ops in c.get("/openapi.json").json()["paths"].items() if "get" in ops]
    paths += ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/nothing"]
    opened = []
    for path in paths:
        if "{" in path:
            continue
        r = c.get(path)
        assert r.status_code < 500, path
        assert leaks(r) == [], (path, leaks(r))
        if r.status_code not in (401, 404):
            opened.append(path)
    assert {"/healthz", "/readyz", "/openapi.json", "/docs"} <= set(opened)
    assert "/metrics" in paths and "/metrics" not in opened


def test_tenant_keys_cannot_read_metrics(tenants):
    c, made, _ = tenants
    for ns in TENANTS:
        for scope in TENANT_SCOPES:
            r = c.get("/metrics", headers=bearer(made[f"{ns}/{scope}"]))
            assert r.status_code == 403, (ns, scope, r.text)
            assert "'metrics' scope" in r.json()["detail"] and leaks(r) == []


def test_the_metrics_key_reads_metrics_and_nothing_else(tenants):
    c, made, _ = tenants
    h = bearer(made[METRICS_SCOPE])
    model = TENANTS["acme-secret-ns"]
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{model}", None),
        ("POST", f"/v1/models/{model}/predict", {"logits": [[0.0, 1.0, 2.0]]}),
        ("POST", "/v1/models", {"name": "x", "num_classes": 3}),
        ("GET", "/v1/keys", None),
        ("POST", "/v1/keys", {"scope": "predict"}),
    ]:
        r = c.request(method, path, json=body, headers=h)
        assert r.status_code == 403, (method, path, r.text)
        assert leaks(r) == [], (path, leaks(r))


def test_an_admin_cannot_mint_list_or_revoke_a_metrics_key(tenants):
    c, made, url = tenants
    admin = bearer(made["acme-secret-ns/admin"])
    r = c.post("/v1/keys", json={"scope": METRICS_SCOPE}, headers=admin)
    assert r.status_code == 422, r.text
    listed = c.get("/v1/keys", headers=admin).json()["keys"]
    assert {k["scope"] for k in listed} == set(TENANT_SCOPES)
    engine = make_engine(url)
    with sessionmaker(engine)() as s:
        (row,) = s.query(ApiKey).filter(ApiKey.scope == METRICS_SCOPE).all()
        assert row.namespace == METRICS_NAMESPACE
    engine.dispose()
    assert c.delete(f"/v1/keys/{row.id}", headers=admin).status_code == 404
    assert c.get("/metrics", headers=bearer(made[METRICS_SCOPE])).status_code == 200


def test_keys_cli_creates_metrics_keys_without_a_namespace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", f"sqlite:///{tmp_path / 'k.sqlite3'}")
    assert cli.main(["keys", "--create-database", "create", "--scope", METRICS_SCOPE]) == 0
    out = capsys.readouterr().out
    assert f"namespace {METRICS_NAMESPACE!r}" in out and out.strip().splitlines()[-1].startswith(
        "wt_"
    )
    assert cli.main(["keys", "create", "--scope", METRICS_SCOPE, "--namespace", "team-a"]) == 2
    assert "belongs to none" in capsys.readouterr().err
    assert cli.main(["keys", "create", "--scope", "write"]) == 2
    assert "give one" in capsys.readouterr().err
    assert cli.main(["keys", "create", "--scope", "write", "--namespace", "*"]) == 2
    capsys.readouterr()
    assert cli.main(["keys", "list"]) == 0
    assert METRICS_SCOPE in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad", ["9464", "localhost", "127.0.0.1:", "127.0.0.1:0", ":9464", "h:99999", "h:x"]
)
def test_a_malformed_metrics_address_is_refused(bad):
    with pytest.raises(ValueError, match="WELLTEMPERED_METRICS_ADDRESS"):
        parse_address(bad)


# ---------------------------------------------------------------------------
# a real server: the listener, workers, Prometheus


def counter_total(exposition: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
def served(request, tmp_path_factory):
    """A real serve with auth on, the metrics listener on a free loopback port, tenant
    traffic, and 30 more GETs on fresh connections (both workers get some)."""
    tmp = tmp_path_factory.mktemp(f"listener-{request.param}")
    url = f"sqlite:///{tmp / 'registry.sqlite3'}"
    listen = free_port()
    server = Server(
        url,
        tmp / "data",
        "--workers",
        str(request.param),
        AUTH="on",
        KEY_CACHE_SECONDS="0",
        METRICS_ADDRESS=f"127.0.0.1:{listen}",
        FIT_EXECUTOR="thread",
    )
    with server, server.client() as c:
        made = new_keys(url)
        tenant_traffic(c, made)
        h = bearer(made[f"{next(iter(TENANTS))}/write"])

        def get(_) -> int:
            with server.client() as own:  # its own connection: any worker may take it
                return own.get("/v1/models", headers=h).status_code

        gets, mp_dir = 0, tmp / "data" / "prometheus-multiproc"
        with ThreadPoolExecutor(8) as pool:
            while True:  # until every worker has answered some (the kernel picks)
                assert set(pool.map(get, range(16))) == {200}
                gets += 16
                if request.param == 1 or len(answering_workers(mp_dir)) >= 2:
                    break
                assert gets < 800, "one worker took every connection"
        listener = f"http://127.0.0.1:{listen}"
        yield {"server": server, "keys": made, "listener": listener, "gets": gets}


@pytest.mark.slow
@pytest.mark.process
def test_the_listener_adds_up_every_worker_and_the_api_port_stays_closed(served):
    server, made = served["server"], served["keys"]
    with httpx.Client(timeout=30) as c:
        listened = c.get(f"{served['listener']}/metrics")
        assert listened.status_code == 200 and set(leaks(listened)) == set(SECRETS)
        gets = counter_total(
            listened.text, "welltempered_http_requests_total", route="/v1/models", method="GET"
        )
        assert gets == served["gets"]  # every worker's requests, whichever answered
        keyed = c.get(f"{server.base}/metrics", headers=bearer(made[METRICS_SCOPE]))
        assert keyed.status_code == 200
        assert (
            counter_total(
                keyed.text, "welltempered_http_requests_total", route="/v1/models", method="GET"
            )
            == served["gets"]
        )
        for name in ("welltempered_predictions_total", "welltempered_feedback_rows_total"):
            assert counter_total(listened.text, name) == counter_total(keyed.text, name) > 0
        open_ = c.get(f"{server.base}/metrics")
        assert open_.status_code == 401 and leaks(open_) == []
        assert c.get(f"{served['listener']}/other").status_code == 404
        assert c.post(f"{served['listener']}/metrics").status_code == 405


@pytest.mark.slow
@pytest.mark.process
def test_serve_refuses_a_metrics_address_it_cannot_use(tmp_path):
    exe = Path(sys.executable).with_name("welltempered")
    env = {
        **os.environ,
        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{tmp_path / 'r.sqlite3'}",
        "WELLTEMPERED_DATA_DIR": str(tmp_path / "data"),
        "WELLTEMPERED_AUTH": "off",
    }
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for address, words in [
            (f"127.0.0.1:{taken.getsockname()[1]}", "cannot listen for metrics"),
            ("no-port", "host:port"),
        ]:
            done = subprocess.run(
                [str(exe), "serve", "--port", str(free_port())],
                env={**env, "WELLTEMPERED_METRICS_ADDRESS": address},
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
            )
            assert done.returncode == 2 and words in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.process
def test_prometheus_scrapes_the_api_port_with_a_metrics_key_and_the_listener(served, tmp_path):
    """deploy/prometheus/scrape-api-with-key.yml as documented (a metrics key in
    credentials_file beside it), and compose's way (the listener, no key): both up."""
    binary = shutil.which("prometheus")
    if binary is None:
        skip_or_fail("prometheus not installed (run tools/ensure-promtool: Debian's prometheus)")
    server = served["server"]
    config = yaml.safe_load(
        (ROOT / "deploy" / "prometheus" / "scrape-api-with-key.yml").read_text()
    )
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "metrics-token").write_text(served["keys"][METRICS_SCOPE] + "\n")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
    job["scrape_interval"] = config["global"]["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    listener = {
        "job_name": "listener",
        "scrape_interval": "1s",
        "static_configs": [{"targets": [served["listener"].removeprefix("http://")]}],
    }
    config["scrape_configs"].append(listener)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    r = c.get(f"http://127.0.0.1:{port}/api/v1/targets")
                    targets = r.json()["data"]["activeTargets"] if r.status_code == 200 else []
                except httpx.TransportError:
                    targets = []
                health = {t["labels"]["job"]: t["health"] for t in targets}
                if health == {"welltempered": "up", "listener": "up"}:
                    break
                assert time.monotonic() < deadline, (health, [t.get("lastError") for t in targets])
                time.sleep(0.5)
            q = c.get(
                f"http://127.0.0.1:{port}/api/v1/query",
                params={"query": "count by (job) (welltempered_predictions_total)"},
            ).json()
            jobs = {r["metric"]["job"] for r in q["data"]["result"]}
            assert jobs == {"welltempered", "listener"}, q
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
