"""The access log (service/observe/access.py): one line per request, on by default,
buffered, off with a setting; ``welltempered serve`` writes no uvicorn access line."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.observe import access
from service.observe.access import AccessLog
from service.security.auth import Principal
from tests.service.helpers import make_settings
from tests.service.servers import Server

#: time client method path status bytes microseconds namespace key
LINE = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<client>\S+) (?P<method>[A-Z]+) "
    r"(?P<path>\S+) (?P<status>\d{1,3}) (?P<bytes>\d+) (?P<us>\d+) "
    r"(?P<namespace>\S+) (?P<key>\S+)\n"
)


def scope(path: bytes = b"/v1/models/m/predict", **extra) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": path.decode("latin-1"),
        "raw_path": path,
        "client": ("10.0.0.7", 51234),
        **extra,
    }


def lines_of(fd: int) -> list[str]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    return data.decode().splitlines(keepends=True)


@pytest.fixture
def out(tmp_path):
    fd = os.open(tmp_path / "access.log", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    yield fd
    os.close(fd)


def test_a_line_has_every_field(out):
    log = AccessLog(out)
    principal = Principal("team-a", "predict", key_id=17)
    log.record(scope(state={"principal": principal}), 200, 1234, 0.0125)
    log.flush()
    (line,) = lines_of(out)
    m = LINE.fullmatch(line)
    assert m is not None, line
    assert m["client"] == "10.0.0.7" and m["method"] == "POST"
    assert m["path"] == "/v1/models/m/predict"
    assert (m["status"], m["bytes"], m["us"]) == ("200", "1234", "12500")
    assert (m["namespace"], m["key"]) == ("team-a", "17")


def test_no_caller_no_client_and_a_query(out):
    log = AccessLog(out)
    log.record({**scope(b"/healthz?x=1"), "client": None}, 404, 0, 0.0)
    log.record(scope(state={"principal": Principal("default", "admin")}), 401, 9, 0.0)
    log.flush()
    first, second = (LINE.fullmatch(line) for line in lines_of(out))
    assert (first["client"], first["path"], first["namespace"], first["key"]) == (
        "-", "/healthz", "-", "-",
    )  # fmt: skip
    assert (second["namespace"], second["key"]) == ("default", "-")


@pytest.mark.parametrize(
    "raw",
    [b"/a b", b"/a\nb", b"/a\r\nFAKE 200", b"/\xe2\x80\xae", b"/a\\b", b"/" + b"x" * 5000],
)
def test_a_path_stays_one_printable_field(out, raw):
    """Spaces, line breaks, bidi and other bytes are escaped; a long path is cut: a
    client cannot forge a line or a field."""
    log = AccessLog(out)
    log.record(scope(raw), 200, 0, 0.0)
    log.flush()
    (line,) = lines_of(out)
    m = LINE.fullmatch(line)
    assert m is not None, line
    assert m["path"].isascii() and m["path"].isprintable()
    assert len(m["path"]) <= access.MAX_PATH
    if len(raw) < 100:  # escapes only, nothing lost
        assert m["path"].encode().decode("unicode_escape").encode("latin-1") == raw


def test_lines_wait_for_the_flush_and_go_in_whole_lines(out, monkeypatch):
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(
        access.os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data)
    )
    log = AccessLog(out, flush_seconds=60)

    async def main():
        for i in range(200):
            log.record(scope(f"/v1/models/m{i}/predict".encode()), 200, i, 0.001)
        assert lines_of(out) == [] and writes == []  # buffered until the timer or a flush
        log.flush()

    asyncio.run(main())
    lines = lines_of(out)
    assert len(lines) == 200
    assert [LINE.fullmatch(line)["bytes"] for line in lines] == [str(i) for i in range(200)]
    assert len(writes) > 1
    for data in writes:
        assert len(data) <= access.WRITE_BYTES and data.endswith(b"\n")


def test_a_full_buffer_is_written_at_once(out, monkeypatch):
    monkeypatch.setattr(access, "FLUSH_LINES", 6)
    log = AccessLog(out, flush_seconds=60)

    async def main():
        for _ in range(20):
            log.record(scope(), 200, 0, 0.0)
        return lines_of(out), log._lines

    written, pending = asyncio.run(main())
    assert len(written) == 18 and len(pending) == 2  # three full buffers written


def test_without_a_loop_a_line_goes_at_once(out):
    AccessLog(out).record(scope(), 200, 0, 0.0)
    assert len(lines_of(out)) == 1


def test_the_timer_flushes_within_its_interval(out):
    async def main():
        log = AccessLog(out, flush_seconds=0.05)
        log.record(scope(), 200, 0, 0.0)
        log.record(scope(), 200, 0, 0.0)
        assert lines_of(out) == []
        await asyncio.sleep(0.2)
        return lines_of(out)

    assert len(asyncio.run(main())) == 2


def test_a_failed_write_loses_the_lines_not_the_request(tmp_path):
    fd = os.open(tmp_path / "x", os.O_RDONLY | os.O_CREAT)
    log = AccessLog(fd)
    log.record(scope(), 200, 0, 0.0)
    log.flush()  # EBADF: not writable
    os.close(fd)
    assert log.lost == 1


def test_the_app_writes_a_line_per_request_by_default(database_url, tmp_path, capfd):
    settings = make_settings(database_url, tmp_path)
    assert settings.access_log
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        ok = c.get("/healthz")
        missing = c.get("/v1/models/nothing-here")
        refused = c.post("/v1/models", content=b"{" * 10, headers={"content-type": "text/x"})
    lines = [LINE.fullmatch(line + "\n") for line in capfd.readouterr().out.splitlines()]
    assert all(lines)
    assert [(m["method"], m["path"], m["status"]) for m in lines] == [
        ("GET", "/healthz", "200"),
        ("GET", "/v1/models/nothing-here", str(missing.status_code)),
        ("POST", "/v1/models", str(refused.status_code)),
    ]
    assert [int(m["bytes"]) for m in lines] == [
        len(r.content) for r in (ok, missing, refused)
    ]
    assert lines[1]["namespace"] == "default"  # auth off: every caller is admin of it


def test_the_setting_switches_it_off(database_url, tmp_path, capfd):
    settings = make_settings(database_url, tmp_path, access_log=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.get("/healthz").status_code == 200
    assert capfd.readouterr().out == ""


@pytest.mark.process
@pytest.mark.slow
def test_serve_writes_its_line_and_not_uvicorns(tmp_path):
    """At the default log level (info), where uvicorn would write its own access line
    too; --no-access-log leaves none."""
    database = f"sqlite:///{tmp_path / 'w.sqlite3'}"
    logs = {}
    for args in ((), ("--no-access-log",)):
        server = Server(database, tmp_path / "data", "--log-level", "info", *args)
        with server:
            with server.client() as c:
                for _ in range(3):
                    assert c.get("/healthz").status_code == 200
            assert server.stop() == 0
        logs[args] = server.output()
        server.log.unlink()
    ours = [line for line in logs[()].splitlines() if LINE.fullmatch(line + "\n")]
    # The readiness polls of the start, then the three requests.
    assert len(ours) >= 3 and all(" GET /healthz 200 " in line for line in ours[-3:])
    for output in logs.values():
        assert "HTTP/1.1" not in output, output  # uvicorn's line: '"GET /healthz HTTP/1.1" 200'
    assert not any(LINE.fullmatch(line + "\n") for line in logs[("--no-access-log",)].splitlines())


def test_the_escaped_paths_kept_are_bounded(out, monkeypatch):
    monkeypatch.setattr(access, "PATHS_KEPT", 8)
    log = AccessLog(out, flush_seconds=60)

    async def main():
        for i in range(30):
            log.record(scope(f"/p/{i}".encode()), 200, 0, 0.0)
        log.flush()

    asyncio.run(main())
    assert len(log._paths) <= 8
    assert [LINE.fullmatch(line)["path"] for line in lines_of(out)] == [
        f"/p/{i}" for i in range(30)
    ]
