"""A metrics listener given a range of ports takes the first free one, so several
``welltempered worker`` processes on one host share the default
WELLTEMPERED_WORKER_METRICS_ADDRESS (127.0.0.1:9465-9474)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import httpx
import pytest

from service.observe.metrics import ServiceMetrics
from service.server.exporter import MetricsListener, parse_port_range
from service.settings import Settings
from tests.service.servers import free_port


def listener(tmp_path, first: int, last: int) -> MetricsListener:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'unused.db'}", data_dir=tmp_path)
    return MetricsListener(
        ("127.0.0.1", first),
        settings,
        metrics=ServiceMetrics(),
        database_gauges=False,
        last_port=last,
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
        ("127.0.0.1:9465-9474", ("127.0.0.1", 9465, 9474)),
        ("0.0.0.0:9465", ("0.0.0.0", 9465, 9465)),
        ("[::1]:9465-9466", ("::1", 9465, 9466)),
        ("  ", None),
    ],
)
def test_port_ranges_parse(text, parsed):
    assert parse_port_range(text) == parsed


@pytest.mark.parametrize(
    "bad", ["9465-9474", "host:", "host:9474-9465", "host:9465-", "host:-9465", "h:1-70000"]
)
def test_a_malformed_range_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="WELLTEMPERED_WORKER_METRICS_ADDRESS is host:port"):
        parse_port_range(bad)
