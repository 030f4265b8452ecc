"""Serving speed as a plain Python client sees it: 4 threads of ``http.client`` on
keep-alive connections, JSON 1 x 1,000, ours against a bare app (issue 20).

    .venv/bin/python bench/serve_httpclient.py [--seconds 4] [--rounds 5]
        [--servers ceiling ours ours-no-access-log ours-default] [--before TREE]

bench/serve_peers.py loads every server with prepared bytes on raw sockets; here each
request goes through ``http.client``, which sends what most Python clients send
(``Host``, ``Accept-Encoding: identity``, ``Content-Length``; a ``User-Agent`` is
added) and parses the answer's headers in Python. Servers:

- **ceiling**: serve_peers.py's bare FastAPI app (orjson, ONNX Runtime, the event
  loop), its ``/v1/outputs`` route: all four outputs of our graph (probabilities,
  label, confidence, entropy) computed and answered, as ours answers them;
  ``--log-level warning``;
- **ours**: ``welltempered serve --log-level warning`` (SQLite, auth off), its access
  log on (the default);
- **ours-no-access-log**: the same with ``--no-access-log``;
- **ours-default**: ``welltempered serve`` with its default log level (info);
- with ``--before TREE`` (a checkout of another commit, e.g. ``git archive COMMIT |
  tar -x -C TREE``), **before** and **before-default**: that commit's ``serve`` at
  ``--log-level warning`` and at its default, in the same rounds.

Every server writes its standard output to a file; at the end the lines in each are
counted (the access log's lines, for ours). Each round gives every server
``--seconds`` of load in turn; the ratios (requests per second, and server CPU per
request from /proc: its process tree's user + system time) are taken per round against
the ceiling's in the same round. The load average is printed at the start and end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_peers  # the ceiling app, the calibrator, ports, CPU of a process tree

SERVERS = ("ceiling", "ours", "ours-no-access-log", "ours-default")
#: The ``welltempered serve`` arguments of each of ours.
OURS = {
    "ours": ["--log-level", "warning"],
    "ours-no-access-log": ["--log-level", "warning", "--no-access-log"],
    "ours-default": [],
}
HEADERS = {"Content-Type": "application/json", "User-Agent": "serve_httpclient/1"}


def load(port: int, path: str, body: bytes, seconds: float, threads: int) -> int:
    """Closed loop: ``threads`` keep-alive ``http.client`` connections, each sending the
    next request when its answer is read; the number of answers (all 200)."""
    counts = [0] * threads
    errors: list[BaseException] = []
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop:
                conn.request("POST", path, body, HEADERS)
                answer = conn.getresponse()
                answer.read()
                if answer.status != 200:
                    raise RuntimeError(f"HTTP {answer.status} from {path}")
                counts[i] += 1
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            conn.close()

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts)


def start_ours(
    where: Path, port: int, args: list[str], log: Path, tree: Path | None = None
) -> subprocess.Popen:
    """``welltempered serve`` on a copy of the prepared database and data folder; the
    code of ``tree`` when given."""
    env = {
        **os.environ,
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{where / 'r.sqlite3'}",
        "WELLTEMPERED_DATA_DIR": str(where / "data"),
        "WELLTEMPERED_AUTH": "off",
        "WELLTEMPERED_METRICS_ADDRESS": "",
        "OMP_NUM_THREADS": "1",
    }
    exe = Path(sys.executable).with_name("welltempered")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(exe), "serve", "--port", str(port), *args],
            env=env, cwd=where, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    serve_peers.wait_port(port, proc, f"welltempered serve {' '.join(args)}")
    return proc


def summary(values: np.ndarray) -> str:
    return f"{values.mean():.2f}x [{values.min():.2f}, {values.max():.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=SERVERS)
    parser.add_argument("--before", type=Path, help="another commit's tree, served beside")
    args = parser.parse_args()
    names = ["ceiling", *(s for s in args.servers if s != "ceiling")]
    if args.before is not None:
        names += ["before", "before-default"]

    one = np.random.default_rng(1).normal(size=(1, serve_peers.K)).astype(np.float32)
    body = json.dumps({"logits": one.tolist()}).encode()
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="wt-serve-httpclient-") as d:
        tmp = Path(d)
        try:
            base, _, onnx = serve_peers.prepare_ours(tmp / "base")
            base.terminate()
            base.wait(timeout=60)
            targets: dict[str, tuple[int, str]] = {}
            logs: dict[str, Path] = {}
            for name in names:
                port = serve_peers.free_port()
                logs[name] = tmp / f"{name}.out"
                if name == "ceiling":
                    (tmp / "ceiling.py").write_text(serve_peers.CEILING)
                    with open(logs[name], "wb") as out:
                        procs[name] = subprocess.Popen(
                            [sys.executable, "-m", "uvicorn", "ceiling:app",
                             "--port", str(port), "--log-level", "warning",
                             "--http", "httptools", "--loop", "uvloop"],
                            env={**os.environ, "MODEL_ONNX": str(onnx), "OMP_NUM_THREADS": "1"},
                            cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                        )  # fmt: skip
                    serve_peers.wait_port(port, procs[name], "ceiling")
                    targets[name] = (port, "/v1/outputs")
                else:
                    where = tmp / name
                    shutil.copytree(tmp / "base", where)
                    before = name.startswith("before")
                    procs[name] = start_ours(
                        where, port, OURS[name.replace("before", "ours")], logs[name],
                        args.before.resolve() if before else None,
                    )  # fmt: skip
                    targets[name] = (port, f"/v1/models/{serve_peers.MODEL}/predict")

            print(
                f"http.client, {args.threads} threads on keep-alive connections, JSON 1 x "
                f"1,000, {args.seconds:g} s per server and round; cpus {os.cpu_count()}, "
                f"load {os.getloadavg()[0]:.1f}"
            )
            print(f"{'server':<20} {'round':>5} {'req/s':>9} {'cpu us/req':>10}")
            for port, path in targets.values():  # warm-up: sessions, caches
                load(port, path, body, 1.0, args.threads)
            rates = {name: [] for name in names}
            cpu = {name: [] for name in names}
            for rnd in range(args.rounds):  # servers in turn: a noisy spell hits all
                for name, (port, path) in targets.items():
                    pid = procs[name].pid
                    before = serve_peers.tree_cpu_seconds(pid)
                    started = time.perf_counter()
                    n = load(port, path, body, args.seconds, args.threads)
                    elapsed = time.perf_counter() - started
                    cpu[name].append((serve_peers.tree_cpu_seconds(pid) - before) / n)
                    rates[name].append(n / elapsed)
                    print(
                        f"{name:<20} {rnd:>5} {rates[name][-1]:>9.1f} {1e6 * cpu[name][-1]:>10.1f}",
                        flush=True,
                    )
            print(f"\nper round against the ceiling, mean [min, max] over {args.rounds}:")
            print(f"{'server':<20} {'req/s ratio':>22} {'CPU/req ceiling/it':>24} "
                  f"{'cpu us/req':>11}")  # fmt: skip
            for name in names:
                speed = np.array(rates[name]) / np.array(rates["ceiling"])
                thrift = np.array(cpu["ceiling"]) / np.array(cpu[name])
                print(
                    f"{name:<20} {summary(speed):>22} {summary(thrift):>24} "
                    f"{1e6 * np.mean(cpu[name]):>11.1f}"
                )
            for proc in procs.values():
                proc.terminate()
                proc.wait(timeout=30)
            print("\nlines each server wrote to its standard output and error:")
            for name in names:
                lines = logs[name].read_bytes().splitlines()
                last = lines[-1].decode(errors="replace")[:120] if lines else ""
                print(f"{name:<20} {len(lines):>9,}   last: {last}")
            print(f"load at the end {os.getloadavg()[0]:.1f}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
