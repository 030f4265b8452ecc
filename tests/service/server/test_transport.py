"""The writes of one event-loop step leave as one (service/server/transport.py), on a
recording transport and on a real connection through ``welltempered serve``'s protocol;
a request body is read on while the application is busy, up to the high-water mark."""

from __future__ import annotations

import asyncio
import hashlib
import socket

import numpy as np
import pytest
from uvicorn import Config
from uvicorn.server import ServerState

from service.server.timeouts import guarded_protocol
from service.server.transport import BODY_HIGH_WATER, FLUSH_BYTES, JoinedWrites
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


def held_body_app(gate: asyncio.Event):
    """An app that waits on ``gate`` after the body's first message, then reads the rest;
    it answers the body's sha256, its largest message and how many messages it read."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        sizes, digest, more = [], hashlib.sha256(), True
        while more:
            message = await receive()
            sizes.append(len(message.get("body", b"")))
            digest.update(message.get("body", b""))
            more = message.get("more_body", False)
            if len(sizes) == 1:
                await gate.wait()
        body = f"{digest.hexdigest()} {max(sizes)} {len(sizes)}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    return app


def test_a_body_is_read_on_while_the_app_is_busy_up_to_the_high_water_mark():
    body = np.random.default_rng(0).integers(0, 256, 3 * BODY_HIGH_WATER, np.uint8).tobytes()

    async def main():
        gate = asyncio.Event()
        loop = asyncio.get_running_loop()
        config = Config(held_body_app(gate), http=guarded_protocol(10, "httptools"),
                        log_level="warning")  # fmt: skip
        config.load()
        state = ServerState()
        server = await loop.create_server(
            lambda: config.http_protocol_class(config=config, server_state=state, app_state={}),
            host="127.0.0.1", port=0, family=socket.AF_INET,
        )  # fmt: skip
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", server.sockets[0].getsockname()[1]
            )
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            while not state.connections or not next(iter(state.connections)).flow.read_paused:
                await asyncio.sleep(0.005)  # the app waits on the gate; the server reads on
            (protocol,) = state.connections
            held = len(protocol.cycle.body)
            gate.set()
            await writer.drain()
            answer = await reader.readuntil(b"\r\n\r\n")
            length = int(answer.split(b"content-length: ")[1].split(b"\r\n")[0])
            digest, largest, messages = (await reader.readexactly(length)).split()
            writer.close()
            return held, digest.decode(), int(largest), int(messages)
        finally:
            server.close()
            for protocol in list(state.connections):
                protocol.transport.close()
            await server.wait_closed()

    held, digest, largest, messages = asyncio.run(main())
    # Held while the app was busy: past the high-water mark (uvicorn stops at 64 KiB),
    # by one socket read at most (asyncio's are 256 KiB); the app then got it in one
    # message, and the body whole.
    assert BODY_HIGH_WATER < held <= BODY_HIGH_WATER + (256 << 10)
    assert held <= largest <= BODY_HIGH_WATER + (256 << 10)
    assert digest == hashlib.sha256(body).hexdigest()
    assert messages < len(body) // (64 << 10)
