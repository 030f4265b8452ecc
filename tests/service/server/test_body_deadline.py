"""The body deadline in process (service/server/timeouts.py, Deadlines): a wait past its
deadline is a 408, someone else's cancellation is not, a body that is there costs no
timer, and one middleware serves several event loops in turn. The same rules against a
real server, slow clients included, are in test_timeouts.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from service.server.timeouts import BodyTimeoutMiddleware

IDLE = 0.2


async def reading_app(scope, receive, send):
    """Reads the whole body, then answers how many bytes it got."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/upload", "headers": []}


async def call(app, receive) -> tuple[int, bytes]:
    sent = []

    async def send(message):
        sent.append(message)

    await app(scope(), receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def pieces(*delays: float):
    """A receive that sends a 10-byte piece after each delay, the last one final."""
    queue = list(delays)

    async def receive():
        await asyncio.sleep(queue.pop(0))
        return {"type": "http.request", "body": b"x" * 10, "more_body": bool(queue)}

    return receive


def test_a_body_that_arrives_in_time_is_read_whatever_the_app_takes():
    app = BodyTimeoutMiddleware(reading_app, idle=IDLE, min_rate=0)
    assert asyncio.run(call(app, pieces(0, 0.05, 0.05))) == (200, b"30")
    assert app.deadlines.due == {}


def test_a_wait_past_its_deadline_is_a_408_problem_within_a_tick():
    app = BodyTimeoutMiddleware(reading_app, idle=IDLE, min_rate=0)

    async def timed():
        loop = asyncio.get_running_loop()
        start = loop.time()
        result = await call(app, pieces(0, 10.0))
        return result, loop.time() - start

    (status, body), took = asyncio.run(timed())
    assert status == 408
    assert "arrived too slowly" in json.loads(body)["detail"]
    assert IDLE <= took < IDLE + 2 * app.deadlines.tick + 0.5
    assert app.deadlines.due == {}


def test_someone_else_s_cancellation_is_not_a_timeout():
    app = BodyTimeoutMiddleware(reading_app, idle=IDLE, min_rate=0)

    async def cancelled():
        task = asyncio.ensure_future(call(app, pieces(10.0)))
        await asyncio.sleep(IDLE / 4)  # waiting, before its deadline
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return app.deadlines.due

    assert asyncio.run(cancelled()) == {}


def test_one_middleware_serves_event_loops_in_turn():
    app = BodyTimeoutMiddleware(reading_app, idle=IDLE, min_rate=0)
    for _ in range(3):  # the deadlines' timer belongs to the loop that armed it
        assert asyncio.run(call(app, pieces(0, 10.0)))[0] == 408
        assert asyncio.run(call(app, pieces(0.01)))[0] == 200


def test_a_body_that_is_there_arms_no_timer():
    app = BodyTimeoutMiddleware(reading_app, idle=IDLE, min_rate=0)

    async def served():
        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at  # every timer of asyncio's loop, call_later's included
        loop.call_at = lambda *a, **k: armed.append(a) or call_at(*a, **k)
        try:
            for _ in range(50):
                assert await call(app, receive) == (200, b"2")
        finally:
            del loop.call_at
        return armed

    assert len(asyncio.run(served())) == 1  # the deadlines' one timer, not one per request
