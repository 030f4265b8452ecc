"""The fleet in one run: fit throughput with 1 vs 2 workers, the latency the queue adds
to a fit, and predict requests/s through HAProxy with 1 vs 2 API replicas.

    .venv/bin/python bench/fleet.py                      # about 3 min on 2 cores
    .venv/bin/python bench/fleet.py --fits 10 --skip-lb  # quicker

Everything runs as real processes (``tests/service/servers.py``) on a fresh PostgreSQL
schema that this script creates, migrates and drops (``WELLTEMPERED_TEST_POSTGRES_URL``,
default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``), and one shared data
folder in a temporary directory.

1. Throughput: one API replica (``RUN_FITS=false``) in front; ``--fits`` matrix fits
   (``--n`` x ``--k`` logits of ``logits_data``, one data set per seed, argmax policy
   off) are submitted at once, first to 1 worker, then to 2 (each ``--concurrency 1``,
   ``fit_executor=process``, ``FIT_THREADS=1``). Span = last ``finished_at`` - first
   ``created_at`` (server clocks); the floor is the same fits back to back in this
   process (``calibrators``, one BLAS thread), no service at all.
2. Queue latency: ``--latency-fits`` temperature fits, one at a time, each submitted
   when the previous one finished, to an idle worker: enqueue -> running
   (``started_at - created_at``) and enqueue -> finished, p50/p99; the same against a
   ``serve`` on SQLite (its embedded queue, fits in its process pool), and against a
   single-node PostgreSQL ``serve`` that runs its fits itself (``RUN_FITS=true``).
3. Predict: two API replicas on 127.0.0.2/127.0.0.3, HAProxy with
   ``deploy/haproxy/haproxy.cfg`` (``tests/fleet_lb.py``) in front of 1, then 2 of them,
   and one replica directly (no balancer) as the baseline; ``--clients`` closed-loop
   asyncio clients send ``--rows`` x K JSON predicts (the body encoded once) for
   ``--seconds`` each. The client runs on the same cores: its CPU use is printed.

The load average is printed at the start and the end: on a shared machine, read the
ratios with it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.oracles import wait_for_version  # noqa: E402
from tests.service.helpers import PG_URL, logits_data, new_schema  # noqa: E402
from tests.service.servers import Server, Worker  # noqa: E402

FINISHED = ("succeeded", "failed", "cancelled")
#: The fit queue's limits, raised so that the whole batch is queued at once.
QUEUE = {"max_queued_fits_per_namespace": "256", "max_queued_fits": "512"}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def npz(z: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, logits=z.astype(np.float32), labels=y)
    return buf.getvalue()


def create_model(c: httpx.Client, name: str, k: int) -> None:
    r = c.post("/v1/models", json={"name": name, "num_classes": k, "argmax_policy": "off"})
    r.raise_for_status()


def upload(c: httpx.Client, model: str, n: int, k: int, seed: int) -> int:
    z, y = logits_data(n=n, k=k, seed=seed)
    r = c.post(
        f"/v1/models/{model}/datasets",
        content=npz(z, y),
        headers={"content-type": "application/octet-stream"},
    )
    r.raise_for_status()
    return r.json()["id"]


def submit(c: httpx.Client, model: str, ds: int, method: str, seed: int = 0) -> int:
    body = {"dataset_id": ds, "method": method, "seed": seed}
    r = c.post(f"/v1/models/{model}/calibrators", json=body)
    if r.status_code != 202:
        raise RuntimeError(f"fit not accepted: {r.status_code} {r.text}")
    return r.json()["version"]


def version(c: httpx.Client, model: str, v: int) -> dict:
    r = c.get(f"/v1/models/{model}/calibrators/{v}")
    r.raise_for_status()
    return r.json()


def wait_all(c: httpx.Client, model: str, versions: list[int], poll: float) -> list[dict]:
    """Poll the list (one request a round, so polling costs the API little) until every
    version has finished; then each version's full record."""
    want = set(versions)
    deadline = time.monotonic() + 600
    while True:
        listed = c.get(f"/v1/models/{model}/calibrators").json()["calibrators"]
        done = {x["version"] for x in listed if x["status"] in FINISHED}
        if want <= done:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"fits unfinished after 600 s: {sorted(want - done)}")
        time.sleep(poll)
    out = [version(c, model, v) for v in versions]
    bad = [(b["version"], b["status"], b["error"]) for b in out if b["status"] != "succeeded"]
    if bad:
        raise RuntimeError(f"fits did not succeed: {bad}")
    return out


