"""Every HTTP request counted: route template, method, status class and latency."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.observe import metrics as obs


class MetricsMiddleware:
    """Counts every HTTP request by route template, method and status class, with latency.

    Pure ASGI (no ``BaseHTTPMiddleware``: no extra task, no body buffering). The
    route template is read from ``scope["route"]``, which the router sets while
    routing (the same dict travels down the stack), when the response starts; the
    latency is the time to that moment. A request whose handler raised (a 500 sent
    by Starlette's outermost error middleware) is counted as 500.
    """

    def __init__(self, app: ASGIApp, metrics: obs.ServiceMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        start = time.perf_counter()
        observed = False

        async def send_observed(message: Message) -> None:
            nonlocal observed
            if message["type"] == "http.response.start" and not observed:
                observed = True
                metrics.observe_request(
                    obs.route_template(scope),
                    scope["method"],
                    message["status"],
                    time.perf_counter() - start,
                )
            await send(message)

        in_progress = metrics.http_in_progress  # not track_in_progress: no generator per request
        in_progress.inc()
        try:
            await self.app(scope, receive, send_observed)
        except BaseException:
            if not observed:
                observed = True
                metrics.observe_request(
                    obs.route_template(scope), scope["method"], 500, time.perf_counter() - start
                )
            raise
        finally:
            in_progress.dec()
