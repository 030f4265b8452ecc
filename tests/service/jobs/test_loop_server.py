"""The recalibration loop end to end against real processes (service.jobs.loop): a
``welltempered serve`` on SQLite running its fits in child processes, and on PostgreSQL
an API-only ``serve`` beside a ``welltempered worker`` (the comparison and the promotion
then happen in the worker's fit process, and the API reads them from the database).

Induced drift: production is temperature scaling fitted on rows whose labels follow the
scores; feedback then arrives whose labels follow a tempered version of the scores
(``softmax(z / 3)``: the scores became over-confident). The candidate is fitted on the
kept feedback, evaluated against production on the held-back rows and promoted; with
feedback like production's own rows the candidate is within the margin and is not.
"""

from __future__ import annotations

import time

import httpx
import pytest

from service.storage import migrate
from service.vocabulary import DEFAULT_ALIAS
from tests.oracles import wait_for_version
from tests.service.helpers import tempered_rows
from tests.service.servers import Server, Worker

pytestmark = [pytest.mark.slow, pytest.mark.process]

K = 5


def production(c: httpx.Client, name: str) -> int:
    """A model whose production version fits rows whose labels follow their scores."""
    r = c.post("/v1/models", json={"name": name, "num_classes": K})
    assert r.status_code == 201, r.text
    z, y = tempered_rows(2000, K, 1.0, seed=11)
    r = c.post(f"/v1/models/{name}/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    assert r.status_code == 201, r.text
    r = c.post(
        f"/v1/models/{name}/calibrators",
        json={"dataset_id": r.json()["id"], "method": "temperature"},
    )
    assert r.status_code == 202, r.text
    version = wait_for_version(c, name, r.json()["version"], timeout=120, interval=0.2)
    assert version["status"] == "succeeded", version
    r = c.put(f"/v1/models/{name}/aliases/{DEFAULT_ALIAS}", json={"version": version["version"]})
    assert r.status_code == 200, r.text
    r = c.put(f"/v1/models/{name}/loop", json={"auto_promote": True})
    assert r.status_code == 200, r.text
    return version["version"]


def feedback(c: httpx.Client, name: str, temperature: float, seed: int) -> None:
    for part in range(2):  # two posts: the loop joins them
        z, y = tempered_rows(800, K, temperature, seed=seed + part)
        r = c.post(
            f"/v1/models/{name}/feedback", json={"logits": z.tolist(), "labels": y.tolist()}
        )
        assert r.status_code == 200, r.text
        assert r.json()["kept"] == 800


def run_to_end(c: httpx.Client, name: str) -> tuple[dict, list[dict]]:
    r = c.post(f"/v1/models/{name}/loop/runs")
    assert r.status_code == 202, r.text
    started = r.json()
    wait_for_version(c, name, started["candidate_version"], timeout=120, interval=0.2)
    deadline = time.monotonic() + 30
    while True:
        runs = c.get(f"/v1/models/{name}/loop/runs").json()["runs"]
        run = next(x for x in runs if x["run"] == started["run"])
        if run["state"] != "fitting":
            break
        assert time.monotonic() < deadline, run
        time.sleep(0.2)
    events = c.get(started["events_url"]).json()["events"]
    return run, events


def check_loop(server: Server) -> None:
    with server.client() as c:
        first = production(c, "drifted")
        feedback(c, "drifted", temperature=3.0, seed=20)
        run, events = run_to_end(c, "drifted")
        assert run["state"] == "promoted", (run, events, server.output())
        assert [e["step"] for e in events] == [
            "started", "candidate-fitted", "evaluated", "promoted"
        ]
        assert events[2]["details"]["nll_gain_low"] > events[2]["details"]["margin"] > 0
        alias = c.get(f"/v1/models/drifted/aliases/{DEFAULT_ALIAS}").json()
        assert alias["version"] == run["candidate_version"] != first

        steady = production(c, "steady")
        feedback(c, "steady", temperature=1.0, seed=30)
        run, events = run_to_end(c, "steady")
        assert run["state"] == "not-promoted", (run, events)
        assert events[-1]["step"] == "not-promoted" and events[-1]["details"]["reasons"]
        alias = c.get(f"/v1/models/steady/aliases/{DEFAULT_ALIAS}").json()
        assert alias["version"] == steady


def test_loop_on_sqlite_serve(tmp_path):
    with Server(f"sqlite:///{tmp_path}/loop.sqlite3", tmp_path / "data") as server:
        check_loop(server)


def test_loop_on_a_postgresql_fleet(pg_schema, tmp_path):
    migrate.upgrade(pg_schema)
    data = tmp_path / "data"
    with Server(pg_schema, data, run_fits="false") as api, Worker(pg_schema, data):
        check_loop(api)
