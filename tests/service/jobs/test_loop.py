"""The recalibration loop in process, on SQLite and PostgreSQL (service/jobs/loop.py,
service/storage/loops.py, service/api/routers/loop.py): kept feedback rows, a run on
request and on drift, its comparison, promotion, and the events of every step."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select

import calibrators
from service.jobs import loop
from service.storage import loops, usage
from service.storage.db import CalibratorVersion, FeedbackBatch, LoopEvent, LoopRun, utcnow
from service.vocabulary import DEFAULT_ALIAS, LOOP_DEFAULTS, LOOP_STATES
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    families,
    hold_queue,
    promote,
    tempered_rows,
    upload,
)

K = 4


def production(client, name: str = "m", **loop_settings) -> dict:
    """A model whose production version is temperature scaling fitted on calibrated
    rows, with its loop set to ``loop_settings``."""
    create_model(client, name, k=K)
    logits, labels = tempered_rows(1500, K, 1.0, seed=1)
    version = promote(client, name, upload(client, name, logits, labels)["id"])
    r = client.put(f"/v1/models/{name}/loop", json=loop_settings)
    assert r.status_code == 200, r.text
    return version


def feed(client, name: str, temperature: float, n: int = 1200, seed: int = 2) -> dict:
    logits, labels = tempered_rows(n, K, temperature, seed)
    r = client.post(
        f"/v1/models/{name}/feedback", json={"logits": logits.tolist(), "labels": labels.tolist()}
    )
    assert r.status_code == 200, r.text
    return r.json()


def finished_run(client, name: str, run: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/models/{name}/loop/runs")
        assert r.status_code == 200, r.text
        body = next(x for x in r.json()["runs"] if x["run"] == run)
        if body["state"] != "fitting":
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def steps(client, name: str, run: int) -> list[str]:
    r = client.get(f"/v1/models/{name}/loop/events", params={"run": run})
    assert r.status_code == 200, r.text
    return [e["step"] for e in r.json()["events"]]


def alias_version(client, name: str) -> int:
    return client.get(f"/v1/models/{name}/aliases/{DEFAULT_ALIAS}").json()["version"]


def test_drifted_feedback_is_refitted_compared_and_promoted(client):
    before = production(client, auto_promote=True)
    assert feed(client, "m", temperature=3.0)["kept"] == 1200
    r = client.post("/v1/models/m/loop/runs")
    assert r.status_code == 202, r.text
    started = r.json()
    run = finished_run(client, "m", started["run"])
    assert run["state"] == "promoted", run
    assert run["production_version"] == before["version"]
    comparison = run["comparison"]
    assert comparison["rows"] == round(1200 * LOOP_DEFAULTS["holdout"])
    assert comparison["nll_gain"] > LOOP_DEFAULTS["margin"]
    assert comparison["nll_gain_low"] > 0
    assert alias_version(client, "m") == started["candidate_version"]
    assert steps(client, "m", started["run"]) == [
        "started", "candidate-fitted", "evaluated", "promoted"
    ]
    # The candidate is an ordinary version of production's method, on a dataset of the
    # kept rows.
    version = client.get(started["status_url"]).json()
    assert version["status"] == "succeeded" and version["method"] == "temperature"
    assert client.get(f"/v1/models/m/datasets/{version['dataset_id']}").json()["n"] == 1200
    runs = families(client.get("/metrics").text)["welltempered_loop_runs"]
    # Every state of the model, 0 where it has no run (an alert sees a first failure rise).
    assert runs == {
        (("model", "m"), ("namespace", "default"), ("status", state)): int(state == "promoted")
        for state in LOOP_STATES
    }
    # The runs and their events go with the model.
    assert client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}").status_code == 200
    r = client.delete("/v1/models/m")
    assert r.status_code == 200, r.text
    with client.app.state.welltempered.sessions() as s:
        assert s.scalars(select(LoopRun)).all() == s.scalars(select(LoopEvent)).all() == []


def test_feedback_like_production_is_not_promoted(client):
    before = production(client, auto_promote=True)
    feed(client, "m", temperature=1.0)
    started = client.post("/v1/models/m/loop/runs").json()
    run = finished_run(client, "m", started["run"])
    assert run["state"] == "not-promoted", run
    assert run["comparison"]["better"] is False
    assert alias_version(client, "m") == before["version"]
    events = client.get("/v1/models/m/loop/events").json()["events"]
    assert [e["step"] for e in events][-1] == "not-promoted"
    assert events[-1]["details"]["reasons"], events[-1]


def test_a_better_candidate_waits_for_the_user_unless_auto_promote(client):
    before = production(client)  # auto_promote defaults to off
    feed(client, "m", temperature=3.0)
    started = client.post("/v1/models/m/loop/runs").json()
    run = finished_run(client, "m", started["run"])
    assert run["state"] == "waiting", run
    assert run["comparison"]["better"] is True
    assert alias_version(client, "m") == before["version"]
    assert steps(client, "m", started["run"])[-1] == "not-promoted"


def test_the_margin_is_the_models(client):
    production(client, auto_promote=True, margin=0.9)  # beyond any gain of this drift
    feed(client, "m", temperature=3.0)
    run = finished_run(client, "m", client.post("/v1/models/m/loop/runs").json()["run"])
    assert run["state"] == "not-promoted"
    assert run["comparison"]["nll_gain"] < 0.9


def test_a_drift_verdict_starts_a_run_when_the_model_asks(client):
    production(client, auto_promote=True, on_drift=True)
    feed(client, "m", temperature=3.0)
    runs = client.get("/v1/models/m/loop/runs").json()["runs"]
    assert [r["trigger"] for r in runs] == ["drift"]
    assert finished_run(client, "m", runs[0]["run"])["state"] == "promoted"


def test_no_drift_run_without_on_drift(client):
    production(client, auto_promote=True)
    feed(client, "m", temperature=3.0)
    assert client.get("/v1/models/m/loop/runs").json()["runs"] == []


def test_a_cancelled_candidate_fails_its_run(client):
    production(client)
    feed(client, "m", temperature=3.0)
    hold_queue(client)
    started = client.post("/v1/models/m/loop/runs").json()
    assert_problem(client.post("/v1/models/m/loop/runs"), 409, "still fitting")
    r = client.post(f"/v1/models/m/calibrators/{started['candidate_version']}/cancel")
    assert r.status_code == 200, r.text
    run = client.get("/v1/models/m/loop/runs").json()["runs"][0]
    assert run["state"] == "failed"
    assert steps(client, "m", started["run"]) == ["started", "failed"]


def test_refusals(client):
    create_model(client, "m", k=K)
    assert client.get("/v1/models/m/loop").json()["keep_feedback"] is False
    assert_problem(client.post("/v1/models/m/loop/runs"), 409, "keeps no feedback")
    for bad in ({"holdout": 0.0}, {"margin": -1}, {"retention_days": 0}, {"extra": 1},
                {"keep_feedback": "yes"}, {"retention_rows": 10**12}):
        assert_problem(client.put("/v1/models/m/loop", json=bad), 422)
    production(client, "n")
    feed(client, "n", 3.0, n=50)
    assert_problem(client.post("/v1/models/n/loop/runs"), 409, "at least")
    assert_problem(client.get("/v1/models/n/loop/events", params={"cursor": "x"}), 422)


def test_kept_rows_are_bounded_counted_and_go_with_the_model(client):
    production(client, retention_rows=300)
    app = client.app.state.welltempered
    with app.sessions() as s:
        empty = usage.usage(s, "default").stored_bytes
    assert feed(client, "m", 3.0, n=200, seed=3)["kept"] == 200
    assert feed(client, "m", 3.0, n=500, seed=4)["kept"] == 300  # its newest 300
    feed(client, "m", 3.0, n=200, seed=5)  # the previous post goes: 200 kept
    loop_state = client.get("/v1/models/m/loop").json()
    assert loop_state["kept_rows"] == 200
    with app.sessions() as s:
        assert usage.usage(s, "default").stored_bytes == empty + loop_state["kept_bytes"]
    # Lowering the bound applies at once; keep_feedback off deletes every row.
    client.put("/v1/models/m/loop", json={"retention_rows": 100})
    assert client.get("/v1/models/m/loop").json()["kept_rows"] == 0
    client.put("/v1/models/m/loop", json={"retention_rows": 1000})
    feed(client, "m", 3.0, n=100, seed=6)
    client.put("/v1/models/m/loop", json={"keep_feedback": False})
    assert client.get("/v1/models/m/loop").json()["kept_rows"] == 0
    client.put("/v1/models/m/loop", json={})
    feed(client, "m", 3.0, n=100, seed=7)
    assert client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}").status_code == 200
    assert client.delete("/v1/models/m").status_code == 200
    with app.sessions() as s:
        assert s.scalars(select(FeedbackBatch)).all() == []


def test_a_full_namespace_refuses_kept_rows_and_records_nothing(client):
    production(client)
    app = client.app.state.welltempered
    with app.sessions() as s:
        used = usage.usage(s, "default").stored_bytes
    app.settings.quota_stored_bytes = used + 1000
    logits, labels = tempered_rows(200, K, 3.0, seed=8)
    r = client.post(
        "/v1/models/m/feedback", json={"logits": logits.tolist(), "labels": labels.tolist()}
    )
    assert_problem(r, 409, "stored_bytes")
    monitoring = client.get("/v1/models/m/monitoring").json()
    assert monitoring["live"]["n"] == 0


def test_posts_past_retention_days_are_swept_and_never_fitted(client):
    production(client, retention_days=2)
    feed(client, "m", 3.0, n=150, seed=3)
    feed(client, "m", 3.0, n=60, seed=4)
    app = client.app.state.welltempered
    with app.sessions() as s, s.begin():
        first = s.scalars(select(FeedbackBatch).order_by(FeedbackBatch.id)).first()
        first.created_at = utcnow() - timedelta(days=3)
    # Before the sweep: the expired post is not fitted on (60 rows: too few for a run).
    assert client.get("/v1/models/m/loop").json()["kept_rows"] == 210
    assert_problem(client.post("/v1/models/m/loop/runs"), 409, "keeps 60")
    assert loops.expire(app.sessions) == 1
    assert client.get("/v1/models/m/loop").json()["kept_rows"] == 60


@pytest.mark.parametrize("status", ["succeeded", "rejected"])
def test_compare_pairs_the_rows_the_fit_held_back(status):
    logits, labels = tempered_rows(2000, K, 3.0, seed=9)
    prod = calibrators.create("temperature").fit(*tempered_rows(2000, K, 1.0, seed=10))
    cand = calibrators.create("temperature").fit(logits[:1000], labels[:1000])
    out = loop.compare(
        prod.to_params(), cand.to_params(), logits, labels, kind="logits", holdout=0.5, seed=0,
        margin=0.01, candidate_status=status,
    )
    assert out["rows"] == 1000
    assert out["nll_gain"] == pytest.approx(out["nll_production"] - out["nll_candidate"])
    assert out["nll_gain_low"] < out["nll_gain"] < out["nll_gain_high"]
    assert out["better"] is (status == "succeeded"), out["reasons"]
    # The same calibrator on both sides: no gain, not better.
    same = loop.compare(
        prod.to_params(), prod.to_params(), logits, labels, kind="logits", holdout=0.5,
        seed=0, margin=0.0, candidate_status="succeeded",
    )
    assert same["nll_gain"] == 0 and not same["better"]


def test_production_method_is_the_served_one():
    auto = CalibratorVersion(
        source="fit", method="auto", chosen_method="vector",
        options={"vector": {"l2": 0.1}, "matrix": {"l2": 1.0}},
    )
    assert loop.production_method(auto) == ("vector", {"l2": 0.1})
    posted = CalibratorVersion(
        source="params", method="temperature", params={"method": "temperature", "options": {}}
    )
    assert loop.production_method(posted) == ("temperature", {})


def test_the_argmax_policy_applies_to_candidates(client):
    """Production is vector scaling, served under policy off; once the model requires
    the argmax kept, a candidate that moves predicted classes is rejected, not promoted."""
    create_model(client, "m", k=K, argmax_policy="off")
    logits, labels = tempered_rows(1500, K, 1.0, seed=1)
    dataset = upload(client, "m", logits, labels)["id"]
    promote(client, "m", dataset, method="vector")
    client.put("/v1/models/m/loop", json={"auto_promote": True})
    assert client.patch("/v1/models/m", json={"argmax_policy": "require"}).status_code == 200
    # Feedback whose labels favour class 0 by 3 nats: the refitted bias moves argmaxes.
    rng = np.random.default_rng(12)
    z = rng.normal(scale=3.0, size=(1200, K))
    p = softmax(z + np.array([3.0, 0.0, 0.0, 0.0]))
    y = (rng.random((1200, 1)) > np.cumsum(p, axis=1)).sum(axis=1).clip(max=K - 1)
    r = client.post("/v1/models/m/feedback", json={"logits": z.tolist(), "labels": y.tolist()})
    assert r.status_code == 200, r.text
    started = client.post("/v1/models/m/loop/runs").json()
    run = finished_run(client, "m", started["run"])
    assert run["state"] == "not-promoted", run
    assert client.get(started["status_url"]).json()["status"] == "rejected"
    assert "rejected" in " ".join(run["comparison"]["reasons"])


def test_only_production_drift_starts_a_run(client):
    first = production(client, auto_promote=True, on_drift=True)
    z, y = tempered_rows(1500, K, 1.0, seed=13)
    second = promote(client, "m", upload(client, "m", z, y)["id"], seed=1)  # now production
    logits, labels = tempered_rows(1200, K, 3.0, seed=2)
    r = client.post(
        f"/v1/models/m/feedback?version={first['version']}",
        json={"logits": logits.tolist(), "labels": labels.tolist()},
    )
    assert r.status_code == 200 and r.json()["kept"] == 1200, r.text
    assert client.get("/v1/models/m/loop/runs").json()["runs"] == []
    feed(client, "m", temperature=3.0, seed=14)  # served by production: drifted too
    runs = client.get("/v1/models/m/loop/runs").json()["runs"]
    assert [(r["trigger"], r["production_version"]) for r in runs] == [
        ("drift", second["version"])
    ]


def test_a_run_started_meanwhile_is_seen_under_the_models_lock(client, monkeypatch):
    """Two runs started at once both pass the early check; the second sees the first in
    the transaction that would queue its candidate (the early check skipped here)."""
    production(client)
    feed(client, "m", temperature=3.0)
    hold_queue(client)
    assert client.post("/v1/models/m/loop/runs").status_code == 202
    versions = len(client.get("/v1/models/m/calibrators").json()["calibrators"])
    real = loops.unfinished_run
    calls = []

    def first_misses(session, model):
        calls.append(model.id)
        return None if len(calls) == 1 else real(session, model)

    monkeypatch.setattr(loops, "unfinished_run", first_misses)
    assert_problem(client.post("/v1/models/m/loop/runs"), 409, "one run at a time")
    assert len(calls) == 2
    assert len(client.get("/v1/models/m/calibrators").json()["calibrators"]) == versions
    assert len(client.get("/v1/models/m/loop/runs").json()["runs"]) == 1


def test_a_start_retried_with_its_idempotency_key_gets_the_first_answer(client):
    production(client)
    feed(client, "m", temperature=3.0)
    key = {"Idempotency-Key": "run-1"}
    first = client.post("/v1/models/m/loop/runs", headers=key)
    assert first.status_code == 202, first.text
    again = client.post("/v1/models/m/loop/runs", headers=key)
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert again.headers["location"] == first.headers["location"]
    finished_run(client, "m", first.json()["run"])
    runs = client.get("/v1/models/m/loop/runs").json()["runs"]
    assert [r["run"] for r in runs] == [first.json()["run"]]  # one run, not two
