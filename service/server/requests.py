"""Every HTTP request counted (route template, method, status class and latency) and,
when the app keeps one, written to the access log."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from service.observe import metrics as obs
from service.observe.access import AccessLog
from service.server.exchange import Exchange


class MetricsMiddleware:
    """Counts every HTTP request by route template, method and status class, with
    latency; writes its line to ``access`` (:class:`~service.observe.access.AccessLog`,
    None: no access log).

    Pure ASGI (no ``BaseHTTPMiddleware``: no extra task, no body buffering). The
    request is counted when the app is done: the route template is read from
    ``scope["route"]``, which the router sets while routing (the same dict travels down
    the stack), the status and the latency (to the moment the response started) from
    the request's :class:`~service.server.exchange.Exchange` (this layer, the outermost
    middleware, wraps ``send`` for it unless the short way already has). A request
    whose handler raised before answering (a 500 sent by Starlette's outermost error
    middleware) is counted as 500. The access line's duration runs to the answer's last
    byte.
    """

    def __init__(self, app: ASGIApp, metrics: obs.ServiceMetrics, access: AccessLog | None = None):
        self.app = app
        self.metrics = metrics
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        start = time.perf_counter()
        exchange, send = Exchange.of(scope, send)
        in_progress = metrics.http_in_progress_value  # the gauge's value (observe.metrics)
        in_progress.inc(1)
        try:
            await self.app(scope, receive, send)
        finally:
            in_progress.inc(-1)
            # A request whose handler raised before answering is counted as a 500 (the
            # short way's last resort, or Starlette's error middleware, answers it).
            status = exchange.status or 500
            started = exchange.started_at or time.perf_counter()
            metrics.observe_request(
                obs.route_template(scope), scope["method"], status, started - start
            )
            if self.access is not None:
                self.access.record(scope, status, exchange.sent, time.perf_counter() - start)