def _machine_busy() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat, all CPUs)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK  # minus idle and iowait


def _our_cpu() -> float:
    """CPU seconds of this process and every live descendant (servers, workers, their
    fit pools, HAProxy); PostgreSQL's backends are not ours (the server is shared)."""
    parent, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        # utime, stime, and cutime, cstime: the reaped children's (each fit runs in a
        # process of its own, forked by the worker's forkserver, gone once it ends)
        cpu[pid] = sum(int(x) for x in fields[11:15]) / TICK
    ours, frontier = {os.getpid()}, {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - ours
        ours |= frontier
    return sum(cpu.get(p, 0.0) for p in ours)


class CpuWindow:
    """Cores in use during a window: the machine's, and ours (the rest is other jobs)."""

    def __enter__(self) -> CpuWindow:
        self.t0, self.busy0, self.ours0 = time.perf_counter(), _machine_busy(), _our_cpu()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        self.machine = (_machine_busy() - self.busy0) / wall
        self.ours = (_our_cpu() - self.ours0) / wall


TICK = os.sysconf("SC_CLK_TCK")


# -- 1. throughput --------------------------------------------------------------------


def floor_seconds(args) -> list[float]:
    """The same matrix fits back to back in this process, one BLAS thread."""
    from threadpoolctl import threadpool_limits

    from calibrators import MatrixScaler

    times = []
    with threadpool_limits(limits=1):
        for seed in range(args.fits):
            z, y = logits_data(n=args.n, k=args.k, seed=100 + seed)
            t0 = time.perf_counter()
            MatrixScaler().fit(z, y)
            times.append(time.perf_counter() - t0)
    return times


def batch(c: httpx.Client, model: str, datasets: list[int], offset: int) -> dict:
    """Submit one matrix fit per data set at once; wait for all; their span."""
    with CpuWindow() as cpu:
        t0 = time.perf_counter()
        versions = [
            submit(c, model, ds, "matrix", seed=offset + i) for i, ds in enumerate(datasets)
        ]
        submitted = time.perf_counter() - t0
        bodies = wait_all(c, model, versions, poll=0.25)
        client = time.perf_counter() - t0
    span = max(ts(b["finished_at"]) for b in bodies) - min(ts(b["created_at"]) for b in bodies)
    return {
        "fits": len(bodies),
        "span": span,
        "client": client,
        "submit": submitted,
        "fit_seconds": sum(b["fit_seconds"] or 0.0 for b in bodies),
        "workers": sorted({b["worker"] for b in bodies}),
        "attempts": max(b["attempts"] for b in bodies),
        "cpu": cpu,
    }


def throughput(db: str, data: Path, args) -> list[tuple[str, dict]]:
    rows = []
    worker_env = {"fit_executor": "process", "fit_threads": "1"}
    with (
        Server(db, data, run_fits="false", **QUEUE) as api,
        api.client() as c,
        Worker(db, data, "--concurrency", "1", **worker_env),
    ):
        create_model(c, "tp", args.k)
        datasets = [upload(c, "tp", args.n, args.k, 100 + s) for s in range(args.fits)]
        warm = wait_all(c, "tp", [submit(c, "tp", datasets[0], "matrix", 999)], poll=0.1)
        print(f"  warm-up fit on 1 worker: {warm[0]['fit_seconds']:.2f} s", flush=True)
        one = batch(c, "tp", datasets, 0)
        rows.append(("1 worker", one))
        print(f"  1 worker: span {one['span']:.2f} s", flush=True)
        with Worker(db, data, "--concurrency", "1", **worker_env):
            warm = [submit(c, "tp", datasets[i], "matrix", 990 + i) for i in range(2)]
            wait_all(c, "tp", warm, poll=0.1)
            two = batch(c, "tp", datasets, 1000)
            rows.append(("2 workers", two))
            print(f"  2 workers: span {two['span']:.2f} s", flush=True)
    return rows


def stop(w: Worker) -> None:
    """SIGTERM (an idle worker exits at once), SIGKILL if it does not."""
    try:
        w.terminate(timeout=30)
    finally:
        w.__exit__(None, None, None)


def folder(path: Path) -> Path:
    """A data folder whose parent (where tests/service/servers.py writes logs) exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# -- 2. latency -----------------------------------------------------------------------


def one_at_a_time(c: httpx.Client, model: str, ds: int, count: int) -> dict:
    queued, done, client = [], [], []
    for i in range(count):
        t0 = time.perf_counter()
        v = submit(c, model, ds, "temperature", seed=i)
        body = wait_for_version(c, model, v, timeout=math.inf, interval=0.01)
        client.append(time.perf_counter() - t0)
        if body["status"] != "succeeded":
            raise RuntimeError(f"fit {v}: {body['status']} {body['error']}")
        created = ts(body["created_at"])
        queued.append(ts(body["started_at"]) - created)
        done.append(ts(body["finished_at"]) - created)
    return {"queued": np.array(queued), "done": np.array(done), "client": np.array(client)}


def latency_case(server: Server, args, *workers: Worker) -> dict:
    with server, server.client() as c:
        for w in workers:
            w.start()
        try:
            create_model(c, "lat", 10)
            ds = upload(c, "lat", 2000, 10, 7)
            one_at_a_time(c, "lat", ds, 3)  # warm-up: pools, imports, sessions
            return one_at_a_time(c, "lat", ds, args.latency_fits)
        finally:
            for w in workers:
                stop(w)


def latency(db_admin, tmp: Path, args) -> list[tuple[str, dict]]:
    from service.storage import migrate

    rows = []
    env = {"fit_executor": "process", **QUEUE}
    with new_schema(db_admin) as db:
        migrate.upgrade(db)
        d = tmp / "lat-pg"
        d.mkdir()
        api = Server(db, d / "data", run_fits="false", **env)
        w = Worker(db, d / "data", "--concurrency", "1", fit_executor="process")
        rows.append(("PostgreSQL: API replica + 1 worker", latency_case(api, args, w)))
        print("  PostgreSQL worker done", flush=True)
    with new_schema(db_admin) as db:
        migrate.upgrade(db)
        d = tmp / "lat-pg1"
        d.mkdir()
        single = Server(db, d / "data", **env)
        rows.append(("PostgreSQL: one serve, RUN_FITS=true", latency_case(single, args)))
        print("  PostgreSQL single serve done", flush=True)
    d = tmp / "lat-sqlite"
    d.mkdir()
    lite = Server(f"sqlite:///{d / 'registry.sqlite3'}", d / "data", **env)
    rows.append(("SQLite: one serve (embedded queue)", latency_case(lite, args)))
    print("  SQLite done", flush=True)
    return rows


# -- 3. predict through the load balancer ---------------------------------------------


async def drive(base: str, model: str, args) -> dict:
    rows = np.random.default_rng(1).normal(size=(args.rows, args.k)).round(4).tolist()
    # encoded once: the client's cost per request must not grow with the rows
    body = json.dumps({"logits": rows}).encode()
    headers = {"content-type": "application/json"}
    seconds, clients = args.seconds, args.clients
    limits = httpx.Limits(
        max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=4.0
    )
    url = f"/v1/models/{model}/predict"
    lat: list[float] = []
    errors: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as c:
        for _ in range(100):  # warm-up: connections, ONNX sessions on every replica
            (await c.post(url, content=body, headers=headers)).raise_for_status()
        cpu0 = time.process_time()
        start = time.perf_counter()
        end = start + seconds

        async def loop() -> None:
            while (t0 := time.perf_counter()) < end:
                try:
                    r = await c.post(url, content=body, headers=headers)
                    if r.status_code != 200:
                        errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(loop() for _ in range(clients)))
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    ms = np.asarray(lat) * 1000
    return {
        "requests": len(lat),
        "rps": len(lat) / elapsed,
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "client_cpu": cpu / elapsed,
    }


def predict_lb(db_admin, tmp: Path, args) -> list[tuple[str, dict]]:
    from service.storage import migrate
    from tests.fleet_lb import running_haproxy

    rows = []
    with new_schema(db_admin) as db:
        migrate.upgrade(db)
        data = folder(tmp / "lb" / "data")
        # fit the calibrator with a serve that runs fits itself, then API-only replicas
        with Server(db, data, fit_executor="process") as s, s.client() as c:
            create_model(c, "p", args.k)
            ds = upload(c, "p", 2000, args.k, 11)
            v = submit(c, "p", ds, "temperature")
            wait_all(c, "p", [v], poll=0.1)
            c.put("/v1/models/p/aliases/production", json={"version": v}).raise_for_status()
        replicas = [Server(db, data, host=h, run_fits="false") for h in ("127.0.0.2", "127.0.0.3")]
        with replicas[0] as r1, replicas[1] as r2:
            cases = [
                ("1 replica, direct (no balancer)", None, [r1]),
                ("HAProxy -> 1 replica", "lb", [r1]),
                ("HAProxy -> 2 replicas", "lb", [r1, r2]),
            ]
            for name, lb, backends in cases:
                if lb is None:
                    with CpuWindow() as cpu:
                        result = asyncio.run(drive(r1.base, "p", args))
                else:
                    addrs = [(b.host, b.port) for b in backends]
                    with running_haproxy(addrs, workdir=_fresh(tmp / f"lb-{len(addrs)}")) as h:
                        h.wait_until_up(len(addrs))
                        with CpuWindow() as cpu:
                            result = asyncio.run(drive(h.base_url, "p", args))
                result["cpu"] = cpu
                rows.append((name, result))
                print(f"  {name}: {result['rps']:.0f} requests/s", flush=True)
    return rows


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# -- report ---------------------------------------------------------------------------


def report_throughput(rows: list[tuple[str, dict]], floor: list[float], args) -> None:
    total = sum(floor)
    print(
        f"\n## 1. Fit throughput: {args.fits} matrix fits of {args.n:,} x {args.k} "
        "(fit_executor=process, FIT_THREADS=1, API replica RUN_FITS=false)\n"
    )
    print(
        "| case | span s (first created -> last finished) | client s (first submit -> "
        "all seen finished) | fits/s | sum of fit_seconds | fits at once | x floor | "
        "cores busy: machine / ours |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| floor: the same fits back to back in this process, 1 BLAS thread | "
        f"{total:.2f} | - | {args.fits / total:.2f} | {total:.2f} | 1 | 1.00 | - |"
    )
    for name, r in rows:
        print(
            f"| {name} | {r['span']:.2f} | {r['client']:.2f} | {r['fits'] / r['span']:.2f} | "
            f"{r['fit_seconds']:.2f} | {r['fit_seconds'] / r['span']:.2f} | "
            f"{r['span'] / total:.2f} | {r['cpu'].machine:.2f} / {r['cpu'].ours:.2f} |"
        )
    one, two = rows[0][1], rows[1][1]
    print(
        f"\nthroughput 2 workers / 1 worker: {one['span'] / two['span']:.2f}x "
        f"(client-side {one['client'] / two['client']:.2f}x); "
        f"1 worker / floor: {one['span'] / total:.2f}x the floor's time, "
        f"{(one['span'] - total) / args.fits * 1000:.0f} ms more per fit; "
        f"submitting all {args.fits}: {one['submit']:.2f} s and {two['submit']:.2f} s; "
        f"max attempts {max(one['attempts'], two['attempts'])}; workers used "
        f"{len(one['workers'])} and {len(two['workers'])}"
    )
    print(
        "fits at once = sum of fit_seconds / span; cores busy = CPU seconds / span of the "
        "whole machine and of this script's processes (PostgreSQL's are in neither)"
    )
    print(f"floor fits (s): {' '.join(f'{t:.2f}' for t in floor)}")


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) * 1000


def report_latency(rows: list[tuple[str, dict]], args) -> None:
    print(
        f"\n## 2. Queue latency: {args.latency_fits} temperature fits (2,000 x 10), one at a "
        "time, to an idle worker (ms)\n"
    )
    print(
        "| case | enqueue -> running p50 | p99 | max | enqueue -> finished p50 | p99 | "
        "client submit -> seen finished p50 | p99 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        print(
            f"| {name} | {pct(r['queued'], 50):.1f} | {pct(r['queued'], 99):.1f} | "
            f"{r['queued'].max() * 1000:.1f} | {pct(r['done'], 50):.1f} | "
            f"{pct(r['done'], 99):.1f} | {pct(r['client'], 50):.1f} | "
            f"{pct(r['client'], 99):.1f} |"
        )
    base = rows[-1][1]
    for name, r in rows[:-1]:
        print(
            f"{name} / SQLite: enqueue -> running p50 "
            f"{np.median(r['queued']) / np.median(base['queued']):.2f}x, enqueue -> finished "
            f"p50 {np.median(r['done']) / np.median(base['done']):.2f}x"
        )
    for name, r in rows:
        print(
            f"{name}, enqueue -> running (ms): " + " ".join(f"{x * 1000:.0f}" for x in r["queued"])
        )


def report_lb(rows: list[tuple[str, dict]], args) -> None:
    print(
        f"\n## 3. Predict through HAProxy: {args.rows} x {args.k} JSON, {args.clients} closed-loop "
        f"clients, {args.seconds:g} s per case\n"
    )
    print(
        "| case | requests | requests/s | p50 ms | p99 ms | errors | client CPU (cores) | "
        "cores busy: machine / ours |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        print(
            f"| {name} | {r['requests']:,} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
            f"{r['errors']}{' ' + str(r['error_kinds']) if r['errors'] else ''} | "
            f"{r['client_cpu']:.2f} | {r['cpu'].machine:.2f} / {r['cpu'].ours:.2f} |"
        )
    direct, one, two = (r["rps"] for _, r in rows)
    print(
        f"\n2 replicas / 1 replica (through HAProxy): {two / one:.2f}x; "
        f"HAProxy -> 1 replica / direct: {one / direct:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fits", type=int, default=20, help="matrix fits per throughput batch")
    p.add_argument("--n", type=int, default=3000, help="rows of each matrix fit's data set")
    p.add_argument("--k", type=int, default=50, help="classes")
    p.add_argument("--latency-fits", type=int, default=30)
    p.add_argument("--seconds", type=float, default=10.0, help="predict traffic per case")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rows", type=int, default=100, help="rows per predict request")
    p.add_argument("--skip-lb", action="store_true", help="no predict-through-HAProxy part")
    args = p.parse_args(argv)

    from sqlalchemy import create_engine, text

    from service.storage import migrate

    print(f"load average at start: {load()}  ({os.cpu_count()} CPUs)", flush=True)
    t_start = time.perf_counter()
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar()
    print(f"PostgreSQL {pg} at {PG_URL}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="wt-fleet-") as tmp_name:
            tmp = Path(tmp_name)
            print("1. throughput", flush=True)
            floor = floor_seconds(args)
            with new_schema(admin) as db:
                migrate.upgrade(db)
                tp = throughput(db, folder(tmp / "tp" / "data"), args)
            print("2. latency", flush=True)
            lat = latency(admin, tmp, args)
            lb = None
            if not args.skip_lb:
                print("3. predict through HAProxy", flush=True)
                lb = predict_lb(admin, tmp, args)
    finally:
        admin.dispose()
    report_throughput(tp, floor, args)
    report_latency(lat, args)
    if lb is not None:
        report_lb(lb, args)
    print(f"\nwhole run {time.perf_counter() - t_start:.0f} s; load average at end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
