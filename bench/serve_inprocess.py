"""A JSON 1 x 1,000 predict in process, raw ASGI: ours against the ceiling's app, without
HTTP, sockets or a client in the way (issue 20).

    .venv/bin/python bench/serve_inprocess.py [--requests 3000] [--rounds 5]
        [--servers ceiling ours] [--tree TREE] [--no-access-log]
        [--callgrind [--cache-sim]]

Each server is built in this process: the ceiling from bench/serve_peers.py's app (its
``/v1/outputs`` route, all four outputs), ours with ``create_app`` (SQLite, auth off,
the same temperature calibrator, its alias cached for an hour), its lifespan started.
After 300 warm-up requests each round sends ``--requests`` predicts one after another,
each a new scope with the headers of Python's ``http.client`` (bench/serve_httpclient.py),
and prints microseconds per request; then the process's user and system CPU per request,
its minor page faults and context switches. ``--tree``: ours from another checkout (e.g.
``git archive COMMIT | tar -x -C TREE``).

``--callgrind``: each server in a process of its own under ``valgrind --tool=callgrind``,
counting only the timed requests (callgrind's client requests, through a small C library
compiled here with gcc); prints instructions per request and, with ``--cache-sim``, the
simulated L1 misses per request (instructions and data) and the libraries they fall in.
Instructions are not time: stop 31 found 6 % fewer instructions changed nothing, while
the L1 misses told where the time went (bench/README.md, "Serving through http.client").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TREE = os.environ.get("SERVE_INPROCESS_TREE")  # set for the child processes of --tree
sys.path.insert(0, str(HERE))
import serve_httpclient  # noqa: E402  the client's headers
import serve_peers  # noqa: E402  the ceiling, the calibrator

if TREE:  # ours from that checkout: serve_peers put this one first and imported from it
    sys.path.insert(0, TREE)
    for name in [m for m in sys.modules if m == "service" or m.startswith("service.")]:
        del sys.modules[name]

CONTROL_C = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("requests"); }
"""


def body_and_headers() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    one = np.random.default_rng(1).normal(size=(1, serve_peers.K)).astype(np.float32)
    body = json.dumps({"logits": one.tolist()}).encode()
    headers = [(b"host", b"127.0.0.1"), (b"accept-encoding", b"identity"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    headers += [(k.lower().encode(), v.encode()) for k, v in serve_httpclient.HEADERS.items()]
    return body, headers


def build(name: str, base: Path, work: Path, access_log: bool):
    """The app and its route: the ceiling's, or ours on a copy of ``base``."""
    if name == "ceiling":
        os.environ["MODEL_ONNX"] = str(base / "model.onnx")
        namespace: dict = {}
        exec(serve_peers.CEILING, namespace)
        return namespace["app"], "/v1/outputs"
    from service.api.app import create_app
    from service.settings import Settings

    shutil.copytree(base, work)
    settings = Settings(
        database_url=f"sqlite:///{work / 'r.sqlite3'}", data_dir=work / "data", auth="off",
        metrics_address="", alias_cache_seconds=3600, access_log=access_log,
    )  # fmt: skip
    return create_app(settings), f"/v1/models/{serve_peers.MODEL}/predict"


async def start_lifespan(app) -> asyncio.Queue:
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    asyncio.get_running_loop().create_task(app(scope, inbox.get, outbox.put))
    message = await outbox.get()
    if message["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {message}")
    return inbox


async def predict(app, path: str, body: bytes, headers: list) -> None:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": list(headers), "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000), "state": {},
    }  # fmt: skip
    sent = False
    status = []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect while the app answers

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"{path} answered {status}")


async def run(args, name: str, base: Path, work: Path) -> None:
    app, path = build(name, base, work, not args.no_access_log)
    if name != "ceiling":
        await start_lifespan(app)
    body, headers = body_and_headers()
    for _ in range(300):
        await predict(app, path, body, headers)
    if args.control:  # under callgrind: count the timed requests only
        import ctypes

        control = ctypes.CDLL(args.control)
        control.start()
        for _ in range(args.requests):
            await predict(app, path, body, headers)
        control.stop()
        return
    before = resource.getrusage(resource.RUSAGE_SELF)
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.requests):
            await predict(app, path, body, headers)
        rounds.append((time.perf_counter() - started) / args.requests * 1e6)
    after = resource.getrusage(resource.RUSAGE_SELF)
    n = args.rounds * args.requests
    print(
        f"{name:<8} us/request {' '.join(f'{r:.1f}' for r in rounds)}  min {min(rounds):.1f}; "
        f"user {(after.ru_utime - before.ru_utime) / n * 1e6:.1f} us, system "
        f"{(after.ru_stime - before.ru_stime) / n * 1e6:.1f} us, minor faults "
        f"{(after.ru_minflt - before.ru_minflt) / n:.2f}, context switches "
        f"{after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw - before.ru_nivcsw}; "
        f"load {os.getloadavg()[0]:.1f}",
        file=sys.stderr,  # standard output is the access log's
        flush=True,
    )


