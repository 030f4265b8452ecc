"""POST /v1/models/{model}/feedback as JSON or .npz, and its row limit, on both backends.

A .npz body holds the arrays a dataset upload accepts (``logits`` | ``probabilities`` |
``predictions``, ``labels`` | ``ground_truth``) and names its version in the query.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

import service.api.routers.monitoring
import service.observe.monitoring
from service.api.app import create_app
from service.storage.db import FeedbackBin
from service.vocabulary import DEFAULT_ALIAS
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    families,
    logits_data,
    make_settings,
    npy,
    npz,
    promote,
    upload,
)

URL = "/v1/models/m/feedback"
OCTET = {"content-type": "application/octet-stream"}
X_NPZ = {"content-type": "application/x-npz"}
LIMIT = 50


def promoted(client: TestClient) -> TestClient:
    """Model 'm' (4 classes), version 1 fitted on synthetic logits and given the default alias."""
    logits, labels = logits_data(300, k=4)
    create_model(client, "m")
    promote(client, "m", upload(client, "m", logits, labels)["id"])
    return client


@pytest.fixture
def served(client) -> TestClient:
    return promoted(client)


@pytest.fixture
def limited(database_url, tmp_path) -> Iterator[TestClient]:
    """Like ``served``, with WELLTEMPERED_MAX_FEEDBACK_ROWS = LIMIT."""
    s = make_settings(database_url, tmp_path, max_feedback_rows=LIMIT)
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield promoted(c)


class Clock:
    """The ``time`` module with ``time()`` set by the test (everything else passes through)."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def stored_bins(client: TestClient) -> dict[int, list[tuple]]:
    """Every row of feedback_bins, by bucket: (version id, bin, sums...), in bin order."""
    with client.app.state.welltempered.sessions() as session:
        rows = session.scalars(
            select(FeedbackBin).order_by(FeedbackBin.bucket_start, FeedbackBin.bin_index)
        ).all()
    out: dict[int, list[tuple]] = {}
    for r in rows:
        out.setdefault(r.bucket_start, []).append(
            (
                r.version_id,
                r.bin_index,
                r.count,
                r.correct_count,
                r.confidence_sum,
                r.nll_sum,
                r.entropy_sum,
                r.brier_sum,
            )
        )
    return out


def monitoring_figures(client: TestClient, window: str = "1h") -> dict:
    r = client.get("/v1/models/m/monitoring", params={"window": window})
    assert r.status_code == 200, r.text
    return r.json()


def leftover_uploads(client: TestClient) -> list[str]:
    return sorted(p.name for p in client.app.state.welltempered.arrays.tmp.iterdir())


# ---------------------------------------------------------------------------
# .npz and JSON: the same rows, the same figures


def _rows(kind: str, n: int = 500):
    """(JSON key, score array, .npz score name, .npz label name, labels) for ``kind``."""
    logits, labels = logits_data(n, k=4, seed=7)
    if kind == "logits":
        return "logits", logits, "logits", "labels", labels
    if kind == "probabilities":
        return "probabilities", softmax(logits), "probabilities", "labels", labels
    # float32 probabilities named as in the CIFAR files; int32 labels
    probs = softmax(logits).astype(np.float32)
    probs /= probs.sum(axis=1, keepdims=True, dtype=np.float32)
    return "probabilities", probs, "predictions", "ground_truth", labels.astype(np.int32)


@pytest.mark.parametrize("kind", ["logits", "probabilities", "predictions"])
def test_npz_feedback_equals_json(served, monkeypatch, kind):
    """The same rows as JSON in one bucket and as .npz in another, a day later: the stored
    per-bin sums of the two buckets, the answers and the live figures (with the drift
    verdict) of a 1h window are exactly equal."""
    json_key, scores, score_name, label_name, labels = _rows(kind)
    t0 = 1_700_000_040.0  # a bucket start (a multiple of 60)
    clock = Clock(t0)
    monkeypatch.setattr(service.api.routers.monitoring, "time", clock)
    monkeypatch.setattr(service.observe.monitoring, "time", clock)

    r = served.post(URL, json={json_key: scores.tolist(), "labels": labels.tolist()})
    assert r.status_code == 200, r.text
    by_json = r.json()
    live_json = monitoring_figures(served)

    clock.now = t0 + 86_400
    body = npz(**{score_name: scores, label_name: labels})
    r = served.post(URL, content=body, headers=OCTET)
    assert r.status_code == 200, r.text
    by_npz = r.json()
    live_npz = monitoring_figures(served)

    assert by_json["bucket_start"] == t0 and by_npz["bucket_start"] == t0 + 86_400
    assert {**by_json, "bucket_start": None} == {**by_npz, "bucket_start": None}
    assert by_npz["rows"] == 500 and by_npz["version"] == 1
    bins = stored_bins(served)
    assert sorted(bins) == [t0, t0 + 86_400]
    assert bins[t0] == bins[t0 + 86_400]
    assert sum(row[2] for row in bins[t0]) == 500
    assert live_json["live"]["n"] == 500
    assert {**live_json, "since": None} == {**live_npz, "since": None}
    assert monitoring_figures(served, "2d")["live"]["n"] == 1000
    assert leftover_uploads(served) == []


