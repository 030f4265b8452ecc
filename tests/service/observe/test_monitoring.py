"""Feedback, live calibration, drift verdicts, reliability diagrams and /metrics, in process.

Every test runs on SQLite and PostgreSQL (the ``client`` fixture). The 2-worker server
and the live Prometheus are in test_metrics_workers.py.
"""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import sessionmaker

from calibrators.evaluation import metrics
from service.api.app import create_app
from service.observe import monitoring
from service.security import keys
from service.serving import inference
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_NAMESPACE, METRICS_SCOPE
from tests.service.helpers import (
    assert_problem,
    bodies,
    create_model,
    families,
    fit,
    logits_data,
    make_settings,
    promote,
    upload,
)

SVG_NS = "{http://www.w3.org/2000/svg}"
NPY = "application/x-npy"


def served_probabilities(client, model: str, body: dict) -> np.ndarray:
    """What /predict answers for ``body``, as the exact float32 array (.npy)."""
    r = client.post(f"/v1/models/{model}/predict", json=body, headers={"accept": NPY})
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def feed(client, model: str, kind: str, scores, labels, batches: int = 1, **extra) -> list[dict]:
    out = []
    for part_scores, part_labels in zip(
        np.array_split(np.asarray(scores), batches),
        np.array_split(np.asarray(labels), batches),
        strict=True,
    ):
        body = {kind: part_scores.tolist(), "labels": part_labels.tolist(), **extra}
        r = client.post(f"/v1/models/{model}/feedback", json=body)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


# ---------------------------------------------------------------------------
# acceptance: live ECE equals calibrators.evaluation.metrics on the same calibrated rows


def test_live_ece_equals_report_on_cifar100(client, cifar100):
    """The 5,000 held-out CIFAR-100 rows fed back in 5 batches: the live figures from the
    time-bucketed sums equal calibrators.evaluation.metrics.report on the served rows."""
    fit_probs, fit_labels = cifar100.fit
    probs, labels = cifar100.test
    create_model(client, "wrn", k=100)
    dataset = upload(client, "wrn", fit_probs, fit_labels, kind="probabilities")
    promote(client, "wrn", dataset["id"])

    answers = feed(client, "wrn", "probabilities", probs, labels, batches=5)
    assert sum(a["rows"] for a in answers) == labels.size == 5000
    assert {a["version"] for a in answers} == {1}

    served = np.concatenate(
        [
            served_probabilities(client, "wrn", {"probabilities": part.tolist()})
            for part in np.array_split(probs, 5)
        ]
    )
    expected = metrics.report(served, labels)
    r = client.get("/v1/models/wrn/monitoring", params={"window": "1h"})
    assert r.status_code == 200, r.text
    body = r.json()
    live = body["live"]
    assert set(live) - {"not_from_aggregates"} == set(expected)
    assert live["n"] == expected["n"] == 5000
    assert abs(live["ece"] - expected["ece"]) <= 1e-9, (live["ece"], expected["ece"])
    for key in ("mce", "accuracy", "nll", "brier", "entropy"):
        assert live[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-12), key
    assert live["bins"]["count"] == expected["bins"]["count"]
    np.testing.assert_allclose(
        np.array(live["bins"]["mean_confidence"], dtype=float),
        np.array(expected["bins"]["mean_confidence"], dtype=float),
        rtol=1e-12,
    )
    for key in monitoring.NOT_FROM_AGGREGATES:
        assert live[key] is None and key in live["not_from_aggregates"]
    assert (
        body["holdout"]["ece"]
        == client.get("/v1/models/wrn/calibrators/1").json()["metrics"]["after"]["ece"]
    )
    assert body["drift"]["verdict"] == "ok", body["drift"]
    assert body["window"] == "1h" and body["window_seconds"] == 3600
    print(
        f"\nlive ECE {live['ece']:.12f} report ECE {expected['ece']:.12f} "
        f"diff {abs(live['ece'] - expected['ece']):.2e}; hold-out ECE {body['holdout']['ece']:.4f}"
        f"; drift {body['drift']['verdict']} p={body['drift']['p_value']:.3f} "
        f"bound={body['drift']['bound']:.4f}"
    )


# ---------------------------------------------------------------------------
# drift verdicts


