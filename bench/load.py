"""Hold predict traffic on a server for a while; report throughput, latency, errors, memory.

    .venv/bin/python bench/load.py [--seconds 60] [--concurrency 16] [--rows 1] [--workers 1]
    .venv/bin/python bench/load.py --url http://host:8000 --key wt_... --model m

Without ``--url`` it starts its own ``welltempered serve`` (temporary SQLite,
auth ON: the key comes from ``welltempered keys create``, so every request
pays the real auth check), registers a K=10 model, fits temperature scaling
and aliases it. Then ``--concurrency`` asyncio tasks (one httpx.AsyncClient,
keep-alive) send JSON predicts of ``--rows`` rows in a closed loop for
``--seconds``. Printed: requests/s, p50/p99/max latency, errors (non-200 or
transport errors), and the server's RSS (the serve process and its
children) after warm-up, every 10 s, and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.oracles import wait_for_version  # noqa: E402

K = 10


def _descendants(pid: int) -> list[int]:
    """Every process whose ancestry leads to ``pid`` (from /proc/<n>/stat)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _vmrss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes(pid: int) -> tuple[int, int]:
    """(RSS of ``pid``, RSS of ``pid`` and all its descendants: fit workers, uvicorn
    workers); psutil if installed, else /proc/<pid>/status VmRSS."""
    try:
        import psutil
    except ImportError:
        own = _vmrss(pid)
        return own, own + sum(_vmrss(p) for p in _descendants(pid))
    proc = psutil.Process(pid)
    own = proc.memory_info().rss
    return own, own + sum(p.memory_info().rss for p in proc.children(recursive=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, workers: int) -> tuple[subprocess.Popen, str, str]:
    exe = Path(sys.executable).with_name("welltempered")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]
    env = {
        **os.environ,
        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{tmp / 'load.sqlite3'}",
        "WELLTEMPERED_DATA_DIR": str(tmp / "data"),
        "WELLTEMPERED_AUTH": "on",
        "WELLTEMPERED_METRICS_ADDRESS": "",  # no metrics listener: its port may be taken
    }
    # the key, exactly as an operator gets it: the last line of `keys create`
    out = subprocess.run(
        [*cmd, "keys", "create", "--namespace", "load", "--scope", "write"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    key = out.stdout.strip().splitlines()[-1]
    port = free_port()
    proc = subprocess.Popen(
        [*cmd, "serve", "--port", str(port), "--workers", str(workers), "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return proc, base, key
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"load: the server did not start (exit {proc.poll()})")
        time.sleep(0.2)


def prepare(base: str, key: str, model: str) -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, K, 2000)
    logits = rng.normal(size=(2000, K))
    logits[np.arange(2000), labels] += 2.0
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        c.post("/v1/models", json={"name": model, "num_classes": K}).raise_for_status()
        body = {"logits": (logits * 3).tolist(), "labels": labels.tolist()}
        ds = c.post(f"/v1/models/{model}/datasets", json=body).json()["id"]
        fit = {"dataset_id": ds, "method": "temperature"}
        v = c.post(f"/v1/models/{model}/calibrators", json=fit).json()["version"]
        body = wait_for_version(c, model, v, timeout=math.inf, interval=0.1)
        if body["status"] != "succeeded":
            raise RuntimeError(f"fit {body['version']}: {body['status']} {body['error']}")
        c.put(f"/v1/models/{model}/aliases/production", json={"version": v}).raise_for_status()


async def drive(base: str, key: str, model: str, args, pid: int | None) -> dict:
    rows = np.random.default_rng(1).normal(size=(args.rows, K)).round(4).tolist()
    payload = {"logits": rows}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    # keepalive_expiry below uvicorn's timeout_keep_alive (5 s): otherwise a connection
    # idle in the pool may be reused just as the server closes it (a client-side ReadError)
    limits = httpx.Limits(
        max_connections=args.concurrency,
        max_keepalive_connections=args.concurrency,
        keepalive_expiry=4.0,
    )
    headers = {"Authorization": f"Bearer {key}"}
    url = f"/v1/models/{model}/predict"
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=30) as c:
        for _ in range(50):  # warm-up: connections, ONNX session, caches
            (await c.post(url, json=payload)).raise_for_status()
        rss = [(0.0, rss_bytes(pid))] if pid else []
        start = time.perf_counter()
        end = start + args.seconds

        async def worker() -> None:
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    return
                try:
                    r = await c.post(url, json=payload)
                    if r.status_code != 200:
                        errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                except httpx.HTTPError as exc:
                    name = type(exc).__name__
                    errors[name] = errors.get(name, 0) + 1
                latencies.append(time.perf_counter() - t0)

        async def sample() -> None:
            while pid and end - time.perf_counter() > 10:
                await asyncio.sleep(10)
                rss.append((time.perf_counter() - start, rss_bytes(pid)))

        await asyncio.gather(sample(), *(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    if pid:
        rss.append((elapsed, rss_bytes(pid)))
    lat = np.asarray(latencies) * 1000
    return {
        "seconds": elapsed,
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "max_ms": float(lat.max()),
        "errors": errors,
        "rss": rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rows", type=int, default=1, help="rows per predict request")
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers of the own server")
    p.add_argument("--url", help="an existing server (then --key and --model)")
    p.add_argument("--key")
    p.add_argument("--model", default="load")
    args = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory(prefix="wt-load-") as tmp:
        try:
            if args.url:
                base, key, pid = args.url.rstrip("/"), args.key or "", None
            else:
                proc, base, key = start_server(Path(tmp), args.workers)
                prepare(base, key, args.model)
                pid = proc.pid
            result = asyncio.run(drive(base, key, args.model, args, pid))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=60)
                print(f"server stopped with SIGTERM: exit status {code}")
    print(
        f"predict, {args.rows} x {K} JSON, {args.concurrency} concurrent clients, "
        f"{result['seconds']:.0f} s: {result['requests']} requests, "
        f"{result['rps']:.0f} requests/s, p50 {result['p50_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.0f} ms, "
        f"errors {sum(result['errors'].values())} {result['errors'] or ''}"
    )
    if result["rss"]:
        for i, what in enumerate(("serve process", "serve process and children")):
            trail = ", ".join(f"{t:.0f}s {b[i] / 2**20:.1f}" for t, b in result["rss"])
            first, last = result["rss"][0][1][i], result["rss"][-1][1][i]
            print(f"RSS of the {what} (MiB): {trail}; end - start {(last - first) / 2**20:+.1f}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
