"""Slow clients: a deadline for request headers, and for request bodies an idle timeout
and a minimum rate.

uvicorn bounds only the idle time *between* requests (``timeout_keep_alive``, which
any byte resets) and nothing else: a connection that opens and sends nothing, or
sends its headers one byte a second, is held forever, and so is an upload that
trickles in while the service holds a temp file for it. Two guards, one per phase:

Headers (:class:`GuardedHttpToolsProtocol`, the protocol ``welltempered serve`` runs,
or :class:`GuardedH11Protocol` on uvicorn's pure-Python parser)
    uvicorn's protocol with one timer: from when the connection opens, or from
    the end of the previous response, the client has ``header_timeout`` seconds to
    deliver the next request's headers, however it paces them. The same deadline
    applies to the rest of a body the application answered without reading (a 401 or
    413 before the upload), which uvicorn would otherwise drain for as long as bytes
    keep coming. At the deadline a connection holding part of a request gets a 408
    and is closed; an idle one is closed silently, as uvicorn closes idle keep-alive
    connections. It never reaches the application (nothing to count or log there).

Bodies (:class:`BodyTimeoutMiddleware`, ASGI)
    Only the time the application spends *waiting* in ``receive()`` for the next
    piece of a body counts against the client; time the application spends on what
    it already has does not (uvicorn then stops reading the socket, so a client
    cannot send anyway). Each wait may last at most ``idle`` seconds, and the total
    wait may not pass ``idle + received / min_rate`` seconds (the rule of Apache's
    mod_reqtimeout ``body=20,MinRate=500``): a body trickling at 1 byte/s is
    refused after about ``idle`` seconds, however regularly its bytes come, while a
    large upload at any reasonable rate earns all the time it needs. The refusal is
    a 408 problem with ``Connection: close``; the application is told the client
    left (so it removes its temp file), and whatever it answers after that is
    dropped, as :class:`service.server.budget.BudgetMiddleware` does for a 413.

Header size (:class:`GuardedHttpToolsProtocol`)
    A request's line and headers may take at most :data:`MAX_HEAD_BYTES`; past it the
    connection gets a 431 and is closed (h11 has its own bound, 16 KiB).

A load balancer in front (HAProxy's ``timeout http-request``/``timeout client``,
``deploy/haproxy/haproxy.cfg``) does the same job before a connection reaches a
worker; these guards keep a server that is reached directly safe too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import h11
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import RequestTimeout
from service.server.exchange import Exchange
from service.server.problems import error_response
from service.server.transport import HeldBodyProtocol, JoinedWritesProtocol

log = logging.getLogger("welltempered.timeouts")

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: 36\r\n\r\n"
    b"The request headers took too long.\r\n"
)

#: The most bytes a request's line and headers may take on the httptools protocol:
#: llhttp hands them over in pieces that uvicorn and httptools join in memory, so
#: without a bound a 32 MiB header cost the server 100 MiB before any route ran.
#: Counted per read after parsing, in whole reads (one read is at most 256 KiB): a
#: bound well above any real request's headers (h11's own bound is 16 KiB).
MAX_HEAD_BYTES = 1 << 20
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: 46\r\n\r\n"
    b"The request line and headers are over 1 MiB.\r\n"
)


class Deadlines:
    """Deadlines checked by one timer every ``tick`` seconds, on ``loop``: a deadline
    that has passed is taken off and its ``on_expiry`` called.

    Both guards of this module set a deadline on nearly every request and clear it
    almost at once (the headers arrive, the body is already there). A timer armed and
    cancelled for each cost more than the check itself (bench/README.md, "The JSON gap,
    third round"): here setting one is a dict entry, and the one timer runs only while
    some deadline is set. A deadline is met to within ``tick``.

    >>> import asyncio
    >>> async def main():
    ...     loop = asyncio.get_running_loop()
    ...     deadlines, fired = Deadlines(loop, tick=0.01), []
    ...     deadlines.arm("late", loop.time(), lambda: fired.append("late"))
    ...     deadlines.arm("kept", loop.time() + 60, lambda: fired.append("kept"))
    ...     await asyncio.sleep(0.05)
    ...     return fired, deadlines.disarm("late"), deadlines.disarm("kept")
    >>> asyncio.run(main())
    (['late'], False, True)
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tick: float,
        clock: Callable[[], float] | None = None,
    ):
        self.loop = loop
        self.tick = tick
        self.clock = loop.time if clock is None else clock
        self.due: dict[Any, tuple[float, Callable[[], object]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, key: Any, at: float, on_expiry: Callable[[], object]) -> None:
        """Set ``key``'s deadline to ``at`` (:attr:`clock` seconds), replacing any."""
        self.due[key] = (at, on_expiry)
        if self._timer is None:
            self._timer = self.loop.call_later(self.tick, self._check)

    def disarm(self, key: Any) -> bool:
        """Clear ``key``'s deadline: True if it was set, False if there was none (it
        was never set, was cleared, or has expired)."""
        return self.due.pop(key, None) is not None

    def _check(self) -> None:
        now = self.clock()
        for key in [k for k, (at, _) in self.due.items() if at <= now]:
            _, on_expiry = self.due.pop(key)
            on_expiry()
        self._timer = self.loop.call_later(self.tick, self._check) if self.due else None


def _tick(timeout: float) -> float:
    """How often the deadlines of a ``timeout`` are checked: a twentieth of it, at most
    every second."""
    return min(1.0, timeout / 20)


class _HeaderDeadline:
    """The header deadline of both protocols (module docstring), over uvicorn's hooks.

    A protocol class mixes it in before uvicorn's own and says, from its parser's
    state, whether the client owes bytes nobody waits for and whether part of a
    request has arrived.
    """

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        # One set of deadlines per server: uvicorn hands every protocol of a server the
        # same ``server_state``, and a server runs on one loop.
        state, loop = self.server_state, self.loop  # type: ignore[attr-defined]
        deadlines = getattr(state, "welltempered_header_deadlines", None)
        if deadlines is None or deadlines.loop is not loop:
            deadlines = state.welltempered_header_deadlines = Deadlines(
                loop, _tick(header_timeout)
            )
        self._deadlines: Deadlines = deadlines

    # -- uvicorn's hooks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self in self._deadlines.due and not self._client_owes_bytes():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self._client_owes_bytes():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    # -- what the parser knows ---------------------------------------------------

    def _client_owes_bytes(self) -> bool:
        """The client owes bytes that no application is waiting for: the headers of its
        next request, or the rest of a body that was answered without being read."""
        raise NotImplementedError

    def _partial_request(self) -> bool:
        """Part of a request's headers has arrived (the deadline answers it a 408)."""
        raise NotImplementedError

    # -- the deadline ------------------------------------------------------------

    def _arm(self) -> None:
        deadlines = self._deadlines
        deadlines.arm(self, deadlines.clock() + self.header_timeout, self._expire)

    def _disarm(self) -> None:
        self._deadlines.disarm(self)

    def _expire(self) -> None:
        if self.transport.is_closing() or not self._client_owes_bytes():
            return
        if self._partial_request():
            self.transport.write(_REQUEST_TIMEOUT)
        log.debug(
            "closed a connection from %s: no complete request within %gs",
            self.client,
            self.header_timeout,
        )
        self.transport.close()


class GuardedH11Protocol(_HeaderDeadline, JoinedWritesProtocol, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the header deadline (module docstring).

    uvicorn builds one per connection; give it as ``http=guarded_protocol(seconds, "h11")``.
    """

    def _client_owes_bytes(self) -> bool:
        state = self.conn.their_state
        if state is h11.IDLE:  # h11 stays IDLE until a request's headers are complete
            return True
        answered = self.cycle is not None and self.cycle.response_complete
        return state is h11.SEND_BODY and answered

    def _partial_request(self) -> bool:
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])


class GuardedHttpToolsProtocol(_HeaderDeadline, JoinedWritesProtocol, HeldBodyProtocol):
    """uvicorn's protocol on httptools (llhttp, in C) with the header deadline, its
    request bodies held as :class:`~service.server.transport.HeldBodyProtocol` holds
    them: what ``welltempered serve`` runs when httptools is installed (a runtime
    dependency).

    llhttp reports where a request is through callbacks; the phase is kept from them:
    None between requests, then ``headers``, then ``body`` until the request's last byte.
    """

    _phase: str | None = None
    #: Bytes read while this request's line and headers were incomplete.
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._head_bytes < 0:  # answered 431: the rest is dropped unread
            return
        super().data_received(data)
        if self._phase == "headers":  # still incomplete once this read was parsed
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse_head()

    def _refuse_head(self) -> None:
        """431, then a lingering close: what the client still sends is dropped for a
        second (closing at once, with its bytes unread, would reset the connection
        and lose the answer)."""
        log.debug("answered 431 to %s: headers over %d bytes", self.client, MAX_HEAD_BYTES)
        self._head_bytes = -1
        self._disarm()
        self.transport.write(_HEAD_TOO_LARGE)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "headers"
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._phase = "body"
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = None
        super().on_message_complete()

    def _client_owes_bytes(self) -> bool:
        answered = self.cycle is None or self.cycle.response_complete
        if self._phase == "body":
            return answered  # a body answered without being read, or nothing
        # Between requests, the next one is owed once the last is answered; a request
        # whose headers are coming is owed whatever is running.
        return self._phase == "headers" or answered

    def _partial_request(self) -> bool:
        return self._phase == "headers"


#: The HTTP/1.1 parsers ``guarded_protocol`` knows, by uvicorn's names for them.
PROTOCOLS = {"httptools": GuardedHttpToolsProtocol, "h11": GuardedH11Protocol}


def default_parser() -> str:
    """httptools when it is installed (it parses in C), else h11 (pure Python)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def guarded_protocol(header_timeout: float, parser: str = "httptools") -> Callable[..., Any]:
    """uvicorn's ``http`` argument: the ``parser``'s protocol with this header deadline.

    A :func:`functools.partial` of a module-level class, so it pickles into the worker
    processes of ``uvicorn.run(..., workers=N)``.
    """
    return functools.partial(PROTOCOLS[parser], header_timeout=float(header_timeout))


class BodyTimeoutMiddleware:
    """408 for a request body the client sends too slowly (module docstring).

    Parameters
    ----------
    idle : float
        Longest single wait for the next piece of the body, and the grace before
        ``min_rate`` applies.
    min_rate : int
        Bytes per second the body must average over the service's waiting time
        beyond ``idle`` (0: no minimum).
    clock : callable, optional
        Seconds, monotonic (tests).
    """

    def __init__(
        self,
        app: ASGIApp,
        idle: float,
        min_rate: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.app = app
        self.idle = idle
        self.min_rate = min_rate
        self.clock = clock
        #: The deadlines of the body waits in progress (:class:`Deadlines`), on the
        #: event loop of the latest request (tests run several loops in turn).
        self.deadlines: Deadlines | None = None

    def _deadlines(self, loop: asyncio.AbstractEventLoop) -> Deadlines:
        deadlines = self.deadlines
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self.deadlines = Deadlines(loop, _tick(self.idle), self.clock)
        return deadlines

    def allowance(self, waited: float, received: int) -> float:
        """Seconds the next wait may last, given the total wait so far and bytes received.

        >>> BodyTimeoutMiddleware(None, idle=20, min_rate=500).allowance(0.0, 0)
        20.0
        >>> BodyTimeoutMiddleware(None, idle=20, min_rate=500).allowance(19.0, 1000)
        3.0
        """
        if self.min_rate <= 0:
            return float(self.idle)
        return float(min(self.idle, self.idle + received / self.min_rate - waited))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        waited = 0.0
        received = 0
        body_done = timed_out = False
        exchange, send = Exchange.of(scope, send)

        async def timed_receive() -> Message:
            nonlocal waited, received, body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:  # e.g. listening for a disconnect during the response: untimed
                return await receive()
            allowed = max(0.0, self.allowance(waited, received))
            start = self.clock()
            message: Message | None = None
            task = asyncio.current_task()
            assert task is not None  # an ASGI app runs in a task
            deadlines = self._deadlines(task.get_loop())
            deadlines.arm(task, start + allowed, task.cancel)
            try:
                message = await receive()
            except asyncio.CancelledError:
                # A deadline that expired cancelled the task: a timeout. Anyone else's
                # cancellation (the deadline still set) goes on.
                if deadlines.disarm(task) or task.uncancel() > 0:
                    raise
            finally:
                deadlines.disarm(task)
            waited += self.clock() - start
            if message is None:
                timed_out = True
                log.info(
                    "408: %s %s sent %d body bytes in %.1fs of waiting",
                    scope.get("method"),
                    scope.get("path"),
                    received,
                    waited,
                )
                if not exchange.started:
                    detail = (
                        f"The request body arrived too slowly ({received} bytes in "
                        f"{waited:.0f} s of waiting): each piece must come within "
                        f"{self.idle:g} s, and the body must average "
                        f"{self.min_rate} bytes/s after that."
                    )
                    response = error_response(
                        Request(scope), RequestTimeout(detail), headers={"Connection": "close"}
                    )
                    await response(scope, receive, send)
                # The 408 is out (or the answer had started): whatever the app sends
                # after it is dropped.
                exchange.closed = True
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        try:
            await self.app(scope, timed_receive, send)
        except Exception:
            if not timed_out:
                raise
            # The app failed on the disconnect it was told of: the 408 already answered.
