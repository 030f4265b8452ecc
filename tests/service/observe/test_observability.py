"""service.observe.metrics: the metric vocabulary, the metrics object of a process, the
exposition in single-process and multiprocess mode, and the scrape-time database gauges."""

from __future__ import annotations

import doctest
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from service.observe import metrics as obs

ROOT = Path(__file__).resolve().parents[3]

LIVE = {"namespace": "team-a", "model": "m", "version": 2}
HOLD = {**LIVE, "alias": "production"}
#: A snapshot with one sample for every database gauge.
FAKE_SNAPSHOT = {
    "fit_jobs": [
        ({"namespace": "team-a", "status": "queued"}, 1),
        ({"namespace": "team-a", "status": "succeeded"}, 4),
    ],
    "holdout_ece": [(HOLD, 0.0123)],
    "holdout_nll": [(HOLD, 0.91)],
    "holdout_accuracy": [(HOLD, 0.75)],
    "holdout_argmax_agreement": [(HOLD, 1.0)],
    "live_ece": [(LIVE, 0.02), ({**LIVE, "version": 1}, None)],
    "live_ece_bound": [(LIVE, 0.035)],
    "live_nll": [(LIVE, 0.95)],
    "live_accuracy": [(LIVE, 0.74)],
    "live_entropy": [(LIVE, 0.8)],
    # the same model name in another namespace is another series
    "live_labelled_rows": [(LIVE, 5000), ({**LIVE, "namespace": "team-b"}, 70)],
    "live_window_seconds": [({}, 3600)],
}


def families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
            return s.value
    raise KeyError((family, name, labels))


@pytest.fixture
def metrics() -> obs.ServiceMetrics:
    return obs.ServiceMetrics()


def touch_everything(
    metrics: obs.ServiceMetrics, model: str = "touch", namespace: str = "touch-ns"
) -> None:
    metrics.observe_request("/v1/models/{model}/predict", "POST", 200, 0.02)
    metrics.observe_predictions(
        namespace, model, 1, np.array([0.1, 1.0]), np.array([0.9, 0.6]), flipped=1
    )
    metrics.observe_feedback(namespace, model, 1, 2)
    metrics.observe_fit("temperature", 0.5)
    metrics.observe_rate_limited(namespace)
    metrics.observe_array_cache(hits=3, misses=2, evictions=1)
    with metrics.track_in_progress():
        pass


# ---------------------------------------------------------------------------
# the vocabulary


def test_names_units_and_labels_follow_the_rules():
    for name, (kind, labels) in obs.METRICS.items():
        assert re.fullmatch(r"welltempered_[a-z][a-z0-9_]*[a-z0-9]", name), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert set(labels) <= obs.LABELS, (name, labels)
        if kind == "histogram":
            assert name.endswith(("_seconds", "_nats", "_ratio")), name
    assert {"welltempered_http_requests_total", "welltempered_fit_jobs"} <= set(obs.METRICS)


def test_exposition_has_every_metric_with_help_and_type(metrics):
    touch_everything(metrics)
    body, content_type = metrics.render(lambda: FAKE_SNAPSHOT, lambda: 12345)
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name, (kind, _) in obs.METRICS.items():
        assert re.search(rf"^# HELP {name} \S", text, re.M), name
        assert re.search(rf"^# TYPE {name} {kind}$", text, re.M), name
    assert "_created" not in text  # same series as in multiprocess mode
    fams = families(body)
    assert sample(fams, "welltempered_holdout_ece_ratio", "welltempered_holdout_ece_ratio",
                  **HOLD) == 0.0123  # fmt: skip
    assert (
        sample(
            fams,
            "welltempered_fit_jobs",
            "welltempered_fit_jobs",
            namespace="team-a",
            status="succeeded",
        )
        == 4
    )
    assert sample(fams, "welltempered_database_up", "welltempered_database_up") == 1
    assert sample(fams, "welltempered_array_cache_bytes", "welltempered_array_cache_bytes") == 12345
    for event, value in (("hits", 3), ("misses", 2), ("evictions", 1)):
        name = f"welltempered_array_cache_{event}"
        assert sample(fams, name, f"{name}_total") == value
    # a None value (an empty window) is no sample at all
    assert [s.labels["version"] for s in fams["welltempered_live_ece_ratio"].samples] == ["2"]


