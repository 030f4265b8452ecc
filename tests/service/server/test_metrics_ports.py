"""A metrics listener given several ports takes the first free one, so several
``welltempered serve`` processes on one host share the default
WELLTEMPERED_METRICS_ADDRESS (127.0.0.1:9464,9475-9483), and several
``welltempered worker`` processes the default WELLTEMPERED_WORKER_METRICS_ADDRESS
(127.0.0.1:9465-9474); a single port is that port or exit status 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from contextlib import ExitStack

import httpx
import pytest

from service.observe.metrics import ServiceMetrics
from service.server.exporter import MetricsListener, parse_ports
from service.settings import Settings
from tests.service.servers import Server, command, free_port


def listener(tmp_path, first: int, last: int) -> MetricsListener:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'unused.db'}", data_dir=tmp_path)
    return MetricsListener(
        ("127.0.0.1", range(first, last + 1)),
        settings,
        metrics=ServiceMetrics(),
        database_gauges=False,
    )


def free_block(size: int) -> int:
    """The first of ``size`` consecutive ports that are free now (retried: another
    process may take one between the look and the use)."""
    for _ in range(50):
        first = free_port()
        if first + size > 65535:
            continue
        with ExitStack() as held:
            try:
                for port in range(first, first + size):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    pytest.fail(f"no {size} consecutive free ports on 127.0.0.1")


def occupy(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_the_first_free_port_of_the_range_is_taken_and_serves(tmp_path):
    first = free_block(3)
    with occupy(first), occupy(first + 1):
        got = listener(tmp_path, first, first + 2)
        got.start()
        try:
            assert got.address == ("127.0.0.1", first + 2)
            r = httpx.get(f"http://127.0.0.1:{first + 2}/metrics", timeout=10)
            assert r.status_code == 200 and "welltempered_" in r.text
            # a second listener on the same range finds nothing left
            with pytest.raises(OSError):
                listener(tmp_path, first, first + 2).start()
        finally:
            got.stop()


def test_two_listeners_on_one_range_get_different_ports(tmp_path):
    first = free_block(2)
    a, b = listener(tmp_path, first, first + 1), listener(tmp_path, first, first + 1)
    a.start()
    try:
        b.start()
        try:
            assert {a.address[1], b.address[1]} == {first, first + 1}
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_single_port_is_that_port_or_an_error(tmp_path):
    port = free_port()
    with occupy(port), pytest.raises(OSError):
        listener(tmp_path, port, port).start()


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("127.0.0.1:9465-9474", ("127.0.0.1", tuple(range(9465, 9475)))),
        ("127.0.0.1:9464,9475-9477", ("127.0.0.1", (9464, 9475, 9476, 9477))),
        ("0.0.0.0:9465", ("0.0.0.0", (9465,))),
        ("[::1]:9465-9466", ("::1", (9465, 9466))),
        ("[::1]:9466,9465", ("::1", (9466, 9465))),  # in the order given
        ("  ", None),
    ],
)
def test_ports_parse(text, parsed):
    assert parse_ports(text, "X") == parsed


@pytest.mark.parametrize(
    "bad",
    [
        "9465-9474",
        "host:",
        "host:9474-9465",
        "host:9465-",
        "host:-9465",
        "h:1-70000",
        "h:9464,",
        "h:,9464",
        "h:9464,9464",
        "h:9464-9466,9465",
        "h:9464;9465",
    ],
)
def test_malformed_ports_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="WELLTEMPERED_WORKER_METRICS_ADDRESS is host:port"):
        parse_ports(bad, "WELLTEMPERED_WORKER_METRICS_ADDRESS")


def test_the_default_ports_of_serve_and_worker_do_not_overlap():
    defaults = Settings(database_url="sqlite:///unused.db")
    host, serve = parse_ports(defaults.metrics_address, "WELLTEMPERED_METRICS_ADDRESS")
    worker_host, worker = parse_ports(
        defaults.worker_metrics_address, "WELLTEMPERED_WORKER_METRICS_ADDRESS"
    )
    assert host == worker_host == "127.0.0.1"  # loopback: every namespace's series
    assert serve[0] == 9464 and len(serve) == len(worker) == 10
    assert not set(serve) & set(worker)


def taken_port(server: Server) -> int:
    """The metrics port ``server`` logged as taken."""
    found = re.search(r"serve: metrics listener on 127\.0\.0\.1:(\d+) ", server.output())
    assert found, server.output()
    return int(found.group(1))


@pytest.mark.slow
@pytest.mark.process
def test_two_servers_on_one_host_take_the_first_free_ports(tmp_path):
    first = free_block(2)
    ports = f"127.0.0.1:{first},{first + 1}"
    servers = [
        Server(
            f"sqlite:///{tmp_path / name}.sqlite3",
            tmp_path / name,
            "--log-level",
            "info",
            METRICS_ADDRESS=ports,
        )
        for name in ("a", "b")
    ]
    with servers[0], servers[1]:
        got = [taken_port(s) for s in servers]
        assert got == [first, first + 1]
        for port in got:
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert r.status_code == 200 and "welltempered_" in r.text
        # a single port given explicitly is that port or exit status 2, not another
        # one; and ports that are all taken are exit status 2 too
        for address in (f"127.0.0.1:{first + 1}", ports):
            done = subprocess.run(
                [*command(), "serve", "--port", str(free_port())],
                env={
                    **os.environ,
                    "WELLTEMPERED_DATABASE_URL": f"sqlite:///{tmp_path / 'c.sqlite3'}",
                    "WELLTEMPERED_DATA_DIR": str(tmp_path / "c"),
                    "WELLTEMPERED_AUTH": "off",
                    "WELLTEMPERED_METRICS_ADDRESS": address,
                },
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
            )
            assert done.returncode == 2, done.stderr
            assert f"cannot listen for metrics on {address} " in done.stderr, done.stderr
        for server in servers:
            assert server.stop() == 0