def misses_by_library(out: Path, cache_sim: bool) -> tuple[int, int, collections.Counter]:
    """Instructions, L1 misses and misses per library of a callgrind dump."""
    events = ["Ir", *(["I1mr", "D1mr", "D1mw"] if cache_sim else [])]
    annotate = subprocess.run(
        ["callgrind_annotate", f"--show={','.join(events)}", "--threshold=100", str(out)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    number = r"\s*([\d,]+|\.)(?:\s+\([ \d.]+%\))?"
    pattern = re.compile(number * len(events) + r"\s+(.*)")
    ir = misses = 0
    libraries: collections.Counter = collections.Counter()
    for line in annotate.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        values = [0 if v == "." else int(v.replace(",", "")) for v in match.groups()[:-1]]
        where = match.groups()[-1]
        if "PROGRAM TOTALS" in where:
            ir, misses = values[0], sum(values[1:])
            continue
        library = re.search(r"\[([^\]]*)\]\s*$", where)
        libraries[library[1].rsplit("/", 1)[-1] if library else "?"] += sum(values[1:])
    return ir, misses, libraries


def child(args, name: str, tmp: Path) -> None:
    """One server in a process of its own (no caches shared with the other), under
    callgrind with ``--callgrind``."""
    command = [
        sys.executable, __file__, "--servers", name, "--requests", str(args.requests),
        "--rounds", str(args.rounds), "--child", str(tmp / "base"),
        *(["--no-access-log"] if args.no_access_log else []),
    ]  # fmt: skip
    env = {**os.environ, **({"SERVE_INPROCESS_TREE": str(args.tree)} if args.tree else {})}
    if not args.callgrind:
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return
    out = tmp / f"{name}.callgrind"
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        *(["--cache-sim=yes"] if args.cache_sim else []), *command, "--control", args.control,
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    dumps = [p for p in tmp.glob(f"{name}.callgrind.*") if p.stat().st_size]
    dump = max(dumps, key=lambda p: p.stat().st_mtime)
    ir, misses, libraries = misses_by_library(dump, args.cache_sim)
    line = f"{name:<8} instructions/request {ir // args.requests:,}"
    if args.cache_sim:
        top = ", ".join(f"{lib} {n // args.requests:,}" for lib, n in libraries.most_common(5))
        line += f"; L1 misses/request {misses // args.requests:,} ({top})"
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--servers", nargs="+", choices=("ceiling", "ours"),
                        default=["ceiling", "ours"])  # fmt: skip
    parser.add_argument("--tree", type=Path, help="ours from this checkout")
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--cache-sim", action="store_true", help="with --callgrind")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the prepared base
    parser.add_argument("--control", help=argparse.SUPPRESS)  # callgrind's, in a child
    args = parser.parse_args()
    if args.child is not None:
        with tempfile.TemporaryDirectory(prefix="wt-inprocess-") as d:
            asyncio.run(run(args, args.servers[0], args.child, Path(d) / "ours"))
        os._exit(0)  # the app's threads are daemons; its lifespan is not shut down
    with tempfile.TemporaryDirectory(prefix="wt-inprocess-") as d:
        tmp = Path(d)
        proc, _, _ = serve_peers.prepare_ours(tmp / "base")
        proc.terminate()
        proc.wait(timeout=60)
        print(f"JSON 1 x {serve_peers.K:,} predicts in process; cpus {os.cpu_count()}, load "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        if args.callgrind:
            (tmp / "control.c").write_text(CONTROL_C)
            args.control = str(tmp / "control.so")
            subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", args.control,
                            str(tmp / "control.c")], check=True)  # fmt: skip
        for name in args.servers:
            child(args, name, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
