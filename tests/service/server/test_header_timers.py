"""The header deadline arms no timer per request (service/server/timeouts.py, Deadlines):
one server's connections share one timer, and a silent connection is still closed."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from tests.service.servers import protocol_server

TIMEOUT = 0.5


@pytest.fixture
def server(monkeypatch):
    """``serve``'s protocol on asyncio's loop in a thread; the callbacks of the timers
    that thread arms, counted from when it serves."""
    armed: list[tuple[threading.Thread, object]] = []
    call_at = asyncio.BaseEventLoop.call_at

    def counted(loop, when, callback, *args, **kwargs):
        armed.append((threading.current_thread(), callback))
        return call_at(loop, when, callback, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_at", counted)
    with protocol_server(b"ok", header_timeout=TIMEOUT) as (port, thread):
        armed.clear()  # start-up's timers are not the requests'
        yield port, armed, thread


def test_requests_on_a_connection_arm_no_header_timer_each(server):
    port, armed, thread = server
    n = 40
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for _ in range(n):
            c.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while not got.endswith(b"ok"):
                got += c.recv(4096)
    # uvicorn arms its keep-alive timer after every answer (n); the header deadlines
    # add one timer while any is set, however many requests: not another n.
    served = [callback for t, callback in armed if t is thread]
    assert len(served) <= n + 5, len(served)


def test_a_silent_connection_is_still_closed_at_its_deadline(server):
    port, _, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET / HTTP/1.1\r\nHo")  # part of a request, then nothing
        start = time.monotonic()
        data = b""
        while chunk := c.recv(4096):
            data += chunk
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert TIMEOUT - 0.05 <= took < TIMEOUT + 1.0, took
