"""One request's answer as the service's middlewares see it: whether it has started, its
status, the bytes sent, and whether what the application sends now is dropped.

Several layers need to know these: the request metrics (status, latency to the start,
bytes for the access log), the body budget (a refusal drops the rest of the answer; the
bytes sent against the route's bound), the body timeout (the same after a 408), the
database fault middleware and the short way's last resort (a 503 or 500 only before the
answer has started). Each used to wrap ``send`` to learn them for itself: five wrappers,
each called for every message of every answer. Now the first layer that asks wraps
``send`` once (:meth:`Exchange.of`) and keeps the exchange in the ASGI scope, and the
layers inside it read the same object.
"""

from __future__ import annotations

import time

from starlette.types import Message, Scope, Send

#: Where a request's :class:`Exchange` lives in its ASGI scope.
KEY = "welltempered.exchange"


class Exchange:
    """What has been sent of one request's answer (module docstring).

    >>> import asyncio
    >>> sent = []
    >>> async def send(message):
    ...     sent.append(message["type"])
    >>> async def main():
    ...     scope = {}
    ...     exchange, send_on = Exchange.of(scope, send)
    ...     assert Exchange.of(scope, send_on) == (exchange, send_on)  # one per request
    ...     await send_on({"type": "http.response.start", "status": 413})
    ...     exchange.closed = True  # e.g. a refusal is out: the app's answer is dropped
    ...     await send_on({"type": "http.response.body", "body": b"late"})
    ...     return exchange.status, exchange.sent
    >>> asyncio.run(main()), sent
    ((413, 0), ['http.response.start'])
    """

    __slots__ = ("closed", "next", "sent", "started_at", "status")

    def __init__(self, send: Send):
        self.next = send
        #: The answer's status once it has started (0 before).
        self.status = 0
        #: ``time.perf_counter()`` when it started (0.0 before).
        self.started_at = 0.0
        #: Body bytes sent so far.
        self.sent = 0
        #: True once a layer has answered in the application's place (a 413 or 408):
        #: whatever the application sends after that is dropped.
        self.closed = False

    @property
    def started(self) -> bool:
        return self.status != 0

    @classmethod
    def of(cls, scope: Scope, send: Send) -> tuple[Exchange, Send]:
        """The request's exchange and the ``send`` to pass on: a new exchange wrapping
        ``send`` for the first layer that asks, the same one (and ``send`` unchanged)
        for every layer inside it."""
        exchange = scope.get(KEY)
        if exchange is not None:
            return exchange, send
        exchange = scope[KEY] = cls(send)
        return exchange, exchange.send

    async def send(self, message: Message) -> None:
        if self.closed:
            return
        if message["type"] == "http.response.start":
            if not self.status:
                self.status = message["status"]
                self.started_at = time.perf_counter()
        else:
            self.sent += len(message.get("body", b""))
        await self.next(message)