def test_an_unreadable_cache_folder_leaves_the_cache_gauge_empty(metrics, caplog):
    def usage() -> int:
        raise PermissionError("cache/ab")

    body, _ = metrics.render(None, usage)
    family = families(body)["welltempered_array_cache_bytes"]
    assert family.samples == []
    assert b"welltempered_http_requests_total" in body
    assert "array cache" in caplog.text


def test_without_snapshot_there_are_no_database_gauges(metrics):
    body, _ = metrics.render()
    assert b"welltempered_fit_jobs" not in body
    assert b"welltempered_http_requests_total" in body
    # what prometheus_client's default registry would export, in single-process mode
    assert b"process_cpu_seconds_total" in body and b"python_info" in body


def test_each_metrics_object_is_independent_and_outside_the_global_registry():
    before = sorted(m.name for m in REGISTRY.collect())
    one, two = obs.ServiceMetrics(), obs.ServiceMetrics()  # two apps in one process
    touch_everything(one)
    fams_one, fams_two = families(one.render()[0]), families(two.render()[0])
    http = "welltempered_http_requests"
    assert sample(fams_one, http, http + "_total", route="/v1/models/{model}/predict") == 1
    assert fams_two[http].samples == []
    assert sorted(m.name for m in REGISTRY.collect()) == before


def test_observe_methods_count_what_they_say(metrics):
    ns, model = "helpers-ns", "helpers"
    entropy_a, confidence_a = np.array([0.0, 0.3, np.nan]), np.array([1.0, 0.8, 0.5])
    metrics.observe_predictions(ns, model, 3, entropy_a, confidence_a, 2)
    metrics.observe_predictions(ns, model, 3, np.zeros(0), np.zeros(0))
    metrics.observe_request("/healthz", "get", 503, 0.001)
    metrics.observe_request("/healthz", "BREW", 418, 0.001)
    fams = families(metrics.render()[0])
    rows = sample(fams, "welltempered_predictions", "welltempered_predictions_total",
                  namespace=ns, model=model, version=3)  # fmt: skip
    assert rows == entropy_a.size
    flips = "welltempered_prediction_argmax_flips"
    assert sample(fams, flips, flips + "_total", namespace=ns, model=model, version=3) == 2
    entropy = "welltempered_prediction_entropy_nats"
    finite = int(np.isfinite(entropy_a).sum())  # NaN not observed
    assert sample(fams, entropy, entropy + "_count", namespace=ns, model=model) == finite
    assert sample(fams, entropy, entropy + "_bucket", namespace=ns, model=model, le="0.01") == 1
    http = "welltempered_http_requests"
    assert sample(fams, http, http + "_total", route="/healthz", method="GET", status="5xx") == 1
    assert sample(fams, http, http + "_total", route="/healthz", method="OTHER", status="4xx") == 1
    with pytest.raises(ValueError, match="one entry per row"):
        metrics.observe_predictions(ns, model, 3, np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="flipped"):
        metrics.observe_predictions(ns, model, 3, np.zeros(2), np.zeros(2), flipped=3)


