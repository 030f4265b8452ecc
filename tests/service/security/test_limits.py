"""Limits and back-pressure: rows, classes, queued fits (429), streamed body limits,
the per-key token bucket (its API behaviour with keys is in test_auth.py)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request

from service.api.app import create_app
from service.errors import TooManyRequests
from service.security.limits import RateLimiter
from service.server.problems import error_response, problem_type
from service.vocabulary import DEFAULT_ALIAS
from tests.service.helpers import (
    Clock,
    assert_problem,
    create_model,
    fit,
    hold_queue,
    logits_data,
    make_settings,
    upload,
)


@pytest.fixture
def limited(database_url, tmp_path):
    settings = make_settings(
        database_url,
        tmp_path,
        max_predict_rows=10,
        max_dataset_rows=500,
        max_classes=50,
        max_queued_fits=1,
        max_json_bytes=200_000,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def test_rows_classes_and_fit_queue(limited):
    c = limited
    assert_problem(c.post("/v1/models", json={"name": "big", "num_classes": 51}), 422, "50")
    create_model(c, "m", 3)
    z, y = logits_data(501, 3)
    r = c.post("/v1/models/m/datasets", json={"logits": z.tolist(), "labels": y.tolist()})
    assert_problem(r, 413, "500 rows")
    ds = upload(c, "m", z[:300], y[:300])
    v = fit(c, "m", ds["id"])
    c.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
    assert c.post("/v1/models/m/predict", json={"logits": z[:10].tolist()}).status_code == 200
    assert_problem(c.post("/v1/models/m/predict", json={"logits": z[:11].tolist()}), 413, "10")
    npy = __import__("io").BytesIO()
    np.save(npy, z[:11].astype(np.float32))
    r = c.post(
        "/v1/models/m/predict",
        content=npy.getvalue(),
        headers={"content-type": "application/x-npy"},
    )
    assert_problem(r, 413)
    # the queue: fits are not started (submit is a no-op), so the first one stays queued
    hold_queue(c)
    body = {"dataset_id": ds["id"], "method": "temperature"}
    assert c.post("/v1/models/m/calibrators", json=body).status_code == 202
    r = c.post("/v1/models/m/calibrators", json=body)
    assert_problem(r, 429, "queued")
    assert int(r.headers["retry-after"]) > 0


def test_oversized_chunked_body_is_refused_without_reading_it(settings):
    """No Content-Length, an endless body: 413 after about `limit` bytes, not the whole."""
    app = create_app(settings.model_copy(update={"max_metadata_bytes": 64 * 1024}))
    chunk = b"x" * 8192
    sent = {"chunks": 0}
    messages = []

    async def receive():
        sent["chunks"] += 1
        if sent["chunks"] > 10_000:  # 80 MB: far beyond; the server must stop long before
            raise AssertionError("the whole body was read")
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }

    async def run():
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in messages if m["type"] == "http.response.start")
    assert start["status"] == 413
    assert sent["chunks"] * len(chunk) <= 64 * 1024 + 2 * len(chunk)


# ---------------------------------------------------------------------------
# the token bucket, on an injected clock


def test_bucket_gives_a_burst_then_refuses_until_refilled():
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == 0.5  # one token comes back in 1 / rate seconds
    assert limiter.take("a") == 0.5  # a refused request takes nothing
    assert limiter.take("b") == 0.0  # another key has its own bucket
    clock.now += 0.25
    assert limiter.take("a") == 0.25
    clock.now += 0.25
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == 0.5
    clock.now += 3600  # refills up to the burst, not beyond
    assert [limiter.take("a") for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]


def test_refusal_is_a_429_with_retry_after_rounded_up():
    clock = Clock()
    counted = []  # the app counts them in welltempered_rate_limited_requests_total
    limiter = RateLimiter(rate=0.25, burst=1, clock=clock, on_refused=counted.append)
    key = (7, "bucket-unit-test", "wt_abcdefgh")  # id, namespace, prefix of an API key
    limiter.check(*key)
    with pytest.raises(TooManyRequests) as refused:
        limiter.check(*key)
    assert refused.value.retry_after == 4  # 1 token / 0.25 per second
    assert problem_type(refused.value).status == 429
    request = Request({"type": "http", "path": "/v1/models", "headers": []})
    response = error_response(request, refused.value)
    assert response.status_code == 429 and response.headers["retry-after"] == "4"
    detail = refused.value.detail
    assert "wt_abcdefgh..." in detail and "rate limit of 0.25/s" in detail
    assert "bursts of 1" in detail and "WELLTEMPERED_RATE_LIMIT_BURST" in detail
    clock.now += 1.5  # 0.375 of a token: 2.5 s to go, rounded up
    with pytest.raises(TooManyRequests) as refused:
        limiter.check(*key)
    assert refused.value.retry_after == 3
    assert counted == ["bucket-unit-test"] * 2
    fast = RateLimiter(rate=10.0, burst=1, clock=clock)  # 0.1 s to wait: at least 1
    fast.check(*key)
    with pytest.raises(TooManyRequests) as refused:
        fast.check(*key)
    assert refused.value.retry_after == 1


def test_idle_buckets_are_dropped_a_few_per_request():
    clock = Clock(0.0)
    limiter = RateLimiter(rate=1.0, burst=2, clock=clock)
    for key in range(10):
        assert [limiter.take(key), limiter.take(key)] == [0.0, 0.0]  # empty: full at t = 2
    clock.now = 1.5
    limiter.take("x")
    assert len(limiter) == 11  # none full yet
    clock.now = 2.0
    sizes = []
    for _ in range(6):
        limiter.take("x")
        sizes.append(len(limiter))
    assert sizes == [9, 7, 5, 3, 1, 1]  # two per request; "x" is not full, so it stays
    assert [limiter.take(0), limiter.take(0), limiter.take(0)] == [0.0, 0.0, 1.0]  # full again


class NaiveBuckets:
    """The same token bucket with every bucket kept forever: the oracle for dropping."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst, self.buckets = rate, burst, {}

    def take(self, key, now: float) -> float:
        tokens, last = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self.buckets[key] = (tokens - 1.0, now)
            return 0.0
        self.buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate


