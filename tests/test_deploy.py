"""The deployment files (Docker cannot run here): docker-compose.yml, the Dockerfile,
Prometheus's config and alert rules, Grafana's provisioning and dashboard.

Every welltempered_* metric used by a PromQL expression of the dashboard or the alert
rules must exist in the exposition of service.observe.metrics; Prometheus's own
``promtool`` checks the config, the rules, the rules' unit tests, and the syntax of
every dashboard expression. The live-Prometheus test (a real server scraping a running
service) lives with the service tests.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.observe import metrics as obs
from service.observe.monitoring import format_window
from service.settings import Settings
from tests import fleet_lb
from tests.fleet_lb import haproxy_binary
from tests.helpers import WHEEL_SOURCES, skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS_WITH_KEY_YML = ROOT / "deploy" / "prometheus" / "scrape-api-with-key.yml"
ALERTS_YML = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST_YML = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "welltempered.json"
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"

METRIC = re.compile(r"\bwelltempered_[a-z0-9_]+")
#: Labels PromQL may group by besides the metric's own: bucket bound and target labels.
EXTRA_LABELS = {"le", "instance", "job"}


def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query or "")
    return [e for e in exprs if e]


def alert_exprs() -> list[str]:
    return [rule["expr"] for group in load_yaml(ALERTS_YML)["groups"] for rule in group["rules"]]


#: The dashboard's template variables, each "All" (``.*``) when sent to Prometheus.
TEMPLATE_VARIABLES = re.compile(r"\$(?:namespace|model)\b")


def for_prometheus(expr: str) -> str:
    """A dashboard expression as Prometheus receives it from Grafana."""
    return TEMPLATE_VARIABLES.sub(".*", expr.replace("$__rate_interval", "1m"))


# ---------------------------------------------------------------------------
# metric names


@pytest.fixture(scope="module")
def exposition() -> str:
    """Families of /metrics after every metric was touched once (and a full snapshot)."""
    metrics = obs.ServiceMetrics()
    metrics.observe_request("/v1/models/{model}/predict", "POST", 200, 0.01)
    metrics.observe_predictions("ns", "deploy-test", 1, np.array([0.5]), np.array([0.8]), flipped=0)
    metrics.observe_feedback("ns", "deploy-test", 1, 1)
    metrics.observe_fit("temperature", 0.1)
    metrics.observe_rate_limited("ns")
    metrics.observe_array_cache(hits=1, misses=1, evictions=1)
    value = {
        "namespace": "ns",
        "model": "m",
        "version": 1,
        "alias": "production",
        "status": "queued",
        "quantile": "0.5",
    }
    snapshot = {
        key: [({name: value[name] for name in spec.labels}, 0.5)]
        for key, spec in obs.DB_GAUGES.items()
    }
    body, _ = metrics.render(lambda: snapshot, lambda: 100)
    return body.decode()


def sample_names(exposition: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(exposition) for s in fam.samples}


def family_of(name: str) -> str:
    """The METRICS entry a series name belongs to (histogram/counter suffixes stripped)."""
    if name in obs.METRICS:
        return name
    for suffix in ("_bucket", "_count", "_sum"):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and obs.METRICS.get(base, ("",))[0] == "histogram":
            return base
    raise AssertionError(f"{name} is not a welltempered metric (nor a histogram series)")


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_used_exists_in_the_exposition(source, dashboard, exposition):
    exprs = dashboard_exprs(dashboard) if source == "dashboard" else alert_exprs()
    used = {m for expr in exprs for m in METRIC.findall(expr)}
    assert used, "no welltempered_* metric found"
    served = sample_names(exposition)
    for name in sorted(used):
        family = family_of(name)
        assert name in served, f"{name} ({source}) is not in /metrics"
        kind = obs.METRICS[family][0]
        assert re.search(rf"^# HELP {family} \S", exposition, re.M), family
        assert re.search(rf"^# TYPE {family} {kind}$", exposition, re.M), family


def test_every_metric_is_shown_somewhere(dashboard):
    """No dead metric: each one is on the dashboard or in an alert rule."""
    used = {
        family_of(m) for e in dashboard_exprs(dashboard) + alert_exprs() for m in METRIC.findall(e)
    }
    assert set(obs.METRICS) - used == set()


def test_label_names_in_expressions_exist(dashboard):
    for expr in dashboard_exprs(dashboard) + alert_exprs():
        for name, matchers in re.findall(r"(welltempered_[a-z0-9_]+)\{([^}]*)\}", expr):
            family = family_of(name)
            allowed = set(obs.METRICS[family][1]) | ({"le"} if name.endswith("_bucket") else set())
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in allowed, (expr, name, label)
        # Grouping labels: those of a metric of the expression, or Prometheus's own.
        own = {label for m in METRIC.findall(expr) for label in obs.METRICS[family_of(m)][1]}
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in own | EXTRA_LABELS, (expr, label)


def test_model_is_always_qualified_by_its_namespace(dashboard):
    """Model names are unique per namespace only: every selector, grouping and legend that
    names the model names the namespace too, and every series with a model label has a
    namespace label (first)."""
    for name, (_, labels) in obs.METRICS.items():
        if "model" in labels:
            assert labels[0] == "namespace", (name, labels)
    for expr in dashboard_exprs(dashboard) + alert_exprs():
        for matchers in re.findall(r"welltempered_[a-z0-9_]+\{([^}]*)\}", expr):
            if re.search(r"\bmodel\s*=", matchers):
                assert re.search(r"\bnamespace\s*=~\s*\"\$namespace\"", matchers), expr
        for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            labels = {x.strip() for x in group.split(",")}
            assert "model" not in labels or "namespace" in labels, (expr, group)
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            assert "{{model}}" not in legend or "{{namespace}}" in legend, legend
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables.index("namespace") < variables.index("model")
    (model_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert '{namespace=~"$namespace"}' in model_var["query"]["query"]


def test_alert_annotations_name_the_namespace():
    for group in load_yaml(ALERTS_YML)["groups"]:
        for rule in group["rules"]:
            for text in rule["annotations"].values():
                if "$labels.model" in text:
                    assert "$labels.namespace" in text, (rule["alert"], text)


def test_the_expected_accuracy_window_is_the_monitoring_window(dashboard):
    """The label-free expected accuracy is PromQL over per-process counters, so its window
    is a literal range; the realised accuracy it is compared with is the live window of
    MONITORING_WINDOW_SECONDS. The two must be the same window, and no deploy file may
    move one without the other."""
    window = format_window(Settings.model_fields["monitoring_window_seconds"].default)
    exprs = [
        e
        for e in dashboard_exprs(dashboard) + alert_exprs()
        if "welltempered_prediction_confidence_total" in e
    ]
    assert exprs
    for expr in exprs:
        assert set(re.findall(r"\[([^\]]+)\]", expr)) == {window}, expr
    for path in (COMPOSE, *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.sh")):
        assert "MONITORING_WINDOW_SECONDS" not in path.read_text(), path


def test_database_gauges_are_aggregated_with_max_or_min(dashboard):
    """They are identical on every replica: summing them would multiply by the replicas."""
    db_names = {spec.name for spec in obs.DB_GAUGES.values()} | {"welltempered_database_up"}
    for expr in dashboard_exprs(dashboard) + alert_exprs():
        for name in db_names & set(METRIC.findall(expr)):
            summed = rf"\bsum\s*(?:(?:by|without)\s*\([^()]*\))?\s*\(\s*{name}\b"
            assert not re.search(summed, expr), expr


# ---------------------------------------------------------------------------
# docker-compose.yml


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out.append((source, target))
    return out


#: The services of the fleet that run the application image.
APP_SERVICES = ("migrate", "api", "worker")


def named_volumes(service: dict) -> dict[str, str]:
    """A service's named volumes (not bind mounts): volume name -> mount path."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith((".", "/")):
            out[source] = target
    return out


