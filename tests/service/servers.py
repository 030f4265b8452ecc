"""Real `welltempered serve` processes for the crash, shutdown and load tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from service.server.timeouts import guarded_protocol

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def protocol_server(
    answer: bytes, header_timeout: float = 10.0
) -> Iterator[tuple[int, threading.Thread]]:
    """uvicorn with ``welltempered serve``'s HTTP protocol (httptools, its header
    deadline, its joined writes) in a thread of this process, on asyncio's loop (which
    tests can patch), answering ``GET /`` with ``answer`` as text: its port and thread."""

    async def endpoint(request):
        return Response(answer, media_type="text/plain")

    config = uvicorn.Config(
        Starlette(routes=[Route("/", endpoint)]),
        http=guarded_protocol(header_timeout, "httptools"),
        loop="asyncio",
        lifespan="off",
        log_level="warning",
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise AssertionError("the in-thread server did not start")
            thread.join(0.01)
        yield sock.getsockname()[1], thread
    finally:
        server.should_exit = True
        thread.join(10)


def command() -> list[str]:
    exe = Path(sys.executable).with_name("welltempered")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]


class ProcessGroup:
    """A process started with ``start_new_session``: it and its children (fit
    processes, uvicorn workers) are one process group, killed together."""

    proc: subprocess.Popen | None = None

    def kill9(self) -> None:
        """SIGKILL to the whole process group."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        self._kill_group()

    def _kill_group(self) -> None:
        """SIGKILL to the group, whether or not its leader is still alive (a uvicorn
        worker or a fit process may outlive it)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def _failed(self, message: str) -> AssertionError:
        """The error of a start that failed, once the group is gone: ``with`` calls no
        ``__exit__`` when ``__enter__`` raises, so nothing else would kill it."""
        self._kill_group()
        return AssertionError(message)


class Server(ProcessGroup):
    """``welltempered serve`` in its own process group (so kill -9 takes its fit workers too)."""

    def __init__(
        self, database_url: str, data_dir: Path, *args: str, host: str = "127.0.0.1", **env: str
    ):
        self.database_url = database_url
        self.data_dir = data_dir
        self.args = args
        self.env = env
        self.host = host
        self.port = free_port()
        self.base = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"serve-{host}-{self.port}.log"

    def start(self, timeout: float = 90) -> Server:
        cmd = command()
        env = {
            **os.environ,
            "WELLTEMPERED_DATABASE_URL": self.database_url,
            "WELLTEMPERED_DATA_DIR": str(self.data_dir),
            "WELLTEMPERED_AUTH": "off",
            "WELLTEMPERED_FIT_THREADS": "1",
            # No metrics listener unless a test asks (a fixed port would clash between
            # servers); tests/security/test_metrics_exposure.py gives it a free port.
            "WELLTEMPERED_METRICS_ADDRESS": "",
            **{f"WELLTEMPERED_{k.upper()}": str(v) for k, v in self.env.items()},
        }
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [
                *cmd,
                "serve",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *self.args,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise self._failed(f"serve exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise self._failed(f"serve did not become ready:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-5000:] if self.log.exists() else ""

    def client(self, **kwargs) -> httpx.Client:
        # No keep-alive: a connection the server closes as idle (uvicorn's 5 s) while a
        # request is being sent would be a client-side flake, not a server failure.
        limits = httpx.Limits(max_keepalive_connections=0)
        return httpx.Client(
            base_url=self.base, timeout=kwargs.pop("timeout", 60), limits=limits, **kwargs
        )

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise

    def __enter__(self) -> Server:
        return self.start()


class Worker(ProcessGroup):
    """``welltempered worker`` in its own process group: ready once its log says it
    started (it registered with the job engine). ``env``: ``WELLTEMPERED_*`` settings by
    lower-case name; ``environ``: other variables as they are."""

    def __init__(
        self,
        database_url: str,
        data_dir: Path,
        *args: str,
        environ: dict[str, str] | None = None,
        **env: str,
    ):
        self.database_url = database_url
        self.data_dir = data_dir
        self.args = args
        self.env = env
        self.environ = environ or {}
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"worker-{id(self)}.log"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 60) -> Worker:
        env = {
            **os.environ,
            "WELLTEMPERED_DATABASE_URL": self.database_url,
            "WELLTEMPERED_DATA_DIR": str(self.data_dir),
            "WELLTEMPERED_FIT_THREADS": "1",
            # No metrics listener unless a test asks (a fixed port would clash between
            # workers, and with other test runs on the machine).
            "WELLTEMPERED_WORKER_METRICS_ADDRESS": "",
            **self.environ,
            **{f"WELLTEMPERED_{k.upper()}": str(v) for k, v in self.env.items()},
        }
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [*command(), "worker", "--log-level", "info", *self.args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout
        while "Starting worker" not in self.output():
            if self.proc.poll() is not None:
                raise self._failed(f"worker exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise self._failed(f"worker did not start:\n{self.output()}")
            time.sleep(0.1)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-8000:] if self.log.exists() else ""

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> Worker:
        return self.start()
