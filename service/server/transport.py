"""One write per answer: the transport under ``welltempered serve``'s HTTP protocols.

uvicorn writes a response's status line and headers as soon as the application sends
``http.response.start``, and its body as a second write. For a small answer that is two
``send`` system calls and two TCP segments, and a client that reads the headers first
wakes twice. Profiled under load, a 1 x 1,000 prediction's two writes took 31 us of
the server's time and its one joined write 15 us (bench/README.md, "The JSON gap, third
round").

:class:`JoinedWrites` sits between uvicorn's protocol and the event loop's transport and
hands everything written during one step of the event loop to the transport at once, at
the start of the next step: the headers and the body of a Starlette ``Response``, which
sends both without waiting in between, leave as one vectored write (``writelines``, no
copy). Nothing waits longer than the rest of the step that wrote it, and once
:data:`FLUSH_BYTES` are pending they go at once; a write that would block is buffered
by the transport exactly as before, so flow control is unchanged.

:class:`HeldBodyProtocol` shapes the other direction, a request body on its way to the
application. uvicorn's httptools protocol appends each piece the parser hands it to a
``bytearray`` (a copy), gives the application ``bytes`` of it (a second copy), and stops
reading the socket once 64 KiB wait: a large body reaches the application in pieces of
one socket read, each through every middleware's ``receive``. Here the pieces are held as
the parser made them and joined once when the application asks (not at all when one
piece waits), and the socket is read on until :data:`BODY_HIGH_WATER` bytes wait: while
the application is busy with one piece (an upload's threads writing it), the next
arrives whole.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: Pending bytes that go to the transport at once rather than at the end of the step, so
#: that a body streamed in many writes within one step meets the transport's flow
#: control (its high-water mark, 64 KiB by default) as it would without joining.
FLUSH_BYTES = 64 << 10


class JoinedWrites:
    """``transport`` with the writes of one event-loop step joined (module docstring).

    Everything not defined here goes to ``transport`` itself. ``close`` and
    ``write_eof`` send what is pending first; ``abort`` drops it, as the transport's own
    ``abort`` drops its buffer.

    >>> import asyncio
    >>> class Sink:
    ...     def __init__(self): self.calls = []
    ...     def write(self, data): self.calls.append([data])
    ...     def writelines(self, parts): self.calls.append(list(parts))
    ...     def is_closing(self): return False
    >>> async def answer(sink):
    ...     t = JoinedWrites(sink, asyncio.get_running_loop())
    ...     t.write(b"HTTP/1.1 200 OK\\r\\n\\r\\n"); t.write(b"{}")
    ...     before = list(sink.calls)
    ...     await asyncio.sleep(0)
    ...     return before, sink.calls
    >>> asyncio.run(answer(Sink()))
    ([], [[b'HTTP/1.1 200 OK\\r\\n\\r\\n', b'{}']])
    """

    __slots__ = ("_loop", "_parts", "_size", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport = transport
        self._loop = loop
        self._parts: list[bytes] | None = None
        self._size = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        parts = self._parts
        if parts is None:
            if len(data) >= FLUSH_BYTES:
                self.transport.write(data)
                return
            self._parts = [data]
            self._size = len(data)
            self._loop.call_soon(self.flush)
            return
        parts.append(data)
        self._size += len(data)
        if self._size >= FLUSH_BYTES:
            self.flush()

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Hand what is pending to the transport (a no-op when nothing is, or when the
        connection has gone meanwhile: the bytes had nowhere to go)."""
        parts, self._parts = self._parts, None
        if not parts or self.transport.is_closing():
            return
        if len(parts) == 1:
            self.transport.write(parts[0])
        else:
            self.transport.writelines(parts)

    def is_closing(self) -> bool:  # asked on every request: not through __getattr__
        return self.transport.is_closing()

    def get_write_buffer_size(self) -> int:
        pending = self._size if self._parts else 0
        return pending + self.transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self._parts = None
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class JoinedWritesProtocol:
    """Mix in before uvicorn's HTTP protocol: its responses go through
    :class:`JoinedWrites`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self.transport = JoinedWrites(self.transport, self.loop)  # type: ignore[has-type]


#: Request-body bytes a connection holds for its application before it stops reading the
#: socket (uvicorn's own limit is 64 KiB): at most this plus one read per connection.
BODY_HIGH_WATER = 1 << 20


class HeldBody:
    """A request body's pieces not yet read by the application, as uvicorn's request
    cycle holds them (its ``body``: ``+=``, ``len``, and ``bytes()`` when the application
    reads): kept as received and joined only when more than one waits.

    >>> held = HeldBody()
    >>> piece = b"x" * 10
    >>> held += piece
    >>> bytes(held) is piece, len(held)
    (True, 10)
    >>> held += b"yz"
    >>> bytes(held), len(held)
    (b'xxxxxxxxxxyz', 12)
    """

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def __iadd__(self, data: bytes) -> HeldBody:
        self.parts.append(data)
        self.size += len(data)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        parts = self.parts
        if len(parts) == 1 and type(parts[0]) is bytes:
            return parts[0]
        return b"".join(parts)


class HeldBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request body held as :class:`HeldBody` and read
    from the socket until :data:`BODY_HIGH_WATER` bytes wait (module docstring)."""

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        held = cycle.body
        if type(held) is not HeldBody:  # the bytearray the cycle starts, and restarts, with
            fresh = HeldBody()
            if held:
                fresh += bytes(held)
            held = cycle.body = fresh
        held += body
        if held.size > BODY_HIGH_WATER:
            self.flow.pause_reading()
        cycle.message_event.set()