def seconds(duration: str) -> float:
    """A compose or HAProxy duration ("40s", "1m30s", "500ms") in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_services_and_start_order(compose):
    services = compose["services"]
    assert {"api", "worker", "lb", "postgres", "migrate", "prometheus", "grafana"} <= set(services)

    pg = services["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])

    migrate = services["migrate"]
    assert migrate["command"][:2] == ["welltempered", "migrate"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart", "no") == "no"

    # Neither API replicas nor workers start before the schema is migrated: both
    # refuse an unmigrated PostgreSQL database (exit status 2).
    for name in ("api", "worker"):
        service = services[name]
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", (
            name
        )
        assert service["build"] == migrate["build"] == ".", name
        assert service["image"] == migrate["image"], name

    api = services["api"]
    command = api["command"]
    assert command[:2] == ["welltempered", "serve"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert int(command[command.index("--workers") + 1]) > 1
    assert "/readyz" in " ".join(api["healthcheck"]["test"])

    worker = services["worker"]
    assert worker["command"][:2] == ["welltempered", "worker"]
    # The image's HEALTHCHECK asks the API port, which a worker does not serve.
    assert worker["healthcheck"] == {"disable": True}


def test_compose_runs_a_fleet(compose):
    """Two API-only replicas behind the load balancer, two fit workers, one array
    volume mounted at the same path (their DATA_DIR) in every one of them."""
    services = compose["services"]
    api, worker, lb = services["api"], services["worker"], services["lb"]
    assert api["deploy"]["replicas"] == 2
    assert worker["deploy"]["replicas"] == 2
    assert api["environment"]["WELLTEMPERED_RUN_FITS"] == "false"
    assert worker["environment"].get("WELLTEMPERED_RUN_FITS", "true") != "false"
    assert "container_name" not in api and "container_name" not in worker  # replicas

    api_arrays, worker_arrays = named_volumes(api), named_volumes(worker)
    shared = set(api_arrays) & set(worker_arrays)
    assert len(shared) == 1, (api_arrays, worker_arrays)
    (volume,) = shared
    assert volume in compose["volumes"]
    path = api_arrays[volume]
    assert worker_arrays[volume] == path
    for service in (api, worker):
        assert service["environment"]["WELLTEMPERED_DATA_DIR"] == path
        url = service["environment"]["WELLTEMPERED_DATABASE_URL"]
        assert url == services["migrate"]["environment"]["WELLTEMPERED_DATABASE_URL"]

    # Only the load balancer is published: the replicas are reached through it.
    assert "ports" not in api and "ports" not in worker
    assert lb["ports"] == ["8000:8000"]
    assert lb["image"].startswith("haproxy:")
    assert lb["depends_on"]["api"]["condition"] in ("service_started", "service_healthy")
    config_path = dict(bind_mounts(lb))["./deploy/haproxy/haproxy.cfg"]
    assert config_path == "/usr/local/etc/haproxy/haproxy.cfg"  # the image's default

    # HAProxy finds the replicas by the service's DNS name, on the port they serve.
    config = HAPROXY_CFG.read_text()
    port = api["command"][api["command"].index("--port") + 1]
    assert f"{port}" in api["expose"]
    (template,) = re.findall(r"(?m)^\s+server-template \S+ (\d+) (\S+)$", config)
    slots, address = template
    assert address == f"api:{port}"
    assert int(slots) >= api["deploy"]["replicas"]
    assert re.search(r"(?m)^\s+bind :8000$", config)


def test_compose_stop_grace_periods_cover_the_service_grace(compose):
    """docker stops a container with SIGTERM, then SIGKILL after stop_grace_period (10 s
    by default): each one must outlast what its process does on SIGTERM, or a clean stop
    becomes a kill (a worker's fit would wait for its heartbeat to expire)."""
    services = compose["services"]
    api, worker, lb = services["api"], services["worker"], services["lb"]
    api_grace = float(api["environment"]["WELLTEMPERED_SHUTDOWN_GRACE_SECONDS"])
    assert seconds(api["stop_grace_period"]) > api_grace
    fit_grace = float(worker["environment"]["WELLTEMPERED_FIT_GRACE_SECONDS"])
    assert seconds(worker["stop_grace_period"]) > fit_grace + 5
    (hard_stop,) = re.findall(r"(?m)^\s+hard-stop-after (\S+)$", HAPROXY_CFG.read_text())
    assert seconds(lb["stop_grace_period"]) > seconds(hard_stop)
    for service in (api, worker):
        assert service.get("init") is True  # tini: signals reach the process, children reaped


def test_compose_environment(compose):
    services = compose["services"]
    for name in APP_SERVICES:
        url = services[name]["environment"]["WELLTEMPERED_DATABASE_URL"]
        assert url.startswith("postgresql+psycopg://") and "@postgres:5432/" in url
    api = services["api"]
    mp_dir = api["environment"]["PROMETHEUS_MULTIPROC_DIR"]
    assert mp_dir in api["tmpfs"]
    pg_env = services["postgres"]["environment"]
    assert f"{pg_env['POSTGRES_USER']}:" in url and url.endswith("/" + pg_env["POSTGRES_DB"])


def test_compose_mounts_exist_and_match_the_configs(compose):
    services = compose["services"]
    for name, service in services.items():
        for source, _ in bind_mounts(service):
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"

    prom = dict(bind_mounts(services["prometheus"]))
    assert prom["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    config_dir = Path(prom["./deploy/prometheus/prometheus.yml"]).parent
    for rule_file in load_yaml(PROMETHEUS_YML)["rule_files"]:
        target = str(config_dir / rule_file)
        assert target in prom.values(), f"rule file {rule_file} is not mounted at {target}"
        source = next(s for s, t in prom.items() if t == target)
        assert (ROOT / source).resolve() == (PROMETHEUS_YML.parent / rule_file).resolve()
    assert (
        f"--config.file={prom['./deploy/prometheus/prometheus.yml']}"
        in (services["prometheus"]["command"])
    )

    graf = dict(bind_mounts(services["grafana"]))
    assert graf["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = load_yaml(GRAFANA / "provisioning" / "dashboards" / "welltempered.yml")
    assert provider["providers"][0]["options"]["path"] == graf["./deploy/grafana/dashboards"]
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == graf["./deploy/grafana/dashboards"] + "/" + DASHBOARD.name


def test_scrape_config_points_at_the_metrics_listener(compose):
    """Compose's Prometheus scrapes each replica's metrics listener (no key) on the compose
    network; that port is never published, only the API's is."""
    config = load_yaml(PROMETHEUS_YML)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "welltempered"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    api = compose["services"]["api"]
    host, port = api["environment"]["WELLTEMPERED_METRICS_ADDRESS"].rsplit(":", 1)
    assert sd["names"] == ["api"] and sd["port"] == int(port) and host == "0.0.0.0"
    # Never the listener's port: the replicas publish nothing (the load balancer, 8000,
    # refuses /metrics).
    assert "ports" not in api
    for service in compose["services"].values():
        assert not any(str(m).endswith(f":{port}") for m in service.get("ports", []))


def test_scrape_config_points_at_each_workers_listener(compose):
    """Each fit worker's metrics listener (the fits it ran) is a target of its own job, on
    the compose network; its metric files on a tmpfs at the image's multiprocess
    directory; every job is covered by the target-down alert."""
    config = load_yaml(PROMETHEUS_YML)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "welltempered-worker"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    worker = compose["services"]["worker"]
    host, port = worker["environment"]["WELLTEMPERED_WORKER_METRICS_ADDRESS"].rsplit(":", 1)
    assert sd["names"] == ["worker"] and sd["port"] == int(port) and host == "0.0.0.0"
    assert port in worker["expose"] and "ports" not in worker
    for service in compose["services"].values():
        assert not any(str(m).endswith(f":{port}") for m in service.get("ports", []))
    (mp_dir,) = re.findall(r"PROMETHEUS_MULTIPROC_DIR=(\S+)", DOCKERFILE.read_text())
    assert worker.get("environment", {}).get("PROMETHEUS_MULTIPROC_DIR", mp_dir) in worker["tmpfs"]
    (target_down,) = [
        rule["expr"]
        for group in load_yaml(ALERTS_YML)["groups"]
        for rule in group["rules"]
        if rule["alert"] == "WelltemperedTargetDown"
    ]
    (jobs,) = re.findall(r'up\{job=~"([^"]+)"\}', target_down)
    ours = {j["job_name"] for j in config["scrape_configs"] if j["job_name"] != "prometheus"}
    assert set(jobs.split("|")) == ours == {"welltempered", "welltempered-worker"}


def test_tenant_wide_views_are_published_on_loopback_only(compose):
    """Prometheus and Grafana show every namespace's series, like /metrics: the host
    publishes them on 127.0.0.1 only."""
    for name in ("prometheus", "grafana"):
        for mapping in compose["services"][name]["ports"]:
            assert mapping.startswith("127.0.0.1:"), (name, mapping)


def test_scraping_the_api_port_takes_a_metrics_key():
    """The example for a Prometheus outside the compose network: the API's /metrics with
    a bearer credentials file."""
    config = load_yaml(PROMETHEUS_WITH_KEY_YML)
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "metrics-token"}
    assert all(t.endswith(":8000") for t in job["static_configs"][0]["targets"])


def test_grafana_datasource_is_the_one_the_dashboard_uses(compose, dashboard):
    (source,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in compose["services"]["prometheus"]["ports"]
    for panel in dashboard_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"]


def test_dashboard_layout(dashboard):
    assert dashboard["title"] == "welltempered: calibration"
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("ece", "entropy", "confidence", "prediction rate", "argmax", "latency", "fit"):
        assert topic in titles, topic
    assert any(p["type"] == "heatmap" for p in panels)


# ---------------------------------------------------------------------------
# Dockerfile


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat.removeprefix("**/")) or fnmatch.fnmatch(p, pat)
        for p in prefixes
        for pat in patterns
    )


def test_dockerfile():
    text = DOCKERFILE.read_text()
    instructions = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()]
    instructions = [line for line in instructions if not line.startswith("#")]
    froms = [line.split()[1] for line in instructions if line.startswith("FROM ")]
    assert froms and all(f == "python:3.11-slim" for f in froms)
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert "torch" not in text.lower().replace("torch is a test-only", "")
    (cmd,) = [json.loads(line[4:]) for line in instructions if line.startswith("CMD ")]
    assert cmd[:2] == ["welltempered", "serve"] and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "PROMETHEUS_MULTIPROC_DIR=" in text
    patterns = dockerignore_patterns()
    copied = []
    for line in instructions:
        if line.startswith("COPY ") and "--from=" not in line:
            copied.extend(line.split()[1:-1])
    # What tests/test_packaging.py builds its wheel from.
    assert set(WHEEL_SOURCES) <= set(copied)
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not is_ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    installs = [line.split() for line in instructions if "pip install" in line]
    assert installs, "no pip install in the Dockerfile"
    for words in installs:
        assert "-e" not in words and "--editable" not in words, " ".join(words)
    assert ["RUN", "pip", "install", "."] in installs
    # The runtime stage takes the venv only, not the source tree of the build stage.
    from_build = [line.split()[1:] for line in instructions if line.startswith("COPY --from=")]
    assert from_build == [["--from=build", "/opt/venv", "/opt/venv"]]
    (entry,) = [json.loads(line[11:]) for line in instructions if line.startswith("ENTRYPOINT ")]
    script = ROOT / "deploy" / "api" / "entrypoint.sh"
    assert f"COPY deploy/api/entrypoint.sh /usr/local/bin/{entry[0]}" in instructions
    assert os.access(script, os.X_OK)
    assert 'exec "$@"' in script.read_text()


