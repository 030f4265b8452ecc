"""The writes of one event-loop step leave as one (service/server/transport.py), on a
recording transport and on a real connection through ``welltempered serve``'s protocol."""

from __future__ import annotations

import asyncio
import socket

import pytest

from service.server.transport import FLUSH_BYTES, JoinedWrites
from tests.service.servers import protocol_server


class Recording:
    """A transport that records each call that would reach the socket."""

    def __init__(self):
        self.calls: list[tuple[str, list[bytes]]] = []
        self.closing = False

    def write(self, data):
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, parts):
        self.calls.append(("writelines", [bytes(p) for p in parts]))

    def close(self):
        self.calls.append(("close", []))
        self.closing = True

    def abort(self):
        self.calls.append(("abort", []))
        self.closing = True

    def write_eof(self):
        self.calls.append(("write_eof", []))

    def is_closing(self):
        return self.closing

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def run(steps):
    """Run ``steps(joined, recording)`` (a coroutine function) on a fresh loop."""

    async def main():
        recording = Recording()
        joined = JoinedWrites(recording, asyncio.get_running_loop())
        await steps(joined, recording)
        return recording.calls

    return asyncio.run(main())


def test_writes_of_one_step_go_out_together_after_it():
    async def steps(t, rec):
        t.write(b"head")
        t.write(b"")  # nothing to send: not a part
        t.write(b"body")
        assert rec.calls == []  # not before the step ends
        await asyncio.sleep(0)
        t.write(b"next")
        await asyncio.sleep(0)

    assert run(steps) == [("writelines", [b"head", b"body"]), ("write", [b"next"])]


def test_a_large_write_is_not_held():
    big = b"x" * FLUSH_BYTES

    async def steps(t, rec):
        t.write(big)
        assert rec.calls == [("write", [big])]
        t.write(b"head")
        t.write(big)  # the pending bytes reach the limit: both go now, in order
        assert rec.calls[-1] == ("writelines", [b"head", big])
        await asyncio.sleep(0)  # the step's scheduled flush finds nothing left

    assert len(run(steps)) == 2


def test_close_and_eof_send_what_is_pending_first_and_abort_drops_it():
    async def closing(t, rec):
        t.write(b"last")
        t.close()
        await asyncio.sleep(0)

    assert run(closing) == [("write", [b"last"]), ("close", [])]

    async def eof(t, rec):
        t.writelines([b"a", b"b"])
        t.write_eof()

    assert run(eof) == [("writelines", [b"a", b"b"]), ("write_eof", [])]

    async def aborting(t, rec):
        t.write(b"dropped")
        assert t.get_write_buffer_size() == len(b"dropped")
        t.abort()
        await asyncio.sleep(0)

    assert run(aborting) == [("abort", [])]


def test_nothing_is_written_to_a_connection_that_went_meanwhile():
    async def steps(t, rec):
        t.write(b"answer")
        rec.closing = True  # the peer left: the event loop closed the transport
        await asyncio.sleep(0)

    assert run(steps) == []


def test_everything_else_is_the_transport_s():
    async def steps(t, rec):
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)
        assert t.is_closing() is False

    run(steps)


@pytest.fixture
def server(monkeypatch):
    """``serve``'s protocol on a real connection, its answer written as headers and a
    body; every flush of its transport recorded."""
    sent: list[str] = []
    flush = JoinedWrites.flush

    def recorded_flush(self):
        if self._parts:
            sent.append("writelines" if len(self._parts) > 1 else "write")
        flush(self)

    monkeypatch.setattr(JoinedWrites, "flush", recorded_flush)
    with protocol_server(b"x" * 3000) as (port, _):
        yield port, sent


def test_an_answer_leaves_in_one_write_on_a_real_connection(server):
    port, sent = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for _ in range(3):  # keep-alive: every answer of the connection
            c.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while not got.endswith(b"x" * 3000):
                got += c.recv(65536)
            assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert sent == ["writelines"] * 3