steps = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(0.0, 3.0)),
        st.integers(0, 5),
    ),
    max_size=120,
)


@given(
    rate=st.one_of(st.sampled_from([0.1, 0.3, 1.0, 3.0]), st.floats(0.05, 50.0)),
    burst=st.integers(1, 6),
    steps=steps,
)
def test_dropping_full_buckets_never_changes_an_answer(rate, burst, steps):
    clock = Clock(0.0)
    limiter, oracle = RateLimiter(rate, burst, clock=clock), NaiveBuckets(rate, burst)
    for dt, key in steps:
        clock.now += dt
        assert limiter.take(key) == oracle.take(key, clock.now)
        full = [
            k
            for k, (tokens, last) in oracle.buckets.items()
            if tokens + (clock.now - last) * rate >= burst
        ]
        assert len(limiter) <= len(oracle.buckets)
        assert len(limiter) >= len(oracle.buckets) - len(full)  # only full ones dropped
    # after a long idle time, requests of one key drop every other bucket
    clock.now += burst / rate + 1.0
    for _ in range(math.ceil(len(limiter) / 2) + 1):
        limiter.take("only")
    assert len(limiter) == 1


@pytest.mark.parametrize(
    ("rate", "burst"), [(0.0, 1), (-1.0, 1), (math.nan, 1), (math.inf, 1), (1.0, 0), (1.0, 1.5)]
)
def test_limiter_refuses_nonsense_parameters(rate, burst):
    with pytest.raises(ValueError, match="Got"):
        RateLimiter(rate, burst)


def test_no_rate_limit_with_auth_off(settings):
    """Auth off: every request is the same anonymous admin, nothing to count against."""
    limited = settings.model_copy(update={"rate_limit_per_second": 1.0, "rate_limit_burst": 1})
    assert limited.auth == "off"
    with TestClient(create_app(limited), raise_server_exceptions=False) as c:
        assert c.app.state.welltempered_auth.limiter is None
        assert [c.get("/v1/models").status_code for _ in range(5)] == [200] * 5