def test_the_same_model_name_in_two_namespaces_is_two_series(metrics):
    model, sizes = "shared-name", {"ns-one": 3, "ns-two": 20}  # 20 > _SMALL_BATCH: numpy path
    for ns, n in sizes.items():
        metrics.observe_predictions(ns, model, 1, np.full(n, 0.5), np.full(n, 0.7), flipped=n // 2)
        metrics.observe_feedback(ns, model, 1, 2 * n)
    fams = families(metrics.render()[0])
    rows, flips = "welltempered_predictions", "welltempered_prediction_argmax_flips"
    entropy, feedback = "welltempered_prediction_entropy_nats", "welltempered_feedback_rows"
    got = {
        s.labels["namespace"]: s.value
        for s in fams[rows].samples
        if s.name == rows + "_total" and s.labels["model"] == model
    }
    assert got == sizes
    for ns, n in sizes.items():
        assert sample(fams, flips, flips + "_total", namespace=ns, model=model) == n // 2
        assert sample(fams, entropy, entropy + "_count", namespace=ns, model=model) == n
        assert sample(fams, entropy, entropy + "_sum", namespace=ns, model=model) == 0.5 * n
        assert sample(fams, feedback, feedback + "_total", namespace=ns, model=model) == 2 * n


@pytest.mark.parametrize("size", [5000, 3, 1])  # the numpy path, and the short one
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batch_histogram_equals_one_observe_per_row(size, dtype):
    rng = np.random.default_rng(size)
    values = np.concatenate(
        [
            rng.exponential(1.5, size),
            rng.choice(obs.ENTROPY_BUCKETS_NATS, size),  # on the bounds
            rng.choice([0.0, 1e9, -1.0, np.nan, np.inf], size),
        ]
    )
    values = values.astype(dtype)[rng.permutation(3 * size)[: max(size, 3)]]
    one, batch = CollectorRegistry(), CollectorRegistry()
    kwargs = {"labelnames": ("model",), "buckets": obs.ENTROPY_BUCKETS_NATS}
    h1 = Histogram("h", "h", registry=one, **kwargs).labels("m")
    h2 = Histogram("h", "h", registry=batch, **kwargs).labels("m")
    for v in values.tolist():
        if math.isfinite(v):
            h1.observe(v)
    obs._observe_many(h2, values)
    s1 = {(s.name, s.labels["le"] if "le" in s.labels else ""): s.value
          for s in next(iter(one.collect())).samples}  # fmt: skip
    s2 = {(s.name, s.labels["le"] if "le" in s.labels else ""): s.value
          for s in next(iter(batch.collect())).samples}  # fmt: skip
    assert s1.keys() == s2.keys()
    for key in s1:
        assert s2[key] == pytest.approx(s1[key], rel=1e-12), key


def test_observe_request_equals_counter_inc_and_histogram_observe():
    """observe_request adds to the children's values directly: the same series and
    values as ``labels(...).inc()`` and ``labels(...).observe(max(0, seconds))``."""
    rng = np.random.default_rng(3)
    bounds = [b for b in obs.HTTP_BUCKETS_SECONDS if math.isfinite(b)]
    seconds = [*rng.exponential(0.05, 40), *bounds, 0.0, -1.0, 1e9]
    calls = [
        (route, method, status, s)
        for s in seconds
        for route, method, status in (("/healthz", "GET", 200), ("/v1/x", "brew", 503))
    ]
    fast, plain = obs.ServiceMetrics(), obs.ServiceMetrics()
    for route, method, status, s in calls:
        fast.observe_request(route, method, status, s)
        labels = (route, obs._method_label(method), obs.status_class(status))
        plain.http_requests.labels(*labels).inc()
        plain.http_duration.labels(*labels).observe(max(0.0, s))
    names = ("welltempered_http_requests", "welltempered_http_request_duration_seconds")
    got, want = families(fast.render()[0]), families(plain.render()[0])
    for name in names:
        fast_values, plain_values = (
            {(x.name, tuple(sorted(x.labels.items()))): x.value for x in fams[name].samples}
            for fams in (got, want)
        )
        assert fast_values and fast_values.keys() == plain_values.keys(), name
        for key, value in plain_values.items():
            assert fast_values[key] == pytest.approx(value, rel=1e-12), key


def _prediction_values(metrics: obs.ServiceMetrics, ns: str, model: str, version: str) -> dict:
    rows, flips, entropy, confidence, total, squared = metrics._prediction_children(
        ns, model, version
    )
    return {
        "rows": rows.get(), "flips": flips.get(), "total": total.get(),
        "squared": squared.get(), "entropy_sum": entropy._sum.get(),
        "entropy_buckets": [b.get() for b in entropy._buckets],
        "confidence_buckets": [b.get() for b in confidence._buckets],
    }


def test_answers_of_a_few_rows_are_counted_together_as_one_by_one():
    """An answer of at most _SMALL_BATCH rows waits (fold): the counters' locks one by
    one cost a predict of one row more than the count. Every scrape counts what waits,
    and the values are those of counting each answer at once."""
    rng = np.random.default_rng(8)
    answers = []
    for i in range(60):
        n = int(rng.integers(1, obs._SMALL_BATCH + 1)) if i % 7 else obs._SMALL_BATCH + 3
        answers.append((rng.exponential(1.0, n), rng.uniform(0.1, 1.0, n), int(i % 5 == 0)))
    kept, each = obs.ServiceMetrics(), obs.ServiceMetrics()
    kept._fold_by = float("inf")  # no fold by the clock in this test
    for entropy, confidence, flipped in answers:
        kept.observe_predictions("ns", "m", 3, entropy, confidence, flipped)
        each.observe_predictions("ns", "m", 3, entropy, confidence, flipped)
        each.fold()
    waiting = _prediction_values(kept, "ns", "m", "3")
    assert waiting["rows"] == sum(a[0].size for a in answers if a[0].size > obs._SMALL_BATCH)
    kept.render()  # a scrape counts every answer kept
    got, want = _prediction_values(kept, "ns", "m", "3"), _prediction_values(each, "ns", "m", "3")
    assert got["rows"] == sum(a[0].size for a in answers)
    assert got["flips"] == sum(a[2] for a in answers) == 12
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_kept_answers_are_counted_when_enough_wait_or_the_oldest_has_waited():
    metrics = obs.ServiceMetrics()
    metrics._fold_by = float("inf")
    one = (np.array([0.5]), np.array([0.9]))
    for _ in range(obs._FOLD_ANSWERS - 1):
        metrics.observe_predictions("ns", "m", 1, *one)
    assert _prediction_values(metrics, "ns", "m", "1")["rows"] == 0
    metrics.observe_predictions("ns", "m", 1, *one)  # enough: all counted
    assert _prediction_values(metrics, "ns", "m", "1")["rows"] == obs._FOLD_ANSWERS
    metrics.observe_predictions("ns", "m", 1, *one)
    assert _prediction_values(metrics, "ns", "m", "1")["rows"] == obs._FOLD_ANSWERS
    metrics._fold_by = 0.0  # the oldest has waited _FOLD_SECONDS: the next answer counts all
    metrics.observe_predictions("ns", "m", 1, *one)
    assert _prediction_values(metrics, "ns", "m", "1")["rows"] == obs._FOLD_ANSWERS + 2
    assert metrics._fold_by > 0.0


def test_requests_are_kept_and_counted_with_the_next_ones():
    metrics = obs.ServiceMetrics()
    metrics._fold_by = float("inf")
    count = metrics._request_children("/x", "GET", 200)[0]
    for _ in range(obs._FOLD_ANSWERS - 1):
        metrics.observe_request("/x", "GET", 200, 0.01)
    assert count.get() == 0
    metrics.observe_request("/x", "GET", 200, 0.01)  # enough: all counted
    assert count.get() == obs._FOLD_ANSWERS
    metrics.observe_request("/x", "GET", 200, 0.01)
    body = families(metrics.render()[0])  # a scrape counts the one kept
    name = "welltempered_http_requests"
    assert sample(body, name, name + "_total", route="/x") == obs._FOLD_ANSWERS + 1


def test_answers_kept_and_folded_from_several_threads_are_counted_once():
    import threading

    metrics = obs.ServiceMetrics()
    one = (np.array([0.25]), np.array([0.5]))

    def serve():
        for i in range(2000):
            metrics.observe_predictions("ns", "m", 1, *one, flipped=1)
            if i % 300 == 0:
                metrics.fold()

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics.fold()
    values = _prediction_values(metrics, "ns", "m", "1")
    assert values["rows"] == values["flips"] == 8000
    assert values["total"] == pytest.approx(4000.0)
    assert values["entropy_sum"] == pytest.approx(2000.0)


def test_status_class_method_and_route_template():
    assert [obs.status_class(c) for c in (101, 200, 204, 307, 404, 422, 500, 599, 600)] == [
        "1xx", "2xx", "2xx", "3xx", "4xx", "4xx", "5xx", "5xx", "other",
    ]  # fmt: skip

    class Route:
        path = "/v1/models/{model}/predict"

    assert obs.route_template({"route": Route()}) == "/v1/models/{model}/predict"
    assert obs.route_template({"path": "/wp-admin.php"}) == obs.UNMATCHED_ROUTE


# ---------------------------------------------------------------------------
# the database collector


def test_database_collector_yields_gauges_from_a_fake_snapshot():
    collector = obs.DatabaseQualityCollector(lambda: FAKE_SNAPSHOT)
    described = [m.name for m in collector.describe()]
    collected = {m.name: m for m in collector.collect()}
    assert described == list(collected)
    assert {spec.name for spec in obs.DB_GAUGES.values()} <= set(collected)
    assert all(m.type == "gauge" for m in collected.values())
    live = collected["welltempered_live_labelled_rows"].samples
    assert [(s.labels, s.value) for s in live] == [
        ({"namespace": "team-a", "model": "m", "version": "2"}, 5000.0),
        ({"namespace": "team-b", "model": "m", "version": "2"}, 70.0),
    ]


def test_registering_the_collector_does_not_query_the_database():
    calls = []
    registry = CollectorRegistry()
    registry.register(obs.DatabaseQualityCollector(lambda: calls.append(1) or {}))
    assert calls == []


def test_a_failing_database_leaves_the_process_metrics(metrics, caplog):
    def broken():
        raise ConnectionError("database is down")

    body, _ = metrics.render(broken)
    fams = families(body)
    assert sample(fams, "welltempered_database_up", "welltempered_database_up") == 0
    assert fams["welltempered_live_ece_ratio"].samples == []
    assert "welltempered_http_requests" in fams
    assert "database snapshot failed" in caplog.text


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        ({"live_eec": []}, "snapshot keys must be among"),
        ({"live_ece": [({"namespace": "a", "model": "m"}, 0.1)]}, "labels must be"),
        ({"live_ece": [({"model": "m", "version": 1}, 0.1)]}, "labels must be"),
        ({"live_ece": [({**LIVE, "pod": "x"}, 0.1)]}, "labels must be"),
        ({"live_ece": [(LIVE, "0.1")]}, "must be numbers"),
    ],
)
def test_a_snapshot_breaking_the_contract_raises(snapshot, message):
    with pytest.raises(ValueError, match=message):
        list(obs.DatabaseQualityCollector(lambda: snapshot).collect())


