"""Slow clients against a real `welltempered serve`: headers sent one byte a second,
silent connections, uploads trickling at one byte a second (service/server/timeouts.py).

Short timeouts (2 s) keep the test short; the defaults (10 s, 20 s) only scale it.
The figures before the guards existed (every socket still held after 30 s) are in
docs/operations.md.
"""

from __future__ import annotations

import io
import re
import shutil
import socket
import subprocess
import time

import httpx
import numpy as np
import pytest

from service.server.timeouts import BodyTimeoutMiddleware
from tests.helpers import skip_or_fail
from tests.service.helpers import logits_data
from tests.service.servers import ROOT, Server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.process]

TIMEOUT = 2.0
MIN_RATE = 500
UPLOAD = "/v1/models/m/datasets"


def npz_body(n: int = 300, k: int = 4) -> bytes:
    logits, labels = logits_data(n, k)
    buf = io.BytesIO()
    np.savez(buf, logits=logits, labels=labels)
    return buf.getvalue()


def upload_head(length: int) -> bytes:
    return (
        f"POST {UPLOAD} HTTP/1.1\r\nHost: test\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except (TimeoutError, BlockingIOError):
        return data, False
    except OSError:
        return data, True


def closed_now(sock: socket.socket) -> bool:
    return read_until_closed(sock, 0.01)[1]


def start_server(tmp, parser: str):
    srv = Server(
        f"sqlite:///{tmp / 'registry.sqlite3'}",
        tmp / "data",
        HEADER_TIMEOUT_SECONDS=str(TIMEOUT),
        BODY_TIMEOUT_SECONDS=str(TIMEOUT),
        BODY_MIN_BYTES_PER_SECOND=str(MIN_RATE),
        HTTP_PARSER=parser,
    )
    with srv, srv.client() as c:
        assert c.post("/v1/models", json={"name": "m", "num_classes": 4}).status_code == 201
        yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default parser (httptools): the body guards do not depend on it."""
    yield from start_server(tmp_path_factory.mktemp("timeouts"), "httptools")


@pytest.fixture(scope="module", params=["httptools", "h11"])
def any_parser(request, server, tmp_path_factory):
    """The header deadline on each parser: it is written against each one's state."""
    if request.param == "httptools":
        yield server
    else:
        yield from start_server(tmp_path_factory.mktemp("timeouts-h11"), request.param)


def test_slow_headers_and_silent_connections_are_closed(any_parser):
    """200 connections sending their headers one byte a second and 50 silent ones are all
    closed by the header deadline (408 for those that began a request); meanwhile the
    server answers others at once."""
    server = any_parser
    request = b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Padding: " + b"a" * 100 + b"\r\n\r\n"
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]
    start = time.monotonic()
    try:
        second = 0
        while time.monotonic() - start < TIMEOUT + 3:
            for s in slow:
                try:
                    s.send(request[second : second + 1])
                except OSError:
                    pass
            with server.client(timeout=5) as c:  # the server stays responsive
                t0 = time.monotonic()
                assert c.get("/healthz").status_code == 200
                assert time.monotonic() - t0 < 1.0
            second += 1
            time.sleep(1.0)
        answers = [read_until_closed(s, 2.0) for s in slow]
        assert all(closed for _, closed in answers), "a slow-header connection is still open"
        assert all(data.startswith(b"HTTP/1.1 408 ") for data, _ in answers)
        silent_answers = [read_until_closed(s, 2.0) for s in silent]
        assert silent_answers == [(b"", True)] * len(silent)  # closed without a word
        print(f"\n250 slow or silent connections closed within {time.monotonic() - start:.1f} s")
    finally:
        for s in slow + silent:
            s.close()


def test_a_keep_alive_connection_trickling_its_next_request_is_closed(any_parser):
    server = any_parser
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        # one byte every 0.5 s keeps uvicorn's keep-alive timer (5 s) from ever firing
        for byte in b"GET /healthz HTTP/1.1\r\nHost: test\r\n":
            try:
                s.send(bytes([byte]))
            except OSError:
                break
            if closed_now(s):
                break
            time.sleep(0.5)
        assert closed_now(s) or read_until_closed(s, 2.0)[1]
        assert time.monotonic() - start < TIMEOUT + 2