def test_drift_verdicts(client, cifar10):
    """Unshifted feedback: "ok"; the logits times 3 (over-confident): "drift"; 50 rows:
    "insufficient_data". Three versions of one model, one stream each."""
    fit_probs, fit_labels = cifar10.fit
    probs, labels = cifar10.test
    create_model(client, "lenet", k=10)
    dataset = upload(client, "lenet", fit_probs, fit_labels, kind="probabilities")
    for seed in (0, 1, 2):
        promote(client, "lenet", dataset["id"], seed=seed)  # production ends on version 3

    logits = np.log(np.maximum(probs.astype(np.float64), 1e-30))
    feed(client, "lenet", "probabilities", probs, labels, batches=2, version=1)
    feed(client, "lenet", "logits", 3.0 * logits, labels, batches=2, version=2)
    feed(client, "lenet", "probabilities", probs[:50], labels[:50])  # production: version 3

    verdicts = {}
    for version in (1, 2, 3):
        r = client.get("/v1/models/lenet/monitoring", params={"version": version, "window": "30m"})
        assert r.status_code == 200, r.text
        verdicts[version] = r.json()["drift"]
    ok, drifted, few = verdicts[1], verdicts[2], verdicts[3]
    assert ok["verdict"] == "ok", ok
    assert drifted["verdict"] == "drift", drifted
    assert few["verdict"] == "insufficient_data" and few["bound"] is None and few["n_live"] == 50
    assert ok["method"] == drifted["method"] == "parametric-bootstrap-ece-excess"
    assert ok["live_ece"] <= ok["bound"] < drifted["live_ece"]
    assert drifted["p_value"] < drifted["alpha"] <= ok["p_value"]
    default = client.get("/v1/models/lenet/monitoring").json()
    assert default["version"] == 3 and default["live"]["n"] == 50
    for name, v in (("unshifted", ok), ("logits x3", drifted)):
        print(
            f"\n{name}: live ECE {v['live_ece']:.4f} hold-out {v['holdout_ece']:.4f} "
            f"bound {v['bound']:.4f} p {v['p_value']:.4f} -> {v['verdict']}"
        )


# ---------------------------------------------------------------------------
# feedback statistics and windows


def test_feedback_sums_add_up_and_windows(client):
    logits, labels = logits_data(400, k=4, seed=3)
    create_model(client, "m")
    promote(client, "m", upload(client, "m", logits, labels)["id"])
    feed(client, "m", "logits", logits[:150], labels[:150])
    feed(client, "m", "logits", logits[150:], labels[150:])
    live = client.get("/v1/models/m/monitoring").json()["live"]
    probs = served_probabilities(client, "m", {"logits": logits.tolist()})
    expected = metrics.report(probs, labels)
    assert live["n"] == 400 and abs(live["ece"] - expected["ece"]) <= 1e-9


def test_feedback_in_row_chunks_equals_the_whole_post(client, monkeypatch):
    """A post is calibrated (ONNX Runtime) and reduced to per-bin sums a row chunk at a
    time, so its memory is the rows and one chunk (tests/security/memory.py): the live
    figures are report's on the served rows whatever the chunks, and a refused row is
    named by its number in the post, not in its chunk."""
    create_model(client, "m", k=5)
    z, y = logits_data(300, 5, seed=4)
    promote(client, "m", upload(client, "m", z, y)["id"])
    x, labels = logits_data(100, 5, seed=5)
    served = served_probabilities(client, "m", {"logits": x.tolist()})
    run_rows, sum_rows = [], []
    real_run, real_chunks = inference.run, monitoring.row_chunks

    def run(session, logits):
        run_rows.append(len(logits))
        return real_run(session, logits)

    def chunks(n, k):
        for rows in real_chunks(n, k, 3 * k):  # sums of 3 rows at a time
            sum_rows.append(rows.stop - rows.start)
            yield rows

    monkeypatch.setattr(inference, "RUN_ELEMENTS", 7 * 5)  # ONNX Runtime on 7 rows at a time
    monkeypatch.setattr(inference, "run", run)
    monkeypatch.setattr(monitoring, "row_chunks", chunks)
    answer = feed(client, "m", "logits", x, labels)[0]
    assert answer["rows"] == 100 and answer["correct"] == int((served.argmax(1) == labels).sum())
    assert run_rows == [7] * 14 + [2] and sum(sum_rows) == 100 and max(sum_rows) == 3
    live = client.get("/v1/models/m/monitoring", params={"window": "1h"}).json()["live"]
    expected = metrics.report(served, labels)
    assert live["bins"]["count"] == expected["bins"]["count"]
    for key in ("ece", "mce", "accuracy", "nll", "brier", "entropy"):
        assert live[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-12), key
    huge = x.astype(np.float64)
    huge[50, 2] = 1e300  # beyond float32: refused in the chunk of rows 49 to 55
    r = client.post("/v1/models/m/feedback", json={"logits": huge.tolist(),
                                                    "labels": labels.tolist()})
    assert_problem(r, 422, "float32", "at row 50")


