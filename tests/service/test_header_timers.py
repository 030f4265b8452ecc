"""The header deadline arms no timer per request (service/api/timeouts.py, _Deadlines):
one server's connections share one timer, and a silent connection is still closed."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from service.api.timeouts import guarded_protocol

TIMEOUT = 0.5


@pytest.fixture
def server(monkeypatch):
    """uvicorn on asyncio's loop with ``serve``'s httptools protocol; every timer the
    server's thread arms is counted."""
    armed = []
    call_at = asyncio.BaseEventLoop.call_at

    def counted(loop, when, callback, *args, **kwargs):
        if threading.current_thread() is thread:
            armed.append(callback)
        return call_at(loop, when, callback, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_at", counted)

    async def answer(request):
        return Response(b"ok", media_type="text/plain")

    config = uvicorn.Config(
        Starlette(routes=[Route("/", answer)]),
        http=guarded_protocol(TIMEOUT, "httptools"),
        loop="asyncio",
        lifespan="off",
        log_level="warning",
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        thread.join(0.01)
    yield sock.getsockname()[1], armed
    srv.should_exit = True
    thread.join(10)


def test_requests_on_a_connection_arm_no_header_timer_each(server):
    port, armed = server
    n = 40
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for _ in range(n):
            c.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while not got.endswith(b"ok"):
                got += c.recv(4096)
    # uvicorn arms its keep-alive timer after every answer (n); the header deadlines
    # add one timer while any is set, however many requests: not another n.
    assert len(armed) <= n + 5, len(armed)


def test_a_silent_connection_is_still_closed_at_its_deadline(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET / HTTP/1.1\r\nHo")  # part of a request, then nothing
        start = time.monotonic()
        data = b""
        while chunk := c.recv(4096):
            data += chunk
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert TIMEOUT - 0.05 <= took < TIMEOUT + 1.0, took
