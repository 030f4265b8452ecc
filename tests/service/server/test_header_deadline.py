"""The header deadline of both HTTP parsers, in process (service/server/timeouts.py).

A real socket pair and a real event loop, with a short deadline: a request whose
handler runs longer than the deadline is answered, not cut off; a connection that
sends part of its headers gets a 408; one that sends nothing is closed silently; a
keep-alive connection gets the deadline again after each answer.
tests/service/server/test_timeouts.py drives the same rules through `welltempered serve`.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from uvicorn import Config
from uvicorn.server import ServerState

from service.server.timeouts import PROTOCOLS, guarded_protocol

DEADLINE = 0.3


async def slow_app(scope, receive, send):
    """Reads the whole body, then takes ``DEADLINE * 3`` seconds to answer."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await asyncio.sleep(DEADLINE * 3)
    headers = [(b"content-length", b"4")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"done"})


async def serve_one(parser: str, client_script, first: bytes = b""):
    """Run ``client_script(reader, writer)`` against one connection of ``parser``'s
    guarded protocol; return what it returns.

    ``first`` is sent on a blocking socket before the event loop sees the connection:
    the server's first read then finds it waiting. Written from the script instead, it
    would leave the server's deadline armed while the loop runs the client, and a
    process stalled for the deadline (a loaded machine) had the check close the
    connection with the bytes unread (a reset, seen once in a full run)."""
    loop = asyncio.get_running_loop()
    config = Config(slow_app, http=guarded_protocol(DEADLINE, parser), log_level="warning")
    config.load()
    state = ServerState()
    server = await loop.create_server(
        lambda: config.http_protocol_class(config=config, server_state=state, app_state={}),
        host="127.0.0.1",
        port=0,
        family=socket.AF_INET,
    )
    port = server.sockets[0].getsockname()[1]
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(first)
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            return await client_script(reader, writer)
        finally:
            writer.close()
    finally:
        server.close()
        for protocol in list(state.connections):
            protocol.transport.close()
        await server.wait_closed()


async def read_all(reader, timeout: float) -> tuple[bytes, bool]:
    """What arrived within ``timeout``, and whether the server closed the connection."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        return data, False
    return data, True


REQUEST = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"


@pytest.mark.parametrize("parser", sorted(PROTOCOLS))
def test_a_request_that_runs_past_the_deadline_is_answered(parser):
    async def client(reader, writer):
        return await read_all(reader, DEADLINE * 6)  # answered at 3x, closed at 4x

    data, closed = asyncio.run(serve_one(parser, client, first=REQUEST))
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"done")
    # Then the keep-alive connection owes its next request: the deadline closes it
    # silently, long before uvicorn's 5 s keep-alive timeout.
    assert closed


@pytest.mark.parametrize("parser", sorted(PROTOCOLS))
def test_partial_headers_get_a_408_and_silence_is_closed(parser):
    async def partial(reader, writer):
        return await read_all(reader, DEADLINE * 4)

    async def silent(reader, writer):
        return await read_all(reader, DEADLINE * 4)

    data, closed = asyncio.run(serve_one(parser, partial, first=REQUEST[:20]))
    assert closed and data.startswith(b"HTTP/1.1 408 ")
    assert asyncio.run(serve_one(parser, silent)) == (b"", True)


@pytest.mark.parametrize("parser", sorted(PROTOCOLS))
def test_a_body_that_is_being_read_is_not_cut_off_by_the_header_deadline(parser):
    """Headers on time, then the body in pieces slower than the header deadline: the
    application is waiting for it, so only the body rules (BodyTimeoutMiddleware)
    apply, and this app has none."""

    head, body = REQUEST.split(b"\r\n\r\n")

    async def client(reader, writer):
        for byte in body:
            await asyncio.sleep(DEADLINE * 0.6)
            writer.write(bytes([byte]))
        return await read_all(reader, DEADLINE * 6)

    data, _ = asyncio.run(serve_one(parser, client, first=head + b"\r\n\r\n"))
    assert data.startswith(b"HTTP/1.1 200 ")


def test_headers_over_their_bound_get_a_431_and_the_connection_closes():
    """httptools: a request line or a header that keeps coming past MAX_HEAD_BYTES is
    answered 431 and closed, instead of being joined in memory (a 32 MiB header cost
    100 MiB before); headers just under the bound are answered."""
    from service.server.timeouts import MAX_HEAD_BYTES

    async def huge_header(reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        while sent < 3 * MAX_HEAD_BYTES:
            try:
                writer.write(b"a" * 65536)
                await writer.drain()
            except ConnectionError:
                break
            sent += 65536
        return await asyncio.wait_for(reader.read(), 5)

    async def huge_line(reader, writer):
        writer.write(b"GET /" + b"a" * (2 * MAX_HEAD_BYTES))
        try:
            await writer.drain()
        except ConnectionError:
            pass
        return await asyncio.wait_for(reader.read(), 5)

    async def under(reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES // 2)
                     + b"\r\ncontent-length: 0\r\n\r\n")
        return await asyncio.wait_for(reader.readuntil(b"done"), 5)

    for script in (huge_header, huge_line):
        answer = asyncio.run(serve_one("httptools", script))
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert asyncio.run(serve_one("httptools", under)).startswith(b"HTTP/1.1 200 ")
