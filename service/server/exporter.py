"""The metrics listener: ``GET /metrics`` without a key, on its own address.

``/metrics`` carries every namespace's series (namespaces, model names, versions,
hold-out and live quality, traffic), so it is not served to anyone who can reach
the API: on the API's address it needs a key of the ``metrics`` scope
(:mod:`service.security.auth`), and ``welltempered serve`` also starts this
listener on ``WELLTEMPERED_METRICS_ADDRESS`` (default ``127.0.0.1:9464``, loopback
only; empty for none) for a scraper on the same host or on an internal network.

Which process serves it
-----------------------
``welltempered serve`` runs it in a thread of its own process: with one worker that
is the process that also serves the API, and the listener exports its
:class:`~service.observe.metrics.ServiceMetrics`; with ``--workers N`` it is the
parent that supervises the workers (one listener for the whole server, alive as
long as it is, where N workers could not share one port), and it exports the
workers' prometheus_client multiprocess files
(:func:`~service.observe.metrics.render_multiprocess`), so every scrape adds up
all workers, as the API's ``/metrics`` in any worker does. Both export the
database gauges, read at scrape time through the listener's own small engine.

``welltempered worker`` (fits only, no API) runs one too, on
``WELLTEMPERED_WORKER_METRICS_ADDRESS`` (default ``127.0.0.1:9465-9474``: the first
free port of the range, so a worker and a serve on one host do not collide, nor up to
ten workers; a single port is that port or a refusal to start): the fits it ran
(``fit_duration_seconds``), its array read cache, its process; no database gauges
(the API replicas export those, identical everywhere), hence no namespace or model
name.

The listener is a uvicorn server on its own event loop thread, with the same header
deadline as the API (:mod:`service.server.timeouts`); it answers ``GET /metrics``
only (404 elsewhere, 405 for other methods), plain text, no key.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from service.observe import metrics as obs
from service.observe import monitoring
from service.server.timeouts import guarded_protocol
from service.settings import Settings
from service.storage.arrays import ArrayStore
from service.storage.db import APPLICATION_NAME, make_engine
from service.storage.retry import retry_read

Render = Callable[[], tuple[bytes, str]]


def parse_address(
    text: str, setting: str = "WELLTEMPERED_METRICS_ADDRESS"
) -> tuple[str, int] | None:
    """``host:port`` (``[::1]:9464`` for IPv6) as ``(host, port)``; None for ``""``.
    ``setting`` names the variable in the error.

    >>> parse_address("127.0.0.1:9464"), parse_address("[::1]:9464"), parse_address("")
    (('127.0.0.1', 9464), ('::1', 9464), None)
    """
    text = text.strip()
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{setting} is host:port (127.0.0.1:9464, [::1]:9464, "
            f"0.0.0.0:9464), or empty for no metrics listener. Got {text!r}."
        )
    return host, int(port)


def parse_port_range(
    text: str, setting: str = "WELLTEMPERED_WORKER_METRICS_ADDRESS"
) -> tuple[str, int, int] | None:
    """``host:port`` or ``host:first-last`` as ``(host, first, last)``; None for ``""``.
    A range lets several processes of a host share one setting: each listens on the
    first port of it that is free (:meth:`MetricsListener.start`).

    >>> parse_port_range("127.0.0.1:9465-9474"), parse_port_range("[::1]:9465")
    (('127.0.0.1', 9465, 9474), ('::1', 9465, 9465))
    """
    text = text.strip()
    if not text:
        return None
    host, sep, ports = text.rpartition(":")
    first, dash, last = ports.partition("-")
    try:
        parsed = parse_address(f"{host}{sep}{first}", setting)
        if dash:
            end = parse_address(f"{host}{sep}{last}", setting)
    except ValueError:
        parsed = end = None
    if parsed is None or (dash and (end is None or end[1] < parsed[1])):
        raise ValueError(
            f"{setting} is host:port or host:first-last (127.0.0.1:9465, "
            f"127.0.0.1:9465-9474: the first free port of the range), or empty for no "
            f"metrics listener. Got {text!r}."
        )
    return parsed[0], parsed[1], end[1] if dash else parsed[1]


def metrics_app(render: Render) -> Starlette:
    """The listener's application: ``GET /metrics`` is ``render()`` (run in a thread)."""

    def scrape(request: Request) -> Response:
        body, content_type = render()
        return Response(body, headers={"Content-Type": content_type})

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])])