# ---------------------------------------------------------------------------
# multiprocess mode, in real processes


def run_python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


WORKER = """
    import os
    import numpy as np
    from service.observe import metrics as obs
    metrics = obs.ServiceMetrics()
    k = int(os.environ["ROWS"])
    for _ in range(k):
        metrics.observe_request("/v1/models/{model}/predict", "POST", 200, 0.02)
    metrics.observe_predictions("team-a", "m", 1, np.full(k, 0.15), np.full(k, 0.85), flipped=1)
    b = int(os.environ["ROWS_B"])  # the same model name in another namespace
    metrics.observe_predictions("team-b", "m", 1, np.full(b, 0.15), np.full(b, 0.85))
    metrics.observe_fit("temperature", 0.3)
    metrics.http_in_progress.inc()  # a request still running when the worker dies
    if os.environ.get("CLEAN_EXIT") == "1":
        metrics.mark_process_dead()
    print(os.getpid())
"""


#: Rows each worker serves for team-b's model "m" (team-a's "m" gets ROWS).
ROWS_B = 2


@pytest.mark.process
def test_two_worker_processes_add_up(tmp_path):
    mp_dir = tmp_path / "prom"
    (mp_dir / "stale").mkdir(parents=True)
    (mp_dir / "counter_999999.db").write_bytes(b"left over from a previous run")
    assert obs.prepare_multiprocess_dir(mp_dir) == str(mp_dir)
    assert [p.name for p in mp_dir.iterdir()] == ["stale"]  # only *.db files are wiped

    pids = []
    for rows, clean in ((3, "1"), (5, "0")):
        done = run_python(
            WORKER,
            {
                "PROMETHEUS_MULTIPROC_DIR": str(mp_dir),
                "ROWS": str(rows),
                "ROWS_B": str(ROWS_B),
                "CLEAN_EXIT": clean,
            },
        )
        assert done.returncode == 0, done.stderr
        pids.append(int(done.stdout.strip()))
    assert pids[0] != pids[1]

    # The exposition as a worker serves it: fresh registry + MultiProcessCollector.
    render = run_python(
        """
        import sys
        from service.observe import metrics as obs
        metrics = obs.ServiceMetrics()
        assert metrics.multiprocess_dir is not None
        print("reaped", metrics.mark_dead_workers(), file=sys.stderr)
        snap = {"fit_jobs": [({"namespace": "a", "status": "running"}, 1)]}
        body, _ = metrics.render(lambda: snap)
        sys.stdout.write(body.decode())
        """,
        {"PROMETHEUS_MULTIPROC_DIR": str(mp_dir)},
    )
    assert render.returncode == 0, render.stderr
    assert f"reaped [{pids[1]}]" in render.stderr  # the unclean one; the clean one did it itself
    fams = families(render.stdout.encode())
    http = "welltempered_http_requests"
    labels = {"route": "/v1/models/{model}/predict", "method": "POST", "status": "2xx"}
    assert sample(fams, http, http + "_total", **labels) == 8
    duration = "welltempered_http_request_duration_seconds"
    assert sample(fams, duration, duration + "_count", **labels) == 8
    assert sample(fams, duration, duration + "_bucket", le="0.025", **labels) == 8
    a, b = {"namespace": "team-a", "model": "m"}, {"namespace": "team-b", "model": "m"}
    predictions = "welltempered_predictions"
    assert sample(fams, predictions, predictions + "_total", version=1, **a) == 8
    assert sample(fams, predictions, predictions + "_total", version=1, **b) == 2 * ROWS_B
    flips = "welltempered_prediction_argmax_flips"
    assert sample(fams, flips, flips + "_total", version=1, **a) == 2
    assert sample(fams, flips, flips + "_total", version=1, **b) == 0
    entropy = "welltempered_prediction_entropy_nats"
    assert sample(fams, entropy, entropy + "_bucket", le="0.1", **a) == 0
    assert sample(fams, entropy, entropy + "_bucket", le="0.2", **a) == 8
    assert sample(fams, entropy, entropy + "_sum", **a) == pytest.approx(8 * 0.15)
    assert sample(fams, entropy, entropy + "_count", **b) == 2 * ROWS_B
    fit = "welltempered_fit_duration_seconds"
    assert sample(fams, fit, fit + "_count", method="temperature") == 2
    # Both workers have exited: their in-progress requests are gone.
    progress = "welltempered_http_requests_in_progress"
    assert sample(fams, progress, progress) == 0
    assert (
        sample(
            fams, "welltempered_fit_jobs", "welltempered_fit_jobs", namespace="a", status="running"
        )
        == 1
    )
    assert "welltempered_database_up 1.0" in render.stdout
    assert "process_cpu_seconds_total" not in render.stdout  # per-process collectors are off

    # The same files read from this (single-process) test process.
    fams_here = families(obs.render_multiprocess(mp_dir)[0])
    assert sample(fams_here, http, http + "_total", **labels) == 8