def test_window_parsing():
    assert [monitoring.parse_window(w) for w in ("30s", "30m", "1h", "1d", "7d", "2w")] == [
        30,
        1800,
        3600,
        86400,
        604800,
        1209600,
    ]
    for bad in ("", "h", "0h", "1", "1x", "1.5h", "-1h", "1 h", "367d", "01h", "1H"):
        with pytest.raises(Exception, match="window"):
            monitoring.parse_window(bad)
    assert monitoring.format_window(86400) == "1d"


def test_bucket_and_window_start():
    assert monitoring.bucket_start(125.9, 60) == 120
    assert monitoring.window_start(3600, 60, now=7265.0) == 3660


def test_monitoring_errors(client):
    assert_problem(client.get("/v1/models/nope/monitoring"), 404, "nope")
    create_model(client, "m")
    assert_problem(client.get("/v1/models/m/monitoring"), 404, "production")
    for bad in ("1x", "0h", "400d", "1.5h"):
        assert_problem(client.get("/v1/models/m/monitoring", params={"window": bad}), 422, "window")
    assert_problem(client.get("/v1/models/m/monitoring", params={"version": 0}), 422)
    assert_problem(client.get("/v1/models/m/monitoring", params={"version": 7}), 404, "version 7")
    assert_problem(client.get("/v1/models/m/monitoring/reliability.svg"), 404, "production")
    assert_problem(client.get("/v1/models/m/calibrators/3/reliability.svg"), 404, "version 3")


def test_feedback_validation(client):
    logits, labels = logits_data(200, k=4)
    create_model(client, "m")
    url = "/v1/models/m/feedback"
    body = {"logits": logits[:5].tolist(), "labels": labels[:5].tolist()}
    assert_problem(client.post(url, json=body), 404, "production")  # nothing served yet
    promote(client, "m", upload(client, "m", logits, labels)["id"])
    assert client.post(url, json=body).status_code == 200
    assert_problem(client.post(url, json={"logits": body["logits"]}), 422, "labels")
    assert_problem(client.post(url, json={**body, "labels": [0, 1]}), 422)
    assert_problem(client.post(url, json={**body, "labels": [0, 1, 2, 3, 4]}), 422)
    assert_problem(client.post(url, json={**body, "logits": [[1.0, 2.0]] * 5}), 422, "4 columns")
    assert_problem(client.post(url, json={**body, "version": "1"}), 422, "version")
    assert_problem(client.post(url, json={**body, "version": True}), 422, "version")
    assert_problem(client.post(url, json={**body, "version": 9}), 404, "version 9")
    assert_problem(client.post(url, json={**body, "extra": 1}), 422, "extra")
    assert_problem(client.post(url, json={**body, "probabilities": body["logits"]}), 422)
    assert_problem(
        client.post(url, content=b"{", headers={"content-type": "application/json"}), 400
    )
    assert_problem(client.post(url, content=b"x", headers={"content-type": "text/plain"}), 415)
    assert_problem(client.post("/v1/models/nope/feedback", json=body), 404, "nope")
    assert client.get("/v1/models/m/monitoring").json()["live"]["n"] == 5  # only the good post