def _bind_first_free(host: str, first: int, last: int) -> socket.socket:
    """A socket bound to the first port of ``first..last`` that is free on ``host``;
    the last port's ``OSError`` when none is (only "address in use" moves on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(first, last + 1):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)  # now, not when the server starts: a second binder fails here
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or port == last:
                raise
    raise AssertionError("unreachable: the last port raises")


class MetricsListener:
    """``GET /metrics`` on ``address`` in a thread of this process (module docstring).

    Parameters
    ----------
    address : (str, int)
        Where to listen (:func:`parse_address`): the host, and the first port to try.
    settings : Settings
        The database and the monitoring window of the database gauges, the header
        deadline.
    metrics : ServiceMetrics, optional
        This process's metrics (one worker). None: the workers' files in
        ``multiprocess_dir`` (the parent of several workers).
    multiprocess_dir : str, optional
        ``PROMETHEUS_MULTIPROC_DIR`` of the workers, when ``metrics`` is None.
    database_gauges : bool, default True
        Whether the scrape reads the database gauges (``welltempered worker``'s listener
        does not: the API replicas export them, and without them it names no tenant).
    last_port : int, optional
        With a range (:func:`parse_port_range`), the last port to try when the ones
        before it are taken; ``address`` is then where the listener got.
    """

    def __init__(
        self,
        address: tuple[str, int],
        settings: Settings,
        metrics: obs.ServiceMetrics | None = None,
        multiprocess_dir: str | None = None,
        database_gauges: bool = True,
        last_port: int | None = None,
    ):
        if (metrics is None) == (multiprocess_dir is None):
            raise ValueError(
                "give either this process's metrics or the workers' multiprocess directory. "
                f"Got metrics={metrics!r}, multiprocess_dir={multiprocess_dir!r}."
            )
        self.address = address
        self.settings = settings
        self.metrics = metrics
        self.multiprocess_dir = multiprocess_dir
        self.database_gauges = database_gauges
        self.last_port = address[1] if last_port is None else last_port
        # The read cache of this process's data folder (shared with its workers and fits).
        self.cache_usage = ArrayStore(settings.data_dir).read_cache.usage
        self.engine: Engine | None = None
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def render(self) -> tuple[bytes, str]:
        """One scrape: the process's (or workers') events and the database gauges."""
        settings, sessions = self.settings, sessionmaker(self.engine)

        def read_database() -> obs.Snapshot:
            return retry_read(
                monitoring.snapshot,
                sessions,
                settings.monitoring_window_seconds,
                settings.feedback_bucket_seconds,
                settings.worker_stalled_seconds,
            )

        snapshot = read_database if self.database_gauges else None
        if self.metrics is not None:
            return self.metrics.render(snapshot, self.cache_usage)
        return obs.render_multiprocess(self.multiprocess_dir, snapshot, self.cache_usage)

    def start(self, timeout: float = 10.0) -> None:
        """Bind the address, or the first free port up to ``last_port`` (``OSError`` if
        every one is taken), then serve in a daemon thread."""
        host, first = self.address
        sock = _bind_first_free(host, first, self.last_port)
        port = sock.getsockname()[1]
        self.address = (host, port)
        if self.database_gauges:
            self.engine = make_engine(
                self.settings.database_url, application_name=f"{APPLICATION_NAME}-metrics"
            )
        config = uvicorn.Config(
            metrics_app(self.render),
            lifespan="off",
            access_log=False,
            log_level="warning",
            http=guarded_protocol(
                self.settings.header_timeout_seconds, self.settings.http_parser
            ),
            loop=self.settings.event_loop,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [sock]},
            name="welltempered-metrics",
            daemon=True,
        )
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the metrics listener on {host}:{port} did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        if self.engine is not None:
            self.engine.dispose()
