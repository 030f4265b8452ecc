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
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.observe import metrics as obs
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
    live = {"namespace": "ns", "model": "m", "version": 1}
    hold = {**live, "alias": "production"}
    snapshot = {
        key: [({}, 1.0)]
        if not spec.labels
        else [({"status": "queued"}, 1.0)]
        if spec.labels == ("status",)
        else [(hold if "alias" in spec.labels else live, 0.5)]
        for key, spec in obs.DB_GAUGES.items()
    }
    body, _ = metrics.render(lambda: snapshot)
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
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in obs.LABELS | EXTRA_LABELS, (expr, label)


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


def test_compose_services_and_start_order(compose):
    services = compose["services"]
    assert {"api", "postgres", "migrate", "prometheus", "grafana"} <= set(services)

    pg = services["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])

    migrate = services["migrate"]
    assert migrate["command"][:2] == ["welltempered", "migrate"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart", "no") == "no"

    api = services["api"]
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert api["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert api["build"] == migrate["build"] == "." and api["image"] == migrate["image"]
    command = api["command"]
    assert command[:2] == ["welltempered", "serve"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert int(command[command.index("--workers") + 1]) > 1
    assert "/readyz" in " ".join(api["healthcheck"]["test"])


def test_compose_environment(compose):
    services = compose["services"]
    for name in ("api", "migrate"):
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
    assert api["ports"] == ["8000:8000"]  # the API only: never the listener's port


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
    resolve at run time) and keeps the slow-client timeouts of docs/operations.md."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        skip_or_fail("haproxy not installed (run tools/ensure-promtool: Debian's haproxy)")
    path = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
    done = run(haproxy, "-c", "-f", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    text = path.read_text()
    for line in ("timeout http-request 10s", "timeout client 20s", "option http-buffer-request"):
        assert line in text, line


@pytest.mark.process
def test_prometheus_server_binary_runs():
    if shutil.which("prometheus") is None:
        skip_or_fail("prometheus not installed (run tools/ensure-promtool: Debian's prometheus)")
    done = run("prometheus", "--version")
    assert done.returncode == 0 and "prometheus, version" in done.stdout + done.stderr
