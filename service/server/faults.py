"""Database faults during a request: reads replayed once, everything else a 503 problem.

:class:`DatabaseFaultMiddleware` runs every request inside a write log
(:func:`service.storage.retry.recording`). When a transient database error
(:func:`service.storage.retry.is_transient`: a dropped or refused connection, a
deadlock, a full pool) escapes the application before its response has started:

- a ``GET``, ``HEAD`` or ``OPTIONS`` request that committed nothing is run once more,
  from the start, on fresh connections (its body, if any, replayed);
- anything else, or a read that fails again, is answered 503 ``database-unavailable``
  with ``Retry-After`` and ``applied``: ``"no"`` (nothing was committed: retry),
  ``"yes"`` (committed before the failure: read the resource, do not repeat it) or
  ``"unknown"`` (the connection failed during the ``COMMIT``: retry with the same
  ``Idempotency-Key``, where the route takes one, so it is not applied twice).

The driver's message (host names, SQL) goes to the log, never to the caller. Errors
that are not transient still reach the 500 handler of :mod:`service.server.problems`:
they are bugs.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import DatabaseUnavailable
from service.server.exchange import Exchange
from service.server.problems import error_response
from service.storage import retry

log = logging.getLogger("welltempered.database")

#: Methods whose requests are replayed after a transient failure (they write nothing).
REPLAYED_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

_DETAIL = {
    "no": "The database connection failed before anything was written: nothing of this "
    "request was applied. Retry it.",
    "yes": "The change was committed, but the database connection failed before the "
    "answer was complete: read the resource to see it rather than repeating the change.",
    "unknown": "The database connection failed while the change was being committed: it "
    "may or may not have been applied. Retry with the same Idempotency-Key where the "
    "route takes one (feedback, dataset uploads, fits, imports); otherwise read the "
    "resource before repeating the change.",
}


def unavailable(applied: str) -> DatabaseUnavailable:
    """The domain error of a database fault whose writes were ``applied``."""
    return DatabaseUnavailable(
        _DETAIL[applied], applied=applied, retry_after=retry.RETRY_AFTER_SECONDS
    )


class DatabaseFaultMiddleware:
    """Replay a read once, or answer 503 with ``applied``, after a transient database
    error (module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange, send = Exchange.of(scope, send)
        attempts = 2 if scope.get("method") in REPLAYED_METHODS else 1
        # The request's messages, replayed to a second attempt; kept only when there can
        # be one (never for a POST: its body would be held twice, tests/security).
        seen: list[Message] | None = [] if attempts > 1 else None
        for attempt in range(1, attempts + 1):
            applied = await self._attempt(scope, receive, send, exchange, seen, attempt)
            if applied is None:
                return
            if applied != "no" or attempt == attempts:
                response = error_response(Request(scope), unavailable(applied))
                await response(scope, receive, send)
                return

    async def _attempt(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        exchange: Exchange,
        seen: list[Message] | None,
        attempt: int,
    ) -> str | None:
        """Run the app once: None when it answered, else what its writes came to."""
        if seen is None:  # nothing to replay or keep (a POST): its own receive, unwrapped
            app_receive = receive
        else:
            replay = list(seen)

            async def app_receive() -> Message:
                if replay:
                    return replay.pop(0)
                message = await receive()
                if message["type"] == "http.request":
                    seen.append(message)
                return message

        with retry.recording() as writes:
            try:
                await self.app(scope, app_receive, send)
                return None
            except Exception as exc:
                if exchange.started or not retry.is_transient(exc):
                    raise
                applied = writes.applied()
                log.warning(
                    "%s %s: database fault (%s), applied=%s, attempt %d",
                    scope.get("method"),
                    scope.get("path"),
                    type(exc).__name__,
                    applied,
                    attempt,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                return applied