@pytest.mark.process
def test_entrypoint_wipes_only_metric_files(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    (mp_dir / "counter_1.db").write_text("old")
    (mp_dir / "keep.txt").write_text("not a metric file")
    done = subprocess.run(
        [
            str(ROOT / "deploy" / "api" / "entrypoint.sh"),
            "sh",
            "-c",
            "ls $PROMETHEUS_MULTIPROC_DIR",
        ],
        env={"PATH": os.environ["PATH"], "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["keep.txt"]


# ---------------------------------------------------------------------------
# Prometheus's own tools


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        skip_or_fail("promtool not installed (run tools/ensure-promtool: Debian's prometheus)")
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.process
def test_promtool_check_config():
    done = run(promtool(), "check", "config", str(PROMETHEUS_YML))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_promtool_check_config_with_a_metrics_key(tmp_path):
    """promtool requires the credentials file to exist: a stand-in key beside a copy."""
    for path in (PROMETHEUS_WITH_KEY_YML, ALERTS_YML):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "metrics-token").write_text("wt_" + "x" * 43 + "\n")
    done = run(promtool(), "check", "config", str(tmp_path / PROMETHEUS_WITH_KEY_YML.name))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_promtool_check_rules():
    done = run(promtool(), "check", "rules", str(ALERTS_YML))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_promtool_alert_unit_tests():
    done = run(promtool(), "test", "rules", str(ALERTS_TEST_YML))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_promtool_parses_every_dashboard_expression(dashboard, tmp_path):
    """promtool has no query linter: wrap each expression in a recording rule."""
    exprs = [for_prometheus(e) for e in dashboard_exprs(dashboard) if "label_values" not in e]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = run(promtool(), "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


@pytest.mark.process
def test_haproxy_config_is_valid():
    """deploy/haproxy/haproxy.cfg parses (unresolvable replica names are allowed: they
    resolve at run time), keeps the slow-client timeouts of docs/operations.md, and has
    what a rolling restart needs: /readyz checks, retries on another replica, replays
    limited to requests that may be repeated."""
    done = run(haproxy_binary(), "-c", "-f", str(HAPROXY_CFG))
    assert done.returncode == 0, done.stdout + done.stderr
    text = HAPROXY_CFG.read_text()
    for line in (
        "timeout http-request 10s",
        "timeout client 20s",
        "option http-buffer-request",
        "option httpchk GET /readyz",
        "http-check expect status 200",
        "retries 3",
        "option redispatch 1",
        "retry-on conn-failure empty-response",
        "http-request disable-l7-retry unless replayable",
    ):
        assert re.search(rf"(?m)^\s+{re.escape(line)}$", text), line


def test_fleet_lb_renders_the_deployed_config():
    """tests/fleet_lb.py runs haproxy.cfg itself, with local servers instead of Docker's
    DNS: everything but the bind address, the server lines and the stats socket is the
    shipped file."""
    config = fleet_lb.haproxy_config(
        [("127.0.0.2", 8001), ("127.0.0.3", 8001)], ("127.0.0.1", 9000), "/tmp/lb.sock"
    )
    lines = config.splitlines()
    assert "    bind 127.0.0.1:9000" in lines and "    bind :8000" not in lines
    assert not any("server-template" in line for line in lines)
    servers = [line.split()[1:3] for line in lines if line.lstrip().startswith("server ")]
    assert servers == [["s1", "127.0.0.2:8001"], ["s2", "127.0.0.3:8001"]]
    assert "    stats socket /tmp/lb.sock mode 600 level admin" in lines
    shipped = [
        line
        for line in HAPROXY_CFG.read_text().splitlines()
        if not re.match(r"\s+(?:bind|server-template) ", line)
    ]
    assert [line for line in lines if line in shipped] == shipped


#: A trivial replica for the load-balancer tests: /readyz and /whoami answer its name;
#: a POST answers its name too, or, with "drop", gets its connection closed unanswered
#: (a replica dying mid-request). Every POST is logged, one line each.
REPLICA = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

host, port, name, log, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        # One write: a replica killed between its head and its body (send_response's
        # head, then the body) sent a head that promised a body it never sent, which
        # the balancer may not replay. Killed before this write, the request is
        # unanswered (replayed); after it, answered whole.
        body = name.encode()
        head = "HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body)
        self.wfile.write(head.encode() + body)

    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(log, "a") as f:
            f.write(self.path + "\\n")
        if mode == "drop":
            self.close_connection = True
            return
        self.answer()

    def log_message(self, *args):
        pass


ThreadingHTTPServer.allow_reuse_address = True
ThreadingHTTPServer((host, port), Handler).serve_forever()
"""


class Replica:
    """A :data:`REPLICA` process on ``host:port`` (the same port again on restart)."""

    def __init__(self, host: str, name: str, log: Path, mode: str = "answer"):
        self.host, self.name, self.log, self.mode = host, name, log, mode
        self.port = fleet_lb.free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def start(self) -> Replica:
        args = [self.host, str(self.port), self.name, str(self.log), self.mode]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", REPLICA, *args], stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 15
        while not fleet_lb._listening(self.address):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.name
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """SIGTERM: http.server dies at once, requests in flight included."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def posts(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def replicas(tmp_path):
    started: list[Replica] = []

    def make(host: str, name: str, mode: str = "answer") -> Replica:
        replica = Replica(host, name, tmp_path / f"{name}.log", mode).start()
        started.append(replica)
        return replica

    yield make
    for replica in started:
        replica.stop()


@pytest.mark.process
def test_rolling_restart_behind_haproxy_loses_no_request(replicas):
    """Two replicas behind haproxy.cfg (tests/fleet_lb.py) and 8 clients, reading and
    predicting. Each replica in turn is killed (requests in flight die with it) and
    started again: every request is answered 200, by the replica that is up."""
    a, b = replicas("127.0.0.2", "a"), replicas("127.0.0.3", "b")
    with fleet_lb.running_haproxy([a.address, b.address]) as lb:
        lb.wait_until_up(2)
        stop = threading.Event()
        answers: list[str] = []
        failures: list[str] = []

        def client(i: int) -> None:
            with httpx.Client(base_url=lb.base_url, timeout=10) as c:
                n = 0
                while not stop.is_set():
                    n += 1
                    try:
                        if n % 2:
                            r = c.get("/whoami")
                        else:
                            r = c.post("/v1/models/m/predict", json={"logits": [[0.0, 1.0]]})
                    except httpx.HTTPError as exc:
                        failures.append(f"client {i}: {exc!r}")
                        continue
                    if r.status_code == 200:
                        answers.append(r.text)
                    else:
                        failures.append(f"client {i}: {r.status_code} {r.text[:200]}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            for replica, server in ((a, "s1"), (b, "s2")):
                replica.stop()
                lb.wait_until({server: "DOWN"})
                time.sleep(0.5)  # traffic on the other replica alone
                replica.start()
                lb.wait_until({server: "UP"})
                time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
    assert failures == [], failures[:10]
    assert len(answers) > 100
    assert set(answers) == {"a", "b"}


@pytest.mark.process
def test_haproxy_replays_only_requests_that_may_be_repeated(replicas):
    """A replica that closes the connection without answering (it died mid-request):
    predict and a keyed feedback are replayed on the other replica; a fit is sent once,
    and its client gets no answer (a 502, or its own connection closed, as HAProxy does
    for a request that came on a kept-alive connection): a replay could queue a second
    version."""
    drop, good = replicas("127.0.0.2", "drop", "drop"), replicas("127.0.0.3", "good")

    def outcome(c: httpx.Client, path: str, **kwargs) -> int | str:
        try:
            return c.post(path, json={}, **kwargs).status_code
        except httpx.RemoteProtocolError:
            return "closed"

    fit = "/v1/models/m/calibrators"
    with fleet_lb.running_haproxy([drop.address, good.address]) as lb:
        lb.wait_until_up(2)
        with httpx.Client(base_url=lb.base_url, timeout=10) as c:
            predicts = [outcome(c, "/v1/models/m/predict") for _ in range(20)]
            keyed = [
                outcome(c, "/v1/models/m/feedback", headers={"Idempotency-Key": f"k{i}"})
                for i in range(20)
            ]
            fits = [outcome(c, fit) for _ in range(20)]
    assert predicts == [200] * 20 and keyed == [200] * 20
    assert drop.posts().count("/v1/models/m/predict") > 0  # replays were needed
    # Each fit request reached one replica, once.
    assert drop.posts().count(fit) + good.posts().count(fit) == 20
    assert fits.count(200) == good.posts().count(fit)
    unanswered = [o for o in fits if o != 200]
    assert len(unanswered) == drop.posts().count(fit) > 0
    assert set(unanswered) <= {502, "closed"}


@pytest.mark.process
def test_prometheus_server_binary_runs():
    if shutil.which("prometheus") is None:
        skip_or_fail("prometheus not installed (run tools/ensure-promtool: Debian's prometheus)")
    done = run("prometheus", "--version")
    assert done.returncode == 0 and "prometheus, version" in done.stdout + done.stderr


# ---------------------------------------------------------------------------
# the first admin key (compose first-key, Kubernetes Job welltempered-first-key)


@pytest.fixture
def key_database(tmp_path, monkeypatch) -> tuple[str, dict]:
    """A migrated SQLite database, and an environment whose ``welltempered`` on PATH is
    this checkout's CLI (as the image's is), pointed at it."""
    url = f"sqlite:///{tmp_path / 'keys.sqlite3'}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "welltempered"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m service.cli "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "WELLTEMPERED_DATABASE_URL": url,
        "FIRST_KEY_NAMESPACE": "team-first",
    }
    subprocess.run([str(shim), "migrate"], env=env, check=True, capture_output=True, timeout=120)
    return url, env


def key_rows(url: str) -> list[tuple[str, str, str]]:
    """(digest, namespace, scope) of every key row."""
    from sqlalchemy import select

    from service.storage.db import ApiKey, make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(select(ApiKey.key_sha256, ApiKey.namespace,
                                                          ApiKey.scope))]
    finally:
        engine.dispose()


def run_sh(script: str, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(["sh", "-ec", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.process
def test_compose_first_key_is_made_once(compose, key_database, tmp_path):
    """The one-shot service's script, run twice on a migrated database: one admin key,
    in the volume's file and never in the log; the second run makes none."""
    from service.security.auth import key_digest

    service = compose["services"]["first-key"]
    assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert service["image"] == compose["services"]["migrate"]["image"]
    assert service.get("restart") == "no"
    volume, path = next(iter(named_volumes(service).items()))
    assert volume in compose["volumes"]
    # the image makes the volume's mount point the service user's (a new volume takes it)
    assert re.search(rf"mkdir -p [^\n]*{path}\b", DOCKERFILE.read_text())
    assert re.search(rf"chown welltempered:welltempered [^\n]*{path}\b", DOCKERFILE.read_text())

    url, env = key_database
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    shell, flags, script = service["command"]
    assert (shell, flags) == ("sh", "-ec")
    script = script.replace(path, str(keys_dir)).replace(
        "${FIRST_KEY_NAMESPACE:-default}", "default"  # compose's interpolation, done
    )
    first = run_sh(script, env)
    key = (keys_dir / "admin-key").read_text().strip()
    assert key.startswith("wt_") and key not in first.stdout + first.stderr
    assert oct((keys_dir / "admin-key").stat().st_mode & 0o777) == "0o600"
    assert key_rows(url) == [(key_digest(key), "default", "admin")]
    second = run_sh(script, env)
    assert "no new key" in second.stdout
    assert (keys_dir / "admin-key").read_text().strip() == key
    assert len(key_rows(url)) == 1


# ---------------------------------------------------------------------------
# Kubernetes (deploy/kubernetes): rendered by kubectl kustomize, validated by
# kubernetes-validate against the API's own schemas. Not applied: no cluster here.

KUBERNETES = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version the objects are validated against.
KUBERNETES_VERSION = "1.32.0"
#: KEDA's custom resources: kubernetes-validate has the core API's schemas only, so
#: these are checked field by field below.
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}


@pytest.fixture(scope="module")
def kubernetes() -> dict[tuple[str, str], dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        skip_or_fail("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs)  # no kind and name twice
    return objects


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_objects_validate(kubernetes):
    kv = pytest.importorskip("kubernetes_validate")
    for (kind, name), doc in kubernetes.items():
        if kind in KEDA_KINDS:
            assert doc["apiVersion"] == "keda.sh/v1alpha1", name
            continue
        kv.validate(doc, KUBERNETES_VERSION, strict=True)
    # the validator can fail: a misspelt field of a probe is refused
    api = json.loads(json.dumps(kubernetes["Deployment", "welltempered-api"]))
    api["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(api, KUBERNETES_VERSION, strict=True)


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def environment(objects: dict, container: dict) -> dict[str, str]:
    """The variables a container gets: its ConfigMaps' and Secrets' data, then its env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env |= objects["ConfigMap", source["configMapRef"]["name"]]["data"]
        else:
            env |= objects["Secret", source["secretRef"]["name"]]["stringData"]
    return env | {e["name"]: e["value"] for e in container.get("env", [])}


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_settings_are_the_service_s(kubernetes):
    """Every WELLTEMPERED_ variable names a setting, with a value Settings accepts; every
    image the service's, every command one the CLI parses."""
    from service.cli import build_parser
    from service.settings import Settings

    for (kind, name), doc in kubernetes.items():
        if kind not in ("Deployment", "Job"):
            continue
        for container in containers(doc):
            if container["image"].split(":")[0] != "welltempered-api":
                continue
            env = environment(kubernetes, container)
            prefixed = {k[len("WELLTEMPERED_"):].lower(): v for k, v in env.items()
                        if k.startswith("WELLTEMPERED_")}
            assert set(prefixed) <= set(Settings.model_fields), (name, set(prefixed))
            Settings(**prefixed)  # every value valid
            args = container.get("args")
            if args is not None:
                assert args[0] == "welltempered", name
                build_parser().parse_args(args[1:])


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_api_probes_ports_and_memory(kubernetes):
    from service.api.app import create_app
    from service.server.budget import flatten
    from service.settings import Settings

    api = kubernetes["Deployment", "welltempered-api"]
    (container,) = containers(api)
    args = container["args"]
    port = int(args[args.index("--port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == port
    env = environment(kubernetes, container)
    assert ports["metrics"] == int(env["WELLTEMPERED_METRICS_ADDRESS"].rsplit(":", 1)[1])
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    paths = {route.path for route in flatten(create_app(Settings()).routes)}
    assert {"/readyz", "/healthz"} <= paths
    assert env["WELLTEMPERED_RUN_FITS"] == "false"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["arrays"] == env["WELLTEMPERED_DATA_DIR"]
    assert mounts["prometheus"] == env["PROMETHEUS_MULTIPROC_DIR"]
    grace = float(env["WELLTEMPERED_SHUTDOWN_GRACE_SECONDS"])
    assert api["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace + 5
    # the largest request, decoded, and its answer, per uvicorn worker, fit in the limit
    workers = int(args[args.index("--workers") + 1])
    limit = memory_bytes(container["resources"]["limits"]["memory"])
    assert limit > workers * 2 * int(env["WELLTEMPERED_MAX_BODY_BYTES"])

    service = kubernetes["Service", "welltempered-api"]
    assert service["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]  # never metrics
    for kind in ("HorizontalPodAutoscaler",):
        assert kubernetes[kind, "welltempered-api"]["spec"]["scaleTargetRef"]["name"] == (
            "welltempered-api"
        )
    pdb = kubernetes["PodDisruptionBudget", "welltempered-api"]["spec"]
    assert pdb["selector"] == api["spec"]["selector"]
    assert pdb["minAvailable"] < kubernetes["HorizontalPodAutoscaler", "welltempered-api"][
        "spec"]["minReplicas"]


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_worker_memory_is_the_fit_budget(kubernetes):
    """A worker's memory covers --concurrency fits of WELLTEMPERED_FIT_MEMORY_BYTES each
    (the cost guard's budget) plus the processes themselves; request equals limit."""
    worker = kubernetes["Deployment", "welltempered-worker"]
    (container,) = containers(worker)
    args = container["args"]
    assert args[:2] == ["welltempered", "worker"]
    concurrency = int(args[args.index("--concurrency") + 1])
    env = environment(kubernetes, container)
    budget = int(env["WELLTEMPERED_FIT_MEMORY_BYTES"])
    resources = container["resources"]
    limit = memory_bytes(resources["limits"]["memory"])
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert concurrency * budget < limit <= concurrency * budget + 2**30
    grace = float(env["WELLTEMPERED_FIT_GRACE_SECONDS"])
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace + 5
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["arrays"] == env["WELLTEMPERED_DATA_DIR"]
    api = kubernetes["Deployment", "welltempered-api"]
    claims = [{v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
               for v in d["spec"]["template"]["spec"]["volumes"]} for d in (api, worker)]
    assert claims[0]["arrays"] == claims[1]["arrays"] == "welltempered-arrays"
    pvc = kubernetes["PersistentVolumeClaim", "welltempered-arrays"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on any node share it


def procrastinate_jobs_schema() -> tuple[set[str], set[str]]:
    """The columns of procrastinate_jobs and the values of its status, from the schema
    the installed procrastinate creates."""
    from importlib.resources import files

    sql = files("procrastinate").joinpath("sql/schema.sql").read_text()
    table = re.search(r"CREATE TABLE procrastinate_jobs \((.*?)\n\);", sql, re.S).group(1)
    columns = {line.split()[0] for line in table.strip().splitlines()
               if not line.strip().startswith("CONSTRAINT")}
    enum = re.search(r"CREATE TYPE procrastinate_job_status AS ENUM \((.*?)\);", sql, re.S)
    return columns, set(re.findall(r"'(\w+)'", enum.group(1)))


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_keda_scales_workers_on_the_fit_queue(kubernetes):
    from service.jobs.engine import TASK

    scaled = kubernetes["ScaledObject", "welltempered-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "welltempered-worker"
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "postgresql"
    query = " ".join(trigger["metadata"]["query"].split())
    match = re.fullmatch(
        r"SELECT count\(\*\) FROM procrastinate_jobs WHERE task_name = '([^']+)' "
        r"AND status IN \(([^)]*)\)", query)
    assert match, query
    columns, statuses = procrastinate_jobs_schema()
    assert {"task_name", "status"} <= columns
    assert match.group(1) == TASK
    assert set(re.findall(r"'(\w+)'", match.group(2))) == {"todo", "doing"} <= statuses
    assert int(trigger["metadata"]["targetQueryValue"]) >= 1
    auth = kubernetes["TriggerAuthentication", trigger["authenticationRef"]["name"]]["spec"]
    (ref,) = auth["secretTargetRef"]
    assert ref["parameter"] == "connection"
    secret = kubernetes["Secret", ref["name"]]["stringData"]
    keda_url, service_url = secret[ref["key"]], secret["WELLTEMPERED_DATABASE_URL"]
    # the same database, in libpq's form
    strip = re.compile(r"^[^:]+://|\?.*$")
    assert strip.sub("", keda_url) == strip.sub("", service_url)
    assert keda_url.startswith("postgresql://")


@pytest.mark.process  # kubectl kustomize
def test_kubernetes_migrate_job(kubernetes):
    job = kubernetes["Job", "welltempered-migrate"]
    (container,) = containers(job)
    assert container["args"] == ["welltempered", "migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")


def fake_kubectl(bin_dir: Path, secrets: Path) -> None:
    """A kubectl that knows `get secret NAME --ignore-not-found -o name` and `create
    secret generic NAME --from-file=key=PATH`, keeping secrets as files in ``secrets``."""
    script = bin_dir / "kubectl"
    script.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, shutil, sys\n"
        f"store = pathlib.Path({str(secrets)!r})\n"
        "a = sys.argv[1:]\n"
        "if a[:2] == ['get', 'secret'] and a[3:] == ['--ignore-not-found', '-o', 'name']:\n"
        "    if (store / a[2]).exists(): print('secret/' + a[2])\n"
        "elif a[:3] == ['create', 'secret', 'generic'] and a[4].startswith('--from-file=key='):\n"
        "    if (store / a[3]).exists(): sys.exit('AlreadyExists')\n"
        "    shutil.copy(a[4].split('=', 2)[2], store / a[3])\n"
        "else:\n"
        "    sys.exit(f'unexpected kubectl {a}')\n"
    )
    script.chmod(0o755)


@pytest.mark.process
def test_kubernetes_first_key_job_is_idempotent(kubernetes, key_database, tmp_path):
    """The Job's three steps run in order, twice, with a kubectl that keeps secrets in a
    folder: one admin key in the database, the same one in the Secret."""
    from service.security.auth import key_digest

    job = kubernetes["Job", "welltempered-first-key"]
    spec = job["spec"]["template"]["spec"]
    steps = containers(job)
    assert [c["name"] for c in steps] == ["check", "create", "store"]
    (volume,) = spec["volumes"]
    assert volume["emptyDir"]["medium"] == "Memory"  # the key never touches a disk
    (path,) = {m["mountPath"] for c in steps for m in c["volumeMounts"]}
    account = spec["serviceAccountName"]
    binding = kubernetes["RoleBinding", account]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = kubernetes["Role", binding["roleRef"]["name"]]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "create"}

    url, env = key_database
    bin_dir = Path(env["PATH"].split(os.pathsep)[0])
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    fake_kubectl(bin_dir, secrets)
    create_env = environment(kubernetes, steps[1])
    assert "FIRST_KEY_NAMESPACE" in create_env

    def run_job() -> str:
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        logs = ""
        for step in steps:
            shell, flags, script = step["command"]
            assert (shell, flags) == ("sh", "-ec")
            logs += run_sh(script.replace(path, str(work)), env).stdout
        return logs

    logs = run_job()
    (stored,) = list(secrets.iterdir())
    key = stored.read_text().strip()
    assert key.startswith("wt_") and key not in logs
    assert key_rows(url) == [(key_digest(key), env["FIRST_KEY_NAMESPACE"], "admin")]
    assert "no new key" in run_job()
    assert len(key_rows(url)) == 1 and stored.read_text().strip() == key