def test_uploads_trickling_one_byte_a_second_get_408_and_leave_no_temp_file(server):
    """20 uploads at 1 byte/s: each is answered 408 (problem+json) and closed once the
    body idle/min-rate rule trips, and no temp file stays behind. Meanwhile the
    model's other routes answer at once: an upload holds no database connection while
    its body streams (20 of them used to take all 15 of the pool)."""
    body = npz_body()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    tmp_dir = server.data_dir / "tmp"
    start = time.monotonic()
    try:
        for s in socks:
            s.sendall(upload_head(len(body)))
        sent, received, closed = 0, [b""] * len(socks), [False] * len(socks)
        while time.monotonic() - start < TIMEOUT + 4 and not all(closed):
            for i, s in enumerate(socks):
                try:
                    s.send(body[sent : sent + 1])
                except OSError:
                    pass
                data, closed[i] = read_until_closed(s, 0.001)
                received[i] += data
            with server.client(timeout=10) as c:
                t0 = time.monotonic()
                assert c.get("/v1/models/m").status_code == 200
                assert time.monotonic() - t0 < 2.0
            sent += 1
            time.sleep(1.0)
        elapsed = time.monotonic() - start
        answers = []
        for s, before in zip(socks, received, strict=True):
            data, is_closed = read_until_closed(s, 3.0)
            answers.append((before + data, is_closed))
    finally:
        for s in socks:
            s.close()
    assert all(closed for _, closed in answers), "a trickling upload is still open"
    for data, _ in answers:
        head, _, text = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), data[:200]
        assert b"application/problem+json" in head.lower() and b"request-timeout" in text
    deadline = time.monotonic() + 5
    while list(tmp_dir.glob("*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp_dir.glob("*")) == []
    print(f"\n20 uploads at 1 byte/s answered 408 and closed within {elapsed:.1f} s")


def test_a_slow_but_steady_upload_is_accepted(server):
    """An upload at 4 KB/s, in pieces 0.5 s apart, takes longer than every timeout but
    keeps the minimum rate: it is stored."""
    body = npz_body()
    assert len(body) > 3 * 2048 * 2  # longer than TIMEOUT at this pace
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(upload_head(len(body)))
        start = time.monotonic()
        for i in range(0, len(body), 2048):
            s.sendall(body[i : i + 2048])
            time.sleep(0.5)
        assert time.monotonic() - start > TIMEOUT
        data, _ = read_until_closed(s, 10.0)
    assert data.startswith(b"HTTP/1.1 201 "), data[:300]


def test_the_body_rule_counts_only_the_time_spent_waiting():
    """Unit check of the rule on a fake clock: the app's own work between reads is free;
    waiting is allowed ``idle`` at most per read and ``idle + bytes / rate`` in all."""
    rule = BodyTimeoutMiddleware(None, idle=20, min_rate=500)
    assert rule.allowance(0.0, 0) == 20
    assert rule.allowance(30.0, 10_000) == 10  # 20 + 10000/500 - 30
    assert rule.allowance(40.0, 10_000) == 0  # out of time: the next wait times out
    assert BodyTimeoutMiddleware(None, idle=20, min_rate=0).allowance(1e6, 0) == 20


def haproxy_binary() -> str:
    path = shutil.which("haproxy")
    if path is None:
        skip_or_fail("haproxy not installed (tools/ensure-promtool installs Debian's)")
    return path


def test_haproxy_in_front_closes_slow_headers_before_the_service(tmp_path):
    """deploy/haproxy/haproxy.cfg (its timeouts shortened to 2 s, its replicas replaced
    by one real server whose own header deadline is 60 s): HAProxy answers the slow
    clients 408 and closes them; ordinary requests pass; /metrics does not."""
    binary = haproxy_binary()
    srv = Server(
        f"sqlite:///{tmp_path / 'registry.sqlite3'}", tmp_path / "data", HEADER_TIMEOUT_SECONDS="60"
    )
    config = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    config = re.sub(r"timeout http-request \S+", f"timeout http-request {TIMEOUT:g}s", config)
    config = re.sub(r"(?m)^\s+server .*\n", "", config)
    with srv:
        # Chosen while the server listens: before, the kernel could hand out the port the
        # server was about to take, and the checks below then reached it, not HAProxy.
        config = config.replace("    bind :8000", f"    bind 127.0.0.1:{(port := free_port())}")
        config += f"    server api-1 127.0.0.1:{srv.port}\n"
        (tmp_path / "haproxy.cfg").write_text(config)
        log = (tmp_path / "haproxy.log").open("w")
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=log, stderr=log
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "haproxy.log"
                ).read_text()
                time.sleep(0.2)
            assert httpx.get(f"{base}/metrics").status_code == 404
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
            start = time.monotonic()
            try:
                for second in range(int(TIMEOUT) + 2):
                    for s in socks:
                        try:
                            s.send(b"GET /healthz HTTP/1.1\r\n"[second : second + 1])
                        except OSError:
                            pass
                    time.sleep(1.0)
                answers = [read_until_closed(s, 3.0) for s in socks]
            finally:
                for s in socks:
                    s.close()
            assert all(closed for _, closed in answers)
            assert all(data.startswith(b"HTTP/1.1 408") for data, _ in answers), answers[0]
            assert time.monotonic() - start < TIMEOUT + 6
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