def test_npz_feedback_names_its_version_in_the_query(served):
    """Version 2 (not aliased) gets the .npz rows of ?version=2; the aliased version
    gets none."""
    logits, labels = logits_data(300, k=4)
    promote(served, "m", 1, seed=1)  # version 2 has the default alias now
    served.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": 1})
    rows = npz(logits=logits[:40], labels=labels[:40])
    r = served.post(f"{URL}?version=2", content=rows, headers=X_NPZ)
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["rows"]) == (2, 40)
    figures = {
        v: served.get("/v1/models/m/monitoring", params={"version": v}).json()["live"]["n"]
        for v in (1, 2)
    }
    assert figures == {1: 0, 2: 40}
    # JSON: the query's version, the body's, or both when they agree
    part = {"logits": logits[:5].tolist(), "labels": labels[:5].tolist()}
    assert served.post(f"{URL}?version=2", json=part).json()["version"] == 2
    assert served.post(URL, json={**part, "version": 2}).json()["version"] == 2
    assert served.post(f"{URL}?version=2", json={**part, "version": 2}).json()["version"] == 2
    assert_problem(served.post(f"{URL}?version=1", json={**part, "version": 2}), 422, "disagree")
    assert served.get("/v1/models/m/monitoring", params={"version": 2}).json()["live"]["n"] == 55


# ---------------------------------------------------------------------------
# the row limit


def test_over_limit_feedback_is_refused_and_stores_nothing(limited):
    logits, labels = logits_data(300, k=4, seed=2)
    ok = limited.post(
        URL, json={"logits": logits[:LIMIT].tolist(), "labels": labels[:LIMIT].tolist()}
    )
    assert ok.status_code == 200, ok.text
    r = limited.post(URL, content=npz(logits=logits[:LIMIT], labels=labels[:LIMIT]), headers=OCTET)
    assert r.status_code == 200, r.text
    before = (monitoring_figures(limited), stored_bins(limited))
    counted = families(limited.get("/metrics").text)["welltempered_feedback_rows_total"]

    over = LIMIT + 1
    refused = [
        limited.post(
            URL, json={"logits": logits[:over].tolist(), "labels": labels[:over].tolist()}
        ),
        limited.post(
            URL,
            json={
                "probabilities": softmax(logits)[:over].tolist(),
                "labels": labels[:over].tolist(),
                "version": 1,
            },
        ),
        limited.post(URL, content=npz(logits=logits[:over], labels=labels[:over]), headers=OCTET),
        limited.post(
            f"{URL}?version=1",
            content=npz(predictions=softmax(logits), ground_truth=labels),
            headers=X_NPZ,
        ),
    ]
    for r in refused:
        body = assert_problem(r, 413, f"at most {LIMIT} rows", "WELLTEMPERED_MAX_FEEDBACK_ROWS")
        assert body["max_rows"] == LIMIT
    assert refused[-1].json()["detail"].endswith("Got 300.")

    assert (monitoring_figures(limited), stored_bins(limited)) == before
    assert before[0]["live"]["n"] == 2 * LIMIT
    after = families(limited.get("/metrics").text)["welltempered_feedback_rows_total"]
    assert after == counted  # the process-wide counter did not move either
    assert leftover_uploads(limited) == []


# ---------------------------------------------------------------------------
# bad bodies: 400, 415, 422 problems; nothing stored


