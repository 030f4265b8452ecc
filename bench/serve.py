"""Predict throughput of the service against the framework's ceiling, in one run.

    .venv/bin/python bench/serve.py [--seconds 5] [--concurrency 4]

One uvicorn process serves both the real app (``create_app``: SQLite registry,
alias lookup, validation, ONNX Runtime) and, on /bare/*, a bare FastAPI route
that parses the same body (orjson / numpy) and returns a same-size answer
without calibrating anything: the ceiling. Closed-loop clients (keep-alive
HTTP/1.1 on raw sockets, so the client is cheap) hit each in turn; the table
gives requests/s, p50/p99 latency and the ratio service/bare per case:

    JSON 1 x 1,000 | JSON 64 x 1,000 | .npy 4,096 x 1,000
"""

from __future__ import annotations

import argparse
import io
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson
from fastapi import Request, Response

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.oracles import wait_for_version  # noqa: E402

K = 1000
MODEL = "bench"


# -- server side -------------------------------------------------------------


def build_app():
    """The service plus the bare baseline routes (added here only)."""
    from service.api.app import create_app

    app = create_app()

    @app.post("/bare/json")
    async def bare_json(request: Request) -> Response:
        x = np.asarray(orjson.loads(await request.body())["logits"], dtype=np.float32)
        payload = {
            # Probability-sized numbers (|x| / 1000): the answer then has the service's
            # size in bytes; the logits themselves print ~17% shorter than probabilities.
            "probabilities": np.abs(x) * np.float32(1e-3),
            "labels": x.argmax(axis=1),
            "confidence": x.max(axis=1),
            "entropy": x.min(axis=1),
            "model": MODEL,
            "version": 1,
        }
        return Response(
            orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
            media_type="application/json",
        )

    @app.post("/bare/npy")
    async def bare_npy(request: Request) -> Response:
        x = np.load(io.BytesIO(await request.body()), allow_pickle=False)
        buf = io.BytesIO()
        np.save(buf, x.astype(np.float32, copy=False))
        return Response(buf.getvalue(), media_type="application/x-npy")

    # The ceiling is matched first: routes are tried in order.
    bare = [r for r in app.router.routes if getattr(r, "path", "").startswith("/bare/")]
    app.router.routes[:] = bare + [r for r in app.router.routes if r not in bare]
    return app


def serve(port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(), host="127.0.0.1", port=port, log_level="warning")


# -- client side -------------------------------------------------------------


def http_request(path: str, body: bytes, content_type: str, accept: str) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\n"
        f"Accept: {accept}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Connection:
    """A keep-alive HTTP/1.1 connection that sends one prepared request at a time."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def roundtrip(self, request: bytes) -> int:
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buf) < length:
            self._fill()
        self.buf = self.buf[length:]
        return status

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def load(port: int, request: bytes, seconds: float, concurrency: int) -> np.ndarray:
    """Closed loop: ``concurrency`` connections, each sends the next request on reply."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn = Connection(port)
        try:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                status = conn.roundtrip(request)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                latencies[i].append(time.perf_counter() - t0)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return np.concatenate([np.asarray(x) for x in latencies])


def setup(port: int) -> None:
    import httpx

    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    labels = rng.integers(0, K, 4000)
    logits = rng.normal(size=(4000, K)).astype(np.float32)
    logits[np.arange(4000), labels] += 4
    buf = io.BytesIO()
    np.savez(buf, logits=logits * 2, labels=labels)
    with httpx.Client(base_url=base, timeout=120) as c:
        c.post("/v1/models", json={"name": MODEL, "num_classes": K}).raise_for_status()
        r = c.post(
            f"/v1/models/{MODEL}/datasets",
            content=buf.getvalue(),
            headers={"content-type": "application/octet-stream"},
        )
        r.raise_for_status()
        r = c.post(
            f"/v1/models/{MODEL}/calibrators",
            json={"dataset_id": r.json()["id"], "method": "temperature"},
        )
        r.raise_for_status()
        version = r.json()["version"]
        body = wait_for_version(c, MODEL, version, timeout=math.inf, interval=0.1)
        if body["status"] != "succeeded":
            raise RuntimeError(f"fit {body['version']}: {body['status']} {body['error']}")
        c.put(f"/v1/models/{MODEL}/aliases/production", json={"version": version})


