"""The access log: one line per HTTP request, cheap enough to keep on.

uvicorn's access log goes through :mod:`logging` for every request: a ``LogRecord``,
its formatter (which also looks for colours), the handler's lock and a write with a
flush of its own: 23.7 us of CPU per line to /dev/null on a loaded machine, against
2.0 us for this one (16,200 instructions; bench/README.md, "Serving through
http.client"). Under load, ``serve``'s default ``--log-level info`` cost about 40 us
per request (230 against 187 us of server CPU, issue 20). ``welltempered serve`` switches
uvicorn's off and writes this one instead (on unless ``ACCESS_LOG=false`` or
``--no-access-log``): the request metrics middleware
(:class:`service.server.requests.MetricsMiddleware`) calls :meth:`AccessLog.record`
once a request is answered, which appends the line's fields to a buffer; they are
formatted, one f-string a line, when the buffer is written.

The buffer goes to standard output (file descriptor 1) at most :data:`FLUSH_SECONDS`
after its first line, at once when it holds :data:`FLUSH_LINES`, and when the app shuts
down, as nginx's ``access_log ... buffer= flush=`` does: a line can show up to a second
late, and a server killed with SIGKILL loses at most its last second of lines. Each
``write`` holds whole lines and at most ``PIPE_BUF`` (4,096) bytes, so the lines of
several worker processes sharing one pipe never interleave.

A line, fields separated by one space::

    2026-12-05T06:30:00.123Z 127.0.0.1 POST /v1/models/bench/predict 200 20104 1234 default -

the time the request was answered (UTC, milliseconds), the client's address, the
method, the path as sent (without the query; bytes outside printable ASCII, spaces and
backslashes escaped as ``\\xNN``/``\\\\``, cut at :data:`MAX_PATH` characters with a
trailing ``...``), the status, the answer's body bytes, the microseconds from the
request's arrival at the app to its last byte, and the caller's namespace and key id
(``-`` when none: open routes, auth off, a request refused before its key was read).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

#: Longest wait of a line in the buffer, seconds.
FLUSH_SECONDS = 1.0
#: Buffered lines that are written at once (about 64 KiB).
FLUSH_LINES = 512
#: The most bytes of one ``write`` (POSIX's PIPE_BUF on Linux): atomic on a pipe.
WRITE_BYTES = 4096
#: Characters of a path kept in its line (an escaped byte counts as its escape).
MAX_PATH = 1024
#: Escaped paths remembered (the same few paths come again and again); past it, all
#: are forgotten at once.
PATHS_KEPT = 1024


def escape(raw: bytes) -> str:
    """``raw`` as one printable ASCII word: escapes for anything else, cut to
    :data:`MAX_PATH` characters.

    >>> escape(b"/v1/models/m/predict")
    '/v1/models/m/predict'
    >>> escape(b"/a b\\n\\xe2\\x80\\xae")
    '/a\\\\x20b\\\\n\\\\xe2\\\\x80\\\\xae'
    """
    text = raw.decode("latin-1")
    if not (text.isascii() and text.isprintable()) or " " in text or "\\" in text:
        text = text.encode("unicode_escape").decode("ascii").replace(" ", "\\x20")
    if len(text) > MAX_PATH:
        text = text[: MAX_PATH - 3] + "..."
    return text


class AccessLog:
    """Lines of the access log, buffered and written to ``fd`` (module docstring).

    Used on one event loop's thread (the app's middleware); :meth:`flush` may also be
    called where no loop runs (it writes at once).
    """

    def __init__(self, fd: int = 1, flush_seconds: float = FLUSH_SECONDS):
        self.fd = fd
        self.flush_seconds = flush_seconds
        self.lost = 0  # lines dropped because the write failed (stdout closed)
        self._lines: list[tuple] = []  # the fields of each line not written yet
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._second = -1
        self._paths: dict[bytes, str] = {}  # raw path -> its field
        self._stamp = ""

    def record(self, scope: dict[str, Any], status: int, nbytes: int, seconds: float) -> None:
        """Add the line of the request ``scope`` answered ``status`` with ``nbytes`` of
        body after ``seconds``.

        Only its fields are kept here; the lines are formatted together when they are
        written (:meth:`flush`): one line's formatting in each request was about 4 % of
        a 1 x 1,000 predict's server CPU over HTTP, the same work in a loop over many
        lines far less (bench/README.md, "Serving through http.client")."""
        state = scope.get("state")
        self._lines.append((
            time.time(), scope.get("client"), scope["method"],
            scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape"),
            status, nbytes, seconds, state.get("principal") if state else None,
        ))  # fmt: skip
        if len(self._lines) >= FLUSH_LINES:
            self.flush()
        elif self._timer is None or self._timer_loop.is_closed():  # a loop ended (tests)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to wait on: now
                self.flush()
            else:
                self._timer = loop.call_later(self.flush_seconds, self.flush)
                self._timer_loop = loop

    def flush(self) -> None:
        """Write the buffered lines now, in writes of whole lines of at most
        :data:`WRITE_BYTES` each (a longer line alone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        records, self._lines = self._lines, []
        chunk: list[str] = []
        size = 0
        for line in map(self._line, records):
            if chunk and size + len(line) > WRITE_BYTES:
                self._write("".join(chunk), len(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write("".join(chunk), len(chunk))

    def _line(self, record: tuple) -> str:
        now, client, method, raw, status, nbytes, seconds, principal = record
        second = int(now)
        if second != self._second:  # the date and time change once a second
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        path = self._paths.get(raw)
        if path is None:  # a path not seen lately: escaped once
            if len(self._paths) >= PATHS_KEPT:
                self._paths.clear()
            path = self._paths[raw] = escape(raw.partition(b"?")[0])
        if principal is None:
            caller = "- -"
        elif principal.key_id is None:
            caller = f"{principal.namespace} -"
        else:
            caller = f"{principal.namespace} {principal.key_id}"
        return (
            f"{self._stamp}.{int((now - second) * 1000):03d}Z "
            f"{client[0] if client else '-'} {method} {path} {status} "
            f"{nbytes} {round(seconds * 1e6)} {caller}\n"
        )

    def _write(self, text: str, count: int) -> None:
        data = memoryview(text.encode("ascii", "backslashreplace"))
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:  # standard output closed, a full disk: the lines are lost
            self.lost += count