def test_bad_npz_and_media_types(served):
    logits, labels = logits_data(20, k=4)
    good = npz(logits=logits, labels=labels)
    nan = logits.copy()
    nan[3, 1] = np.nan
    objects = npz(logits=np.array([[1, "x", 2, 3]], dtype=object), labels=np.array([0]))
    cases = [
        (b"not a zip", OCTET, 400, ("npz",)),
        (b"", OCTET, 400, ("npz",)),
        (good[: len(good) // 2], OCTET, 400, ()),
        (good[:-30], X_NPZ, 400, ()),
        (npy(logits), OCTET, 422, ("single .npy", "labels")),  # issue 24: what to send
        (npz(logits=logits), OCTET, 422, ("label array",)),
        (
            npz(logits=logits, probabilities=softmax(logits), labels=labels),
            OCTET,
            422,
            ("one score",),
        ),
        (npz(logits=logits[:, :3], labels=labels), OCTET, 422, ("4 columns",)),
        (npz(logits=logits, labels=labels[:5]), OCTET, 422, ("labels",)),
        (npz(logits=logits, labels=labels + 4), OCTET, 422, ("labels",)),
        (npz(logits=nan, labels=labels), OCTET, 422, ("finite", "row 3")),
        (objects, OCTET, 422, ("object",)),
        (good, {"content-type": "text/csv"}, 415, ("application/json", ".npz", "text/csv")),
        (good, {"content-type": "application/x-npy"}, 415, ("application/x-npy",)),
        (good, {"content-type": "multipart/form-data; boundary=x"}, 415, ("multipart",)),
        (good, {}, 415, ("no content-type",)),
    ]
    for content, headers, status, words in cases:
        assert_problem(served.post(URL, content=content, headers=headers), status, *words)
    # the version in the query is checked like the monitoring routes'
    assert_problem(served.post(f"{URL}?version=9", content=good, headers=OCTET), 404, "version 9")
    assert_problem(served.post(f"{URL}?version=0", content=good, headers=OCTET), 422, "version")
    assert_problem(served.post(f"{URL}?version=x", content=good, headers=OCTET), 422, "version")
    assert_problem(served.post("/v1/models/zz/feedback", content=good, headers=OCTET), 404, "zz")
    assert monitoring_figures(served)["live"]["n"] == 0
    assert stored_bins(served) == {}
    assert leftover_uploads(served) == []


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_damaged_npz_never_500(served, data):
    """A valid .npz with bytes overwritten, then possibly cut: a 200 or a problem."""
    logits, labels = logits_data(6, k=4)
    kind = data.draw(st.sampled_from(["logits", "probabilities", "predictions"]))
    scores = logits if kind == "logits" else softmax(logits)
    body = bytearray(npz(**{kind: scores, "labels": labels}))
    edits = data.draw(
        st.lists(st.tuples(st.integers(0, len(body) - 1), st.integers(0, 255)), max_size=4)
    )
    for at, value in edits:
        body[at] = value
    cut = data.draw(st.integers(0, len(body)))
    r = served.post(URL, content=bytes(body[:cut]), headers=OCTET)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/problem+json", r.headers
        assert r.json()["detail"]


# ---------------------------------------------------------------------------
# the OpenAPI document


def test_feedback_formats_are_documented(client):
    op = client.get("/openapi.json").json()["paths"]["/v1/models/{model}/feedback"]["post"]
    content = op["requestBody"]["content"]
    # the types every client generator knows; x-npz and zip are accepted too, and said
    assert set(content) == {"application/json", "application/octet-stream"}
    described = content["application/octet-stream"]["schema"]["description"]
    assert "application/x-npz" in described and "application/zip" in described
    assert set(content["application/json"]["schema"]["properties"]) == {
        "logits",
        "probabilities",
        "labels",
        "version",
    }
    binary = content["application/octet-stream"]["schema"]
    assert (binary["type"], binary["format"]) == ("string", "binary")
    assert "ground_truth" in binary["description"]
    assert "WELLTEMPERED_MAX_FEEDBACK_ROWS" in op["requestBody"]["description"]
    params = {(p["in"], p["name"]): p for p in op["parameters"]}
    assert set(params) == {
        ("path", "model"),
        ("query", "version"),
        ("query", "kind"),
        ("query", "dtype"),
        ("header", "Idempotency-Key"),
    }
    assert "not applied twice" in params["header", "Idempotency-Key"]["description"]
    assert {"400", "413", "415", "422"} <= set(op["responses"])
