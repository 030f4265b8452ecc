"""Every HTTP request counted (route template, method, status class and latency) and,
when the app keeps one, written to the access log."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.observe import metrics as obs
from service.observe.access import AccessLog


class MetricsMiddleware:
    """Counts every HTTP request by route template, method and status class, with
    latency; writes its line to ``access`` (:class:`~service.observe.access.AccessLog`,
    None: no access log).

    Pure ASGI (no ``BaseHTTPMiddleware``: no extra task, no body buffering). The
    route template is read from ``scope["route"]``, which the router sets while
    routing (the same dict travels down the stack), when the response starts; the
    latency is the time to that moment. A request whose handler raised (a 500 sent
    by Starlette's outermost error middleware) is counted as 500. The access line is
    written when the app is done: its duration runs to the answer's last byte.
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
        access = self.access
        start = time.perf_counter()
        status = 0  # the answer's, once it starts
        sent = 0  # its body bytes (counted for the access log only)

        async def send_observed(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                if not status:
                    status = message["status"]
                    metrics.observe_request(
                        obs.route_template(scope),
                        scope["method"],
                        status,
                        time.perf_counter() - start,
                    )
            elif access is not None:
                sent += len(message.get("body", b""))
            await send(message)

        in_progress = metrics.http_in_progress_value  # the gauge's value (observe.metrics)
        in_progress.inc(1)
        try:
            await self.app(scope, receive, send_observed)
        except BaseException:
            if not status:
                status = 500
                metrics.observe_request(
                    obs.route_template(scope), scope["method"], 500, time.perf_counter() - start
                )
            raise
        finally:
            in_progress.inc(-1)
            if access is not None:
                access.record(scope, status, sent, time.perf_counter() - start)
