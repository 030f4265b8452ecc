"""Instructions per request over HTTP: ours against the ceiling of bench/serve_peers.py,
counted by valgrind's callgrind, so the figure does not move with the machine's load.

    .venv/bin/python bench/serve_instructions.py [--requests 800] [--repeat 1]
        [--client raw|httpclient] [--ceiling-path /v1/json|/v1/outputs]
        [--switch-off body-timeout body-limit db-faults metrics prediction-metrics ...]

Each server (the ceiling app, and ``welltempered serve`` on SQLite with auth off, the
same temperature calibrator as serve_peers.py) runs under ``valgrind --tool=callgrind
--instr-atstart=no``. After 300 warm-up requests, one keep-alive client sends
``--requests`` JSON 1 x 1,000 predicts with instrumentation switched on. The server
switches it on and off itself, on SIGUSR1 and SIGUSR2, through callgrind's client
requests: a small C library, compiled here with gcc and valgrind's headers.

Only the requests' work is counted. What a server does while idle (uvicorn's tick every
0.1 s, pollers) runs by the wall clock, and under callgrind the counted requests take
about a minute: before them, the same server is counted idle for ``--idle`` seconds,
and that rate times the requests' window is taken off. Ours trusts its cached alias
for an hour (``ALIAS_CACHE_SECONDS``): renewed every second by default, at callgrind's
pace that would add a database query every 20 requests, at full speed one per
thousand.

``--client httpclient`` sends the headers Python's ``http.client`` sends (``Host``,
``Accept-Encoding: identity``, ``Content-Length``, ``Content-Type`` and the
``User-Agent`` of bench/serve_httpclient.py) instead of the three of bench/serve.py's
client; ``--ceiling-path /v1/outputs`` measures the ceiling route that computes and
answers all four of our outputs (bench/serve_httpclient.py's ceiling).

Only user-space instructions are counted: the kernel's share (send, receive, epoll)
is not, and instructions are not time. The same code measured twice differs by about
1%. ``--switch-off`` runs extra copies of ours, each with one layer replaced by a
pass-through, to estimate what that layer costs.

Needs valgrind (Debian's package; its headers are included) and gcc. A server under
callgrind runs about 50 times slower: each server takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_httpclient  # its client's headers
import serve_peers  # the ceiling, the calibrator, the ports
from serve import Connection  # the raw keep-alive client

CONTROL_C = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""

#: Run before the server: SIGUSR1 starts counting, SIGUSR2 stops and writes the counts;
#: WT_SWITCH_OFF names layers to replace by pass-throughs (ours only).
HOOK = textwrap.dedent(
    """
    import ctypes, os, signal, sys

    control = ctypes.CDLL(os.environ["WT_CALLGRIND_CONTROL"])
    signal.signal(signal.SIGUSR1, lambda *_: control.start())
    signal.signal(signal.SIGUSR2, lambda *_: control.stop())

    def passthrough(self, scope, receive, send):
        return self.app(scope, receive, send)

    off = set(filter(None, os.environ.get("WT_SWITCH_OFF", "").split(",")))
    if off:
        from service.server import budget, faults, timeouts
        from service.observe import metrics
        from service.server import requests
        if "access-log" in off:
            os.environ["WELLTEMPERED_ACCESS_LOG"] = "false"
        layers = {
            "body-timeout": timeouts.BodyTimeoutMiddleware,
            "body-limit": budget.BudgetMiddleware,
            "db-faults": faults.DatabaseFaultMiddleware,
            "metrics": requests.MetricsMiddleware,
        }
        for name in off & set(layers):
            layers[name].__call__ = passthrough
        if "prediction-metrics" in off:
            metrics.ServiceMetrics.observe_predictions = lambda self, *a, **k: None

    if sys.argv[1] == "ceiling":
        import uvicorn.main
        sys.argv = ["uvicorn", *sys.argv[2:]]
        sys.exit(uvicorn.main.main())
    from service import cli
    sys.exit(cli.main(sys.argv[2:]))
    """
)

LAYERS = (
    "body-timeout", "body-limit", "db-faults", "metrics", "prediction-metrics", "access-log"
)  # fmt: skip


def httpclient_request(port: int, path: str, body: bytes) -> bytes:
    """The bytes ``http.client`` sends for bench/serve_httpclient.py's requests, in its
    order (Host and Accept-Encoding by ``putrequest``, then Content-Length, then ours)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept-Encoding: identity\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    for name, value in serve_httpclient.HEADERS.items():
        head += f"{name}: {value}\r\n"
    return (head + "\r\n").encode() + body