@pytest.mark.process
@pytest.mark.parametrize(
    ("code", "message"),
    [
        (
            """
            import os
            import prometheus_client
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ["THE_DIR"]
            """,
            "was set after",
        ),
        (
            """
            import os
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ["THE_DIR"]
            import prometheus_client
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            """,
            "it is unset now",
        ),
    ],
    ids=["set-after-import", "removed-since"],
)
def test_an_inconsistent_multiprocess_environment_is_refused_by_the_factory(
    tmp_path, code, message
):
    """Importing the module is harmless; building the metrics (create_app) refuses."""
    done = run_python(
        code
        + """
            from service.observe import metrics as obs
            print("imported")
            obs.ServiceMetrics()
            """,
        {"THE_DIR": str(tmp_path)},
    )
    assert done.returncode != 0 and done.stdout.strip() == "imported"
    assert "MultiprocessModeError" in done.stderr and message in done.stderr


def test_export_multiprocess_dir_wipes_and_sets_the_variable(tmp_path, monkeypatch):
    """`serve --workers N`: the parent sets PROMETHEUS_MULTIPROC_DIR and wipes old files."""
    # A copy of the environment: the variable set here must not reach the other tests.
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    monkeypatch.setattr(os, "environ", environ)
    default = tmp_path / "data" / "prometheus-multiproc"
    default.mkdir(parents=True)
    (default / "counter_1.db").write_bytes(b"old run")
    (default / "keep.txt").write_text("not a metric file")
    assert obs.export_multiprocess_dir(default) == str(default)
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(default)
    assert sorted(p.name for p in default.iterdir()) == ["keep.txt"]

    mine = tmp_path / "mine"  # an operator's choice wins over the default
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mine))
    assert obs.export_multiprocess_dir(default) == str(mine) and mine.is_dir()


def test_docstring_examples():
    result = doctest.testmod(obs)
    assert result.attempted > 0 and result.failed == 0
