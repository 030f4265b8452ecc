"""Slow clients and killed database connections against a real `welltempered serve`.

    .venv/bin/python bench/faults.py slow [--seconds 31]
    .venv/bin/python bench/faults.py kill [--seconds 30] [--interval 0.5] [--workers 1]

``slow``: 200 connections send a request's headers one byte a second, 20 uploads
send their body one byte a second; prints how many of each the server still holds
open, and the temp files it keeps, every few seconds (default timeouts, SQLite).

``kill``: a loop alternating ``GET .../calibrators/1`` and ``POST .../feedback``
(with an Idempotency-Key) while a thread runs ``pg_terminate_backend`` on every
connection of the server (its ``application_name``) every ``--interval`` seconds;
prints the answers by route and status. PostgreSQL from WELLTEMPERED_TEST_POSTGRES_URL.

Settings the code does not know are ignored, so the same script measures older
commits (run it from a checkout of that commit, with this file copied in).
Results: bench/README.md#slow-clients-and-database-faults.
"""

from __future__ import annotations

import argparse
import collections
import math
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, text

from service.storage import migrate
from tests.oracles import wait_for_version
from tests.service.helpers import PG_URL, logits_data, new_schema
from tests.service.servers import Server


def open_count(socks: list[socket.socket]) -> int:
    """Connections the server has not closed (what it sent is read and dropped)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        closed = False
        try:
            while True:
                if s.recv(65536) == b"":
                    closed = True
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed = True
        finally:
            s.setblocking(True)
        n += not closed
    return n


def slow(args) -> None:
    tmp = Path(tempfile.mkdtemp())
    with Server(f"sqlite:///{tmp / 'r.sqlite3'}", tmp / "data") as srv, srv.client() as c:
        assert c.post("/v1/models", json={"name": "m", "num_classes": 3}).status_code == 201
        headers = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(200)]
        uploads = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
        for s in uploads:
            s.sendall(
                b"POST /v1/models/m/datasets HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n"
            )
        line = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200
        start = time.monotonic()
        for second in range(args.seconds + 1):
            for s in headers:
                try:
                    s.send(line[second % len(line) : second % len(line) + 1])
                except OSError:
                    pass
            for s in uploads:
                try:
                    s.send(b"\0")
                except OSError:
                    pass
            time.sleep(1)
            if second % 5 == 0 or second == args.seconds:
                temp = list((tmp / "data" / "tmp").glob("*"))
                print(
                    f"t={time.monotonic() - start:4.0f}s  slow headers open "
                    f"{open_count(headers)}/200  uploads open {open_count(uploads)}/20  "
                    f"temp files {len(temp)}",
                    flush=True,
                )


def kill(args) -> None:
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"wt-bench-{uuid.uuid4().hex[:8]}"
    with new_schema(admin) as url:
        migrate.upgrade(url)
        tmp = Path(tempfile.mkdtemp())
        server = Server(f"{url}&application_name={name}", tmp / "data", "--workers", args.workers)
        with server, server.client() as c:
            m = "/v1/models/m"
            assert c.post("/v1/models", json={"name": "m", "num_classes": 3}).status_code == 201
            z, y = logits_data(300, 3)
            d = c.post(f"{m}/datasets", json={"logits": z.tolist(), "labels": y.tolist()}).json()
            c.post(f"{m}/calibrators", json={"dataset_id": d["id"], "method": "temperature"})
            body = wait_for_version(c, "m", 1, timeout=math.inf, interval=0.1)
            assert body["status"] == "succeeded", body
            assert c.put(f"{m}/aliases/production", json={"version": 1}).status_code == 200
            stop, kills = threading.Event(), [0]

            def killer():
                with admin.connect() as conn:
                    while not stop.is_set():
                        kills[0] += conn.execute(
                            text(
                                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                                "AND application_name = :name"
                            ),
                            {"name": name},
                        ).scalar()
                        stop.wait(args.interval)

            thread = threading.Thread(target=killer)
            thread.start()
            counts: collections.Counter = collections.Counter()
            body = {"logits": z[:20].tolist(), "labels": y[:20].tolist()}
            start, i = time.monotonic(), 0
            try:
                while time.monotonic() - start < args.seconds:
                    i += 1
                    if i % 2:
                        r, route = c.get(f"{m}/calibrators/1"), "GET calibrators"
                    else:
                        key = {"Idempotency-Key": f"k{i}"}
                        r, route = c.post(f"{m}/feedback", json=body, headers=key), "POST feedback"
                    counts[route, r.status_code] += 1
            finally:
                stop.set()
                thread.join()
    admin.dispose()
    print(
        f"{sum(counts.values())} requests in {args.seconds} s, {kills[0]} connections killed "
        f"(every {args.interval} s, {args.workers} worker(s))"
    )
    for (route, status), n in sorted(counts.items()):
        print(f"  {route:16} {status}  {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("slow")
    p.add_argument("--seconds", type=int, default=31)
    p = sub.add_parser("kill")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--workers", default="1")
    args = parser.parse_args()
    {"slow": slow, "kill": kill}[args.what](args)


if __name__ == "__main__":
    main()
