"""A real HAProxy in front of local replicas, for the fleet tests (a helper, not a test).

:func:`haproxy_config` renders ``deploy/haproxy/haproxy.cfg``, the load balancer of
docker-compose.yml, for servers on this machine: its frontend bound to ``listen``, its
``server-template`` (Docker's DNS) replaced by one ``server`` line per backend, the
health checks faster, and a stats socket to watch and steer the servers. Everything
else (timeouts, /readyz checks, retries and which requests may be replayed) is the
deployed file's, so a test through it tests what is shipped.

:func:`running_haproxy` starts Debian's ``haproxy`` with it (``tools/ensure-promtool``
installs it) and stops it::

    with running_haproxy([("127.0.0.2", 8001), ("127.0.0.3", 8001)]) as lb:
        lb.wait_until_up(2)
        httpx.get(f"{lb.base_url}/readyz")
        lb.servers()  # {"s1": "UP", "s2": "UP"}

Several replicas may listen on the same port on distinct loopback addresses
(127.0.0.2, 127.0.0.3, ...: the whole 127.0.0.0/8 is local on Linux).
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
#: The backend of haproxy.cfg, and the prefix of the servers this module names s1, s2...
BACKEND = "welltempered"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _sub_once(pattern: str, repl: str, text: str) -> str:
    """``re.sub`` that must match: haproxy.cfg changed shape if it does not."""
    out, n = re.subn(pattern, repl, text, flags=re.M)
    if n == 0:
        raise ValueError(
            f"deploy/haproxy/haproxy.cfg has no line matching {pattern!r}: update "
            "tests/fleet_lb.py with it."
        )
    return out


def haproxy_config(
    backends: list[tuple[str, int]],
    listen: tuple[str, int],
    stats_socket: str | None = None,
    *,
    check_interval_ms: int = 200,
) -> str:
    """``deploy/haproxy/haproxy.cfg`` for ``backends`` (host, port) on this machine.

    The servers are named ``s1``, ``s2``... in the order given, checked on /readyz every
    ``check_interval_ms`` (a stopped one leaves within about two intervals), without the
    10 s slow start of the deployed file. ``stats_socket``: a UNIX socket path for the
    runtime API (``show stat``, ``set server``), admin level.
    """
    if not backends:
        raise ValueError(f"haproxy_config needs at least one backend. Got {backends!r}.")
    host, port = listen
    text = HAPROXY_CFG.read_text()
    text = _sub_once(r"^(\s+)bind :8000$", rf"\g<1>bind {host}:{port}", text)
    text = _sub_once(r"^\s+server(?:-template)? .*\n", "", text)
    if stats_socket is not None:
        text = _sub_once(
            r"^global\n", f"global\n    stats socket {stats_socket} mode 600 level admin\n", text
        )
    if not text.rstrip().splitlines()[-1].startswith("    "):
        raise ValueError("the backend is no longer the last section of haproxy.cfg")
    interval = f"{check_interval_ms}ms"
    fast = f"{max(check_interval_ms // 2, 50)}ms"
    lines = [
        f"    server s{i} {h}:{p} inter {interval} fastinter {fast} downinter {interval} "
        "slowstart 0s"
        for i, (h, p) in enumerate(backends, start=1)
    ]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


@dataclass
class RunningHaproxy:
    """A started HAProxy: its address, process, files and runtime API."""

    proc: subprocess.Popen
    listen: tuple[str, int]
    config_path: Path
    log_path: Path
    stats_socket: str

    @property
    def base_url(self) -> str:
        return f"http://{self.listen[0]}:{self.listen[1]}"

    def command(self, line: str) -> str:
        """One runtime-API command on the stats socket; its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.stats_socket)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, str]:
        """Status of every server of the backend: ``UP``, ``DOWN``, ``MAINT``, ``DRAIN``,
        or a transition such as ``UP 1/2``."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            r["svname"]: r["status"]
            for r in rows
            if r["pxname"] == BACKEND and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def set_state(self, server: str, state: str) -> None:
        """``ready``, ``drain`` (no new requests, open ones finish) or ``maint``."""
        answer = self.command(f"set server {BACKEND}/{server} state {state}")
        if answer.strip():
            raise RuntimeError(f"set server {server} state {state}: {answer.strip()}")

    def wait_until(self, want: dict[str, str], timeout: float = 15.0) -> None:
        """Wait until each named server has the wanted status."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.servers()
            if all(now.get(name) == status for name, status in want.items()):
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"HAProxy servers {now}, wanted {want}: {self.log_tail()}")
            time.sleep(0.05)

    def wait_until_up(self, count: int, timeout: float = 15.0) -> None:
        self.wait_until({f"s{i}": "UP" for i in range(1, count + 1)}, timeout)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def haproxy_binary() -> str:
    path = shutil.which("haproxy")
    if path is None:
        skip_or_fail("haproxy not installed (run tools/ensure-promtool: Debian's haproxy)")
    return path


def _listening(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=0.5):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def running_haproxy(
    backends: list[tuple[str, int]],
    listen: tuple[str, int] | None = None,
    stats_socket: str | None = None,
    *,
    check_interval_ms: int = 200,
    workdir: Path | None = None,
    start_timeout: float = 15.0,
) -> Iterator[RunningHaproxy]:
    """Run HAProxy with :func:`haproxy_config` until the block ends.

    ``listen`` defaults to a free port on 127.0.0.1, ``stats_socket`` to a socket in
    ``workdir`` (default: a temporary folder, removed afterwards, with the config and
    HAProxy's log). Returns once HAProxy accepts connections on ``listen`` (its servers
    may still be checked: :meth:`RunningHaproxy.wait_until_up`). Stopped with a soft stop
    (SIGUSR1: open requests finish), then SIGKILL after 10 s.
    """
    binary = haproxy_binary()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wt-lb-")))
        if listen is None:
            listen = ("127.0.0.1", free_port())
        if stats_socket is None:
            stats_socket = str(workdir / "haproxy.sock")
        config_path = workdir / "haproxy.cfg"
        config = haproxy_config(backends, listen, stats_socket, check_interval_ms=check_interval_ms)
        config_path.write_text(config)
        log_path = workdir / "haproxy.log"
        log = stack.enter_context(log_path.open("w"))
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(config_path)], stdout=log, stderr=subprocess.STDOUT
        )
        lb = RunningHaproxy(proc, listen, config_path, log_path, stats_socket)
        try:
            deadline = time.monotonic() + start_timeout
            while not (_listening(listen) and Path(stats_socket).exists()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"HAProxy did not start: {lb.log_tail()}")
                time.sleep(0.05)
            yield lb
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