def cases() -> list[tuple[str, bytes, bytes]]:
    rng = np.random.default_rng(1)
    out = []
    for n in (1, 64):
        body = orjson.dumps(
            {"logits": rng.normal(size=(n, K)).astype(np.float32)},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        out.append(
            (
                f"JSON {n} x {K:,}",
                http_request(
                    f"/v1/models/{MODEL}/predict", body, "application/json", "application/json"
                ),
                http_request("/bare/json", body, "application/json", "application/json"),
            )
        )
    buf = io.BytesIO()
    np.save(buf, rng.normal(size=(4096, K)).astype(np.float32))
    body = buf.getvalue()
    npy = "application/x-npy"
    out.append(
        (
            f".npy 4,096 x {K:,}",
            http_request(f"/v1/models/{MODEL}/predict", body, npy, npy),
            http_request("/bare/npy", body, npy, npy),
        )
    )
    return out


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, target and round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternate service/bare this many times (short rounds: a noisy neighbour "
        "on the machine then hits both targets alike)",
    )
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            WELLTEMPERED_DATABASE_URL=f"sqlite:///{Path(tmp) / 'bench.sqlite3'}",
            WELLTEMPERED_DATA_DIR=str(Path(tmp) / "data"),
            WELLTEMPERED_FIT_EXECUTOR="thread",
            WELLTEMPERED_AUTH="off",  # loopback only; bench/load.py measures with a key
            WELLTEMPERED_MAX_METADATA_BYTES=str(1 << 30),  # the /bare routes take big bodies
        )
        root = Path(__file__).resolve().parents[1]
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(port)],
            env=env,
            cwd=root,
        )
        try:
            wait_ready(port, proc)
            setup(port)
            print(
                f"predict, {args.concurrency} keep-alive clients, {args.seconds:g} s x "
                f"{args.rounds} rounds per target; 'bare' = parse + same-size answer only\n"
            )
            print(
                f"{'case':<20} {'service req/s':>13} {'bare req/s':>11} {'ratio':>6}   "
                f"{'service p50/p99 ms':>19} {'bare p50/p99 ms':>16}   ratio per round"
            )
            worst = np.inf
            for name, ours, bare in cases():
                if args.only and args.only not in name:
                    continue
                load(port, ours, 1.0, args.concurrency)  # warm up
                load(port, bare, 1.0, args.concurrency)
                lat = {"ours": [], "bare": []}
                for _ in range(args.rounds):
                    lat["ours"].append(load(port, ours, args.seconds, args.concurrency))
                    lat["bare"].append(load(port, bare, args.seconds, args.concurrency))
                rate = {
                    k: sum(len(x) for x in v) / (args.seconds * args.rounds) for k, v in lat.items()
                }
                q = {k: np.quantile(np.concatenate(v), [0.5, 0.99]) * 1e3 for k, v in lat.items()}
                ratio = rate["ours"] / rate["bare"]
                per_round = [len(a) / len(b) for a, b in zip(lat["ours"], lat["bare"], strict=True)]
                worst = min(worst, ratio)
                print(
                    f"{name:<20} {rate['ours']:>13.0f} {rate['bare']:>11.0f} {ratio:>6.2f}   "
                    f"{q['ours'][0]:>9.2f}/{q['ours'][1]:<9.2f} "
                    f"{q['bare'][0]:>7.2f}/{q['bare'][1]:<8.2f}   "
                    f"{min(per_round):.2f}-{max(per_round):.2f}"
                )
            print(f"\nworst ratio {worst:.2f} (target >= 0.70; ratio = all rounds' requests)")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
