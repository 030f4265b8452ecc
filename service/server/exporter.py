"""The metrics listener: ``GET /metrics`` without a key, on its own address.

``/metrics`` carries every namespace's series (namespaces, model names, versions,
hold-out and live quality, traffic), so it is not served to anyone who can reach
the API: on the API's address it needs a key of the ``metrics`` scope
(:mod:`service.security.auth`), and ``welltempered serve`` also starts this
listener on ``WELLTEMPERED_METRICS_ADDRESS`` (default ``127.0.0.1:9464,9475-9483``,
loopback only; empty for none) for a scraper on the same host or on an internal
network: the first free port of 9464 and 9475-9483, so up to ten servers of a host
share the default, beside the workers' 9465-9474 (:func:`parse_ports`).

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
ten workers): the fits it ran (``fit_duration_seconds``), its array read cache, its
process; no database gauges (the API replicas export those, identical everywhere),
hence no namespace or model name. For serve and worker alike, a single port is that
port or a refusal to start, and the log says which port was taken.

The listener is a uvicorn server on its own event loop thread, with the same header
deadline as the API (:mod:`service.server.timeouts`); it answers ``GET /metrics``
only (404 elsewhere, 405 for other methods), plain text, no key.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Sequence

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


def parse_ports(text: str, setting: str) -> tuple[str, tuple[int, ...]] | None:
    """``host:ports`` as ``(host, ports)``: the ports to try, in order; None for ``""``.
    ``ports`` is a port, a range ``first-last``, or several of them joined by commas.
    Several ports let the processes of a host share one setting: each listens on the
    first of them that is free (:meth:`MetricsListener.start`); a single port is that
    port or an error. ``setting`` names the variable in the error.

    >>> parse_ports("127.0.0.1:9464,9475-9477", "X"), parse_ports("[::1]:9465", "X")
    (('127.0.0.1', (9464, 9475, 9476, 9477)), ('::1', (9465,)))
    """
    text = text.strip()
    if not text:
        return None
    host, sep, spec = text.rpartition(":")
    ports: list[int] = []
    try:
        for part in spec.split(","):
            first, dash, last = part.partition("-")
            start = parse_address(f"{host}{sep}{first}", setting)
            end = parse_address(f"{host}{sep}{last}", setting) if dash else start
            if start is None or end is None or end[1] < start[1]:
                raise ValueError(part)
            ports.extend(range(start[1], end[1] + 1))
    except ValueError:
        ports = []
    if not ports or len(set(ports)) != len(ports):
        raise ValueError(
            f"{setting} is host:port, or host:ports whose first free one is taken "
            "(127.0.0.1:9464, 127.0.0.1:9465-9474, 127.0.0.1:9464,9475-9483), or empty for "
            f"no metrics listener. Got {text!r}."
        )
    return start[0], tuple(ports)


def metrics_app(render: Render) -> Starlette:
    """The listener's application: ``GET /metrics`` is ``render()`` (run in a thread)."""

    def scrape(request: Request) -> Response:
        body, content_type = render()
        return Response(body, headers={"Content-Type": content_type})

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])])


def _bind_first_free(host: str, ports: Sequence[int]) -> socket.socket:
    """A socket bound to the first of ``ports`` that is free on ``host``; the last
    port's ``OSError`` when none is (only "address in use" moves on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for i, port in enumerate(ports):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)  # now, not when the server starts: a second binder fails here
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or i == len(ports) - 1:
                raise
    raise ValueError(f"no port to listen on. Got {ports!r}.")


class MetricsListener:
    """``GET /metrics`` on ``address`` in a thread of this process (module docstring).

    Parameters
    ----------
    address : (str, sequence of int)
        Where to listen (:func:`parse_ports`): the host, and the ports to try in order.
        Once started, :attr:`address` is ``(host, port)``, the port it got.
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
    """

    def __init__(
        self,
        address: tuple[str, Sequence[int]],
        settings: Settings,
        metrics: obs.ServiceMetrics | None = None,
        multiprocess_dir: str | None = None,
        database_gauges: bool = True,
    ):
        if (metrics is None) == (multiprocess_dir is None):
            raise ValueError(
                "give either this process's metrics or the workers' multiprocess directory. "
                f"Got metrics={metrics!r}, multiprocess_dir={multiprocess_dir!r}."
            )
        self.host, self.ports = address[0], tuple(address[1])
        self.address: tuple[str, int] | None = None
        self.settings = settings
        self.metrics = metrics
        self.multiprocess_dir = multiprocess_dir
        self.database_gauges = database_gauges
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
        """Bind the first free port of the address's ports (``OSError`` if every one is
        taken), then serve in a daemon thread."""
        host = self.host
        sock = _bind_first_free(host, self.ports)
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
