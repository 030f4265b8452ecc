"""The real server with 2 workers (``welltempered serve --workers 2``) on SQLite and
PostgreSQL: /metrics (service/observe/metrics.py) adds up whichever worker answers, and
a real Prometheus scraping it evaluates every PromQL expression of the dashboard and the
alert rules.

One server per backend (module-scoped), traffic sent once; the Prometheus test reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.vocabulary import DEFAULT_NAMESPACE
from tests.helpers import skip_or_fail
from tests.service.helpers import (
    BACKENDS,
    answering_workers,
    logits_data,
    migrated_database,
)
from tests.test_deploy import ALERTS_YML, DASHBOARD, alert_exprs, dashboard_exprs, for_prometheus

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[3]
WELLTEMPERED = str(Path(sys.executable).with_name("welltempered"))
PREDICT_ROUTE = "/v1/models/{model}/predict"
FEEDBACK_ROUTE = "/v1/models/{model}/feedback"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def fresh() -> httpx.Client:
    """No keep-alive: every request is a new connection, so both workers get some."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)


def samples(exposition: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(exposition):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    """A 2-worker server with one model served and feedback received; what was sent."""
    tmp = tmp_path_factory.mktemp(f"serve-{request.param}")
    with migrated_database(request, request.param, tmp) as url:
        port = free_port()
        mp_dir = tmp / "prometheus-multiproc"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WELLTEMPERED_")}
        env.update(
            WELLTEMPERED_DATABASE_URL=url,
            WELLTEMPERED_DATA_DIR=str(tmp / "data"),
            WELLTEMPERED_AUTH="off",
            WELLTEMPERED_FIT_EXECUTOR="thread",
            PROMETHEUS_MULTIPROC_DIR=str(mp_dir),
            WELLTEMPERED_METRICS_ADDRESS="",  # no listener: a fixed port would clash
            WELLTEMPERED_SERVED_FLUSH_SECONDS="0.5",
        )
        log = (tmp / "serve.log").open("w")
        command = [WELLTEMPERED, "serve", "--workers", "2", "--port", str(port)]
        proc = subprocess.Popen(
            [*command, "--log-level", "warning"],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            with fresh() as c:

                def ready() -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"serve exited: {(tmp / 'serve.log').read_text()}")
                    return c.get(f"{base}/readyz").status_code == 200

                wait_until(ready, 60, "the server to be ready")
                sent = send_traffic(c, base, lambda: len(worker_pids(mp_dir)))
            yield {
                "base": base,
                "port": port,
                "mp_dir": mp_dir,
                "proc": proc,
                "sqlite": request.param == "sqlite",
                **sent,
            }
        finally:
            stop(proc)
            log.close()


def worker_pids(mp_dir: Path) -> set[int]:
    """The processes that have answered requests."""
    return answering_workers(mp_dir)


def send_traffic(c: httpx.Client, base: str, workers_seen: Callable[[], int]) -> dict:
    """Requests of every kind the test adds up, each on a new connection. The kernel
    hands a new connection to whichever worker wakes first (with uvloop one worker may
    take a run of them), so predicts go on until both workers have served some."""
    logits, labels = logits_data(800, k=4, seed=11)
    m = f"{base}/v1/models/m"
    assert c.post(f"{base}/v1/models", json={"name": "m", "num_classes": 4}).status_code == 201
    r = c.post(f"{m}/datasets", json={"logits": logits.tolist(), "labels": labels.tolist()})
    assert r.status_code == 201, r.text
    r = c.post(f"{m}/calibrators", json={"dataset_id": r.json()["id"], "method": "temperature"})
    assert r.status_code == 202, r.text
    wait_until(lambda: c.get(f"{m}/calibrators/1").json()["status"] == "succeeded", 60, "the fit")
    assert c.put(f"{m}/aliases/production", json={"version": 1}).status_code == 200
    time.sleep(1.1)  # the other worker's alias cache (ALIAS_CACHE_SECONDS) cannot be stale

    rows = predicts = 0
    i = 0
    while i < 40 or (workers_seen() < 2 and i < 1000):
        n = 1 + i % 7
        start = i % 700
        i += 1
        r = c.post(f"{m}/predict", json={"logits": logits[start : start + n].tolist()})
        assert r.status_code == 200, r.text
        rows, predicts = rows + n, predicts + 1
    bad = 0
    for _ in range(3):
        assert c.post(f"{m}/predict", json={"logits": [[1.0, 2.0]]}).status_code == 422
        bad += 1

    def feedback(start: int) -> int:
        part = slice(start, start + 25)
        body = {"logits": logits[part].tolist(), "labels": labels[part].tolist()}
        with fresh() as own:
            r = own.post(f"{m}/feedback", json=body)
        assert r.status_code == 200, r.text
        return 25

    # 4 concurrent writers into the same time bucket: the UPSERT must add, not overwrite.
    with ThreadPoolExecutor(4) as pool:
        sizes = list(pool.map(feedback, range(0, 300, 25)))
    feedback_rows, feedbacks = sum(sizes), len(sizes)
    return {
        "rows": rows,
        "predicts": predicts,
        "bad_predicts": bad,
        "feedback_rows": feedback_rows,
        "feedbacks": feedbacks,
    }


def test_two_workers_metrics_add_up(server):
    """Counters summed over both workers' files; database gauges equal on every scrape."""
    pids = worker_pids(server["mp_dir"])
    assert len(pids) >= 2, f"only {pids} served requests: the test needs both workers"
    seen = []
    with fresh() as c:
        for _ in range(8):
            r = c.get(f"{server['base']}/metrics")
            assert r.status_code == 200
            seen.append(samples(r.text))
    # auth is off: every model is in the default namespace
    model = (("model", "m"), ("namespace", DEFAULT_NAMESPACE))
    key = (*model, ("version", "1"))
    for fams in seen:
        predictions = fams["welltempered_predictions_total"]
        assert predictions == {key: server["rows"]}
        http = fams["welltempered_http_requests_total"]
        assert (
            http[(("method", "POST"), ("route", PREDICT_ROUTE), ("status", "2xx"))]
            == (server["predicts"])
        )
        assert (
            http[(("method", "POST"), ("route", PREDICT_ROUTE), ("status", "4xx"))]
            == (server["bad_predicts"])
        )
        assert (
            http[(("method", "POST"), ("route", FEEDBACK_ROUTE), ("status", "2xx"))]
            == (server["feedbacks"])
        )
        assert fams["welltempered_feedback_rows_total"][key] == server["feedback_rows"]
        assert fams["welltempered_live_labelled_rows"][key] == server["feedback_rows"]
        assert fams["welltempered_prediction_entropy_nats_count"][model] == (server["rows"])
        assert fams["welltempered_fit_duration_seconds_count"][(("method", "temperature"),)] == 1
        assert (
            fams["welltempered_fit_jobs"][(("namespace", "default"), ("status", "succeeded"))] == 1
        )
        assert fams["welltempered_database_up"][()] == 1
        for name in ("welltempered_live_ece_ratio", "welltempered_live_ece_bound_ratio"):
            assert fams[name] == seen[0][name]
    print(
        f"\nworkers {sorted(pids)}: predictions_total {server['rows']} rows over "
        f"{server['predicts']} requests, feedback {server['feedback_rows']} rows, "
        f"live ECE {seen[0]['welltempered_live_ece_ratio'][key]:.4f}"
    )


# ---------------------------------------------------------------------------
# a real Prometheus


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        skip_or_fail("prometheus not installed (run tools/ensure-promtool: Debian's prometheus)")
    return path


def query(c: httpx.Client, base: str, expr: str) -> dict:
    r = c.get(f"{base}/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


#: Dashboard metrics this server cannot produce: it runs with auth off, so no request
#: is ever rate limited (tests/service/security/test_auth.py checks that counter on a server
#: with keys and a limit; tests/test_deploy.py that the dashboard names it right).
NOT_FROM_THIS_SERVER = (
    "welltempered_rate_limited_requests_total",
    # no model here keeps feedback for a recalibration loop: tests/service/jobs/test_loop.py
    # checks the runs' series (every state of a model with runs), test_loop_server.py runs
    # the loop against real processes, and promtool the alert on it
    "welltempered_loop_runs",
)
#: ... and on SQLite, where the serve process runs fits without a job engine, no
#: heartbeats: the workers gauge is absent by design (its alert must never fire there).
NOT_FROM_SQLITE = ("welltempered_fit_workers_alive",)


def test_prometheus_evaluates_dashboard_and_alerts(server, tmp_path):
    binary = prometheus_binary()
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS_YML)],
        "scrape_configs": [
            {
                "job_name": "welltempered",
                "static_configs": [{"targets": [f"127.0.0.1:{server['port']}"]}],
            }
        ],
    }
    (tmp_path / "prom.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prom.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=30) as c:
            wait_until(lambda: c.get(f"{base}/-/ready").status_code == 200, 30, "Prometheus")
            # rate() needs two samples in its window
            wait_until(
                lambda: query(c, base, "count_over_time(welltempered_database_up[1m]) >= 2")[
                    "result"
                ],
                30,
                "three scrapes",
                interval=0.5,
            )
            with fresh() as s:  # more traffic between scrapes: rates are not all zero
                m = f"{server['base']}/v1/models/m"
                for _ in range(5):
                    s.post(f"{m}/predict", json={"logits": [[0.5, 1.0, -1.0, 2.0]]})
                # The label-shift verdict needs 200 served rows in the window.
                s.post(f"{m}/predict", json={"logits": [[0.5, 1.0, -1.0, 2.0]] * 200})
            time.sleep(1.5)  # one more scrape
            wait_until(  # the served counts flushed (SERVED_FLUSH_SECONDS) and scraped
                lambda: query(c, base, "welltempered_label_shift_p_value")["result"],
                30,
                "the label-shift verdict",
                interval=0.5,
            )

            dashboard = json.loads(DASHBOARD.read_text())
            exprs = [for_prometheus(e) for e in dashboard_exprs(dashboard)]
            empty = []
            absent = NOT_FROM_THIS_SERVER + (NOT_FROM_SQLITE if server["sqlite"] else ())
            for expr in exprs:
                if any(metric in expr for metric in absent):
                    query(c, base, expr)  # evaluates; tests/test_deploy.py checks the name
                    continue
                if expr.startswith("label_values("):  # Grafana's, not PromQL: its series
                    metric, _label = expr[len("label_values(") : -1].split(", ")
                    r = c.get(f"{base}/api/v1/series", params={"match[]": metric})
                    assert r.json()["status"] == "success" and r.json()["data"], expr
                    continue
                if not query(c, base, expr)["result"]:
                    empty.append(expr)
            assert empty == [], f"dashboard expressions without data: {empty}"
            for expr in alert_exprs():
                query(c, base, expr)  # must evaluate; an alert that does not fire has no data

            def rules_evaluated():
                groups = c.get(f"{base}/api/v1/rules").json()["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
                return rules if rules and done else None

            rules = wait_until(rules_evaluated, 15, "rule evaluation", interval=0.5)
            assert len(rules) == len(alert_exprs())
            bad = [
                (r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"
            ]
            assert bad == []
            print(
                f"\nPrometheus: {len(exprs)} dashboard expressions with data, "
                f"{len(rules)} alert rules healthy"
            )
    finally:
        stop(proc)
        log.close()