def test_reliability_svgs(client):
    logits, labels = logits_data(600, k=4, seed=1)
    create_model(client, "m")
    promote(client, "m", upload(client, "m", logits, labels)["id"])
    r = client.get("/v1/models/m/calibrators/1/reliability.svg")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(r.text)
    labels_drawn = [
        g.get("data-label") for g in root.iter(f"{SVG_NS}g") if g.get("class") == "series"
    ]
    assert labels_drawn == ["before (uncalibrated)", "after (temperature)"]

    feed(client, "m", "logits", logits, labels)
    r = client.get("/v1/models/m/monitoring/reliability.svg", params={"window": "1h"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(r.text)
    series = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "series"]
    assert [g.get("data-label") for g in series] == [
        "hold-out (at fit time)",
        "live, last 1h (600 rows)",
    ]
    counts = [
        int(rect.get("data-count"))
        for g in root.iter(f"{SVG_NS}g")
        if g.get("class") == "counts" and g.get("data-series") == "1"
        for rect in g.iter(f"{SVG_NS}rect")
    ]
    assert sum(counts) == 600
    assert_problem(client.get("/v1/models/m/monitoring/reliability.svg?window=zz"), 422, "window")
    # the same bytes as a download for a client that accepts octet-stream only
    for url in ("/v1/models/m/calibrators/1/reliability.svg",
                "/v1/models/m/monitoring/reliability.svg?window=1h"):
        svg = client.get(url, headers={"accept": "image/svg+xml"})
        raw = client.get(url, headers={"accept": "application/octet-stream"})
        assert svg.headers["content-type"].startswith("image/svg+xml")
        assert raw.headers["content-type"] == "application/octet-stream"
        assert raw.headers["content-disposition"].endswith('.svg"')
        assert raw.content == svg.content
        both = client.get(url, headers={"accept": "application/octet-stream, image/*"})
        assert both.headers["content-type"].startswith("image/svg+xml")


# ---------------------------------------------------------------------------
# /metrics in one process


def test_metrics_observe_predict_feedback_and_fits(client):
    logits, labels = logits_data(300, k=4, seed=5)
    before = families(client.get("/metrics").text)
    create_model(client, "obs", argmax_policy="off")
    dataset = upload(client, "obs", logits, labels)
    version = fit(client, "obs", dataset["id"], method="matrix")
    client.put("/v1/models/obs/aliases/production", json={"version": version["version"]})
    r = client.post("/v1/models/obs/predict", json={"logits": logits.tolist()})
    served_labels = np.array(r.json()["labels"])
    flips = int((served_labels != logits.argmax(axis=1)).sum())
    feed(client, "obs", "logits", logits[:250], labels[:250])
    client.get("/v1/models/obs/monitoring", params={"window": "bad"})
    after = families(client.get("/metrics").text)

    def delta(name: str, **labels) -> float:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        return after.get(name, {}).get(key, 0.0) - before.get(name, {}).get(key, 0.0)

    v = str(version["version"])
    model = {"namespace": DEFAULT_NAMESPACE, "model": "obs"}  # auth off: the default namespace
    assert delta("welltempered_predictions_total", **model, version=v) == 300
    assert delta("welltempered_prediction_argmax_flips_total", **model, version=v) == flips
    assert delta("welltempered_prediction_entropy_nats_count", **model) == 300
    assert delta("welltempered_prediction_confidence_ratio_count", **model) == 300
    assert delta("welltempered_feedback_rows_total", **model, version=v) == 250
    assert delta("welltempered_fit_duration_seconds_count", method="matrix") == 1
    route = "/v1/models/{model}/predict"
    assert delta("welltempered_http_requests_total", route=route, method="POST", status="2xx") == 1
    route = "/v1/models/{model}/monitoring"
    assert delta("welltempered_http_requests_total", route=route, method="GET", status="4xx") == 1
    gauges = after
    live = {**model, "version": v}
    assert gauges["welltempered_live_labelled_rows"][tuple(sorted(live.items()))] == 250
    hold = tuple(sorted({**live, "alias": "production"}.items()))
    assert gauges["welltempered_holdout_ece_ratio"][hold] == version["metrics"]["after"]["ece"]
    assert (
        gauges["welltempered_holdout_argmax_agreement_ratio"][hold]
        == (version["argmax"]["agreement"])
    )
    assert gauges["welltempered_fit_jobs"][(("namespace", "default"), ("status", "succeeded"))] >= 1
    assert gauges["welltempered_database_up"][()] == 1
    # an unmatched path is one series, not one per path
    client.get("/no/such/path/123")
    text = client.get("/metrics").text
    assert 'route="unmatched"' in text and "/no/such/path" not in text


@pytest.fixture
def tenants(database_url, tmp_path):
    """An app with auth on and a client per namespace (team-a, team-b), each with a write
    key, and the scraper's client ("metrics", with a metrics key)."""
    settings = make_settings(database_url, tmp_path, auth="on", key_cache_seconds=0.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as app_client:
        engine = make_engine(database_url)
        with sessionmaker(engine)() as session:
            made = {ns: keys.create_key(session, ns, "write")[1] for ns in ("team-a", "team-b")}
            made[METRICS_SCOPE] = keys.create_key(session, None, METRICS_SCOPE)[1]
        engine.dispose()
        clients = {
            ns: TestClient(
                app_client.app,
                raise_server_exceptions=False,
                headers={"Authorization": f"Bearer {key}"},
            )
            for ns, key in made.items()
        }
        yield clients
        for client in clients.values():
            client.close()


def test_metrics_keep_two_namespaces_with_the_same_model_name_apart(tenants):
    """Two tenants each have a model "m" (version 1): the counters of the process and the
    database gauges are one series per namespace, with that namespace's figures."""
    anyone = tenants[METRICS_SCOPE]  # the scraper's key reads every namespace's series
    # rows predicted, rows fed back: different per namespace, so mixing would show
    sent = {"team-a": (40, 30), "team-b": (90, 120)}
    before = families(anyone.get("/metrics").text)
    versions = {}
    for seed, (ns, (n_predict, n_feedback)) in enumerate(sent.items()):
        client = tenants[ns]
        logits, labels = logits_data(300, k=4, seed=20 + seed)
        create_model(client, "m")
        versions[ns] = promote(client, "m", upload(client, "m", logits, labels)["id"])
        r = client.post("/v1/models/m/predict", json={"logits": logits[:n_predict].tolist()})
        assert r.status_code == 200, r.text
        feed(client, "m", "logits", logits[:n_feedback], labels[:n_feedback])
    after = families(anyone.get("/metrics").text)

    def changed(name: str) -> dict[tuple, float]:
        """The series of model "m" that this test moved, and by how much."""
        out = {}
        for key, value in after.get(name, {}).items():
            moved = value - before.get(name, {}).get(key, 0.0)
            if dict(key).get("model") == "m" and moved:
                out[key] = moved
        return out

    def key(ns: str, **more) -> tuple:
        return tuple(sorted({"namespace": ns, "model": "m", **more}.items()))

    v = {ns: str(versions[ns]["version"]) for ns in sent}
    assert changed("welltempered_predictions_total") == {
        key(ns, version=v[ns]): n_predict for ns, (n_predict, _) in sent.items()
    }
    for name in (
        "welltempered_prediction_entropy_nats_count",
        "welltempered_prediction_confidence_ratio_count",
    ):
        assert changed(name) == {key(ns): n_predict for ns, (n_predict, _) in sent.items()}
    assert changed("welltempered_feedback_rows_total") == {
        key(ns, version=v[ns]): n_feedback for ns, (_, n_feedback) in sent.items()
    }
    # the database gauges: this test's database holds exactly these two models
    assert after["welltempered_live_labelled_rows"] == {
        key(ns, version=v[ns]): n_feedback for ns, (_, n_feedback) in sent.items()
    }
    assert after["welltempered_holdout_ece_ratio"] == {
        key(ns, version=v[ns], alias="production"): versions[ns]["metrics"]["after"]["ece"]
        for ns in sent
    }
    assert set(after["welltempered_live_ece_ratio"]) == {key(ns, version=v[ns]) for ns in sent}


# ---------------------------------------------------------------------------
# garbage never gives a 500

feedback_bodies = bodies | st.fixed_dictionaries(
    {
        "probabilities": st.lists(
            st.lists(st.floats(width=32) | st.integers(-1, 2), min_size=4, max_size=4),
            max_size=3,
        ),
        "labels": st.lists(st.integers(-1, 4), max_size=3),
        "version": st.integers(-2, 3) | st.booleans() | st.none() | st.text(max_size=3),
    }
).map(lambda v: ("application/json", json.dumps(v).encode()))
windows = st.text(max_size=6) | st.from_regex(r"\A[0-9]{1,8}[smhdwx]\Z")


@pytest.fixture
def fed(client):
    logits, labels = logits_data(200, k=4)
    create_model(client, "m")
    promote(client, "m", upload(client, "m", logits, labels)["id"])
    return client


@settings(
    max_examples=120,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=feedback_bodies, window=windows, version=st.integers(-1, 3) | st.just("x"))
def test_garbage_never_500(fed, body, window, version):
    content_type, content = body
    headers = {"content-type": content_type} if content_type else {}
    answers = [
        fed.post("/v1/models/m/feedback", content=content, headers=headers),
        fed.get("/v1/models/m/monitoring", params={"window": window, "version": version}),
        fed.get("/v1/models/m/monitoring/reliability.svg", params={"window": window}),
    ]
    for r in answers:
        assert r.status_code < 500, (r.status_code, r.text)
        if r.status_code >= 400:
            assert r.headers["content-type"] == "application/problem+json", r.headers
            assert r.json()["detail"]