def control_library(where: Path) -> Path:
    source, library = where / "control.c", where / "libcontrol.so"
    source.write_text(CONTROL_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", library, source], check=True)
    return library


def dumps(out: Path) -> dict[int, int]:
    """The instructions of each dump callgrind wrote for ``out`` (``out.1``, ``out.2``,
    ...; the ``totals:`` line of each), by its number."""
    found = {}
    for path in out.parent.glob(out.name + ".*"):
        number = path.name.rpartition(".")[2]
        if not number.isdigit():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                found[int(number)] = int(line.split()[1])
    return found


def window(proc: subprocess.Popen, between) -> float:
    """Count the server's instructions while ``between()`` runs (one dump); its seconds.

    The server handles a signal within a step of its event loop (uvloop wakes on it):
    half a second after each, the handler has run."""
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    started = time.monotonic()
    between()
    elapsed = time.monotonic() - started
    proc.send_signal(signal.SIGUSR2)
    time.sleep(0.5)
    return elapsed + 1.0


def count(
    cmd: list[str], env: dict, cwd: Path, port: int, request: bytes, n: int, idle: float
) -> tuple[float, float]:
    """Instructions per request of the server ``cmd`` starts (its hook handles signals),
    the idle rate's share taken off; and that share (module docstring)."""
    out = cwd / f"callgrind.{port}.out"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    proc = subprocess.Popen(
        [*valgrind, f"--callgrind-out-file={out}", *cmd],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        serve_peers.wait_port(port, proc, cmd[-1], timeout=900)
        conn = Connection(port)
        for _ in range(300):
            assert conn.roundtrip(request) == 200
        conn.close()  # idle longer than uvicorn keeps a connection open
        idle_seconds = window(proc, lambda: time.sleep(idle))
        conn = Connection(port)
        for _ in range(10):
            assert conn.roundtrip(request) == 200

        def requests() -> None:
            for _ in range(n):
                assert conn.roundtrip(request) == 200

        busy_seconds = window(proc, requests)
        conn.close()
        time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=300)
    found = dumps(out)
    if len(found) < 2:
        raise RuntimeError(f"callgrind wrote {len(found)} dumps for {out}, not 2")
    first, second = sorted(found)[:2]
    idle_share = found[first] / idle_seconds * busy_seconds
    return (found[second] - idle_share) / n, idle_share / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--repeat", type=int, default=1, help="measure each server again")
    parser.add_argument("--switch-off", nargs="*", choices=LAYERS, default=())
    parser.add_argument("--keep", type=Path, help="copy callgrind's files here (annotate)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds counted idle")
    parser.add_argument("--client", choices=("raw", "httpclient"), default="raw")
    parser.add_argument("--ceiling-path", choices=("/v1/json", "/v1/outputs"), default="/v1/json")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        print("needs valgrind with its headers (Debian: apt install valgrind)", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="wt-serve-instructions-") as d:
        tmp = Path(d)
        base, _, onnx = serve_peers.prepare_ours(tmp / "base")
        base.terminate()
        base.wait(timeout=60)
        (tmp / "hook.py").write_text(HOOK)
        (tmp / "ceiling.py").write_text(serve_peers.CEILING)
        library = control_library(tmp)
        one = np.random.default_rng(1).normal(size=(1, serve_peers.K)).astype(np.float32)
        body = json.dumps({"logits": one.tolist()}).encode()
        env = {**os.environ, "WT_CALLGRIND_CONTROL": str(library), "OMP_NUM_THREADS": "1"}

        runs = [("ceiling", "")] + [("ours", "")] + [(f"ours - {x}", x) for x in args.switch_off]
        results: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(args.repeat):
            for name, off in runs:
                port = serve_peers.free_port()
                if name == "ceiling":
                    where = tmp / "ceiling"
                    where.mkdir(exist_ok=True)
                    shutil.copy(tmp / "ceiling.py", where)
                    cmd = [sys.executable, str(tmp / "hook.py"), "ceiling", "ceiling:app",
                           "--port", str(port), "--log-level", "warning",
                           "--http", "httptools", "--loop", "uvloop"]  # fmt: skip
                    run_env = {**env, "MODEL_ONNX": str(onnx)}
                    path = args.ceiling_path
                else:
                    where = tmp / f"ours-{len(results[name])}-{off or 'all'}"
                    shutil.copytree(tmp / "base", where)
                    cmd = [sys.executable, str(tmp / "hook.py"), "ours", "serve",
                           "--port", str(port), "--log-level", "warning"]  # fmt: skip
                    run_env = {
                        **env,
                        "WT_SWITCH_OFF": off,
                        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{where / 'r.sqlite3'}",
                        "WELLTEMPERED_DATA_DIR": str(where / "data"),
                        "WELLTEMPERED_AUTH": "off",
                        "WELLTEMPERED_METRICS_ADDRESS": "",
                        "WELLTEMPERED_ALIAS_CACHE_SECONDS": "3600",
                    }
                    path = f"/v1/models/{serve_peers.MODEL}/predict"
                if args.client == "raw":
                    request = serve_peers.request(path, body, "application/json")
                else:
                    request = httpclient_request(port, path, body)
                per_request, idle = count(
                    cmd, run_env, where, port, request, args.requests, args.idle
                )
                results[name].append(per_request)
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    for dump in where.glob("callgrind.*"):
                        shutil.copy(dump, args.keep / f"{name.replace(' ', '')}.{dump.name}")
                print(
                    f"{name:<28} {per_request:>12,.0f} instructions/request "
                    f"(idle share taken off: {idle:,.0f})",
                    flush=True,
                )
        ceiling = np.mean(results["ceiling"])
        print(
            f"\nJSON 1 x 1,000, {args.requests} requests counted per run, client {args.client}, "
            f"ceiling {args.ceiling_path}"
        )
        for name, values in results.items():
            mean = np.mean(values)
            print(f"{name:<28} {mean:>12,.0f}   ceiling / it {ceiling / mean:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
