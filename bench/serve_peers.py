"""Serving speed against what users would otherwise run, in one run (issue 13 item 7).

    .venv/bin/python bench/serve_peers.py [--seconds 5] [--concurrency 4]
        [--kserve-python /work/kserve-venv/bin/python] [--cases json binary]

The same calibrator (a temperature fit on 4,000 x 1,000 synthetic logits, its ONNX
downloaded from our service) served by:

- **ceiling**: a bare FastAPI app on uvicorn[standard] (httptools, uvloop when
  installed) whose two routes parse the body, run the ONNX model in ONNX Runtime and
  answer, nothing else: ``/v1`` JSON like ours, and the Open Inference Protocol's
  binary tensor extension;
- **kserve**: KServe's Python model server (``kserve.ModelServer``, 0.21) with a
  custom ``Model`` running the same ONNX file; JSON is its v1 protocol
  (``{"instances": ...}``), binary its v2 REST with the binary extension;
- **ours**: ``welltempered serve`` (SQLite, auth off), ``/v1/models/bench/predict``
  and ``/v2/models/bench/infer``.

Cases: JSON 1 x 1,000 and binary 4,096 x 1,000 (probabilities out, binary). Every
server gets the same closed-loop load (keep-alive HTTP/1.1 on raw sockets, the
client of bench/serve.py). Beside requests per second, each round reads the server's
CPU seconds (its process tree, /proc) per request: on two cores the load generator
takes about one, and how much it gets moves the throughput of every server, not its
CPU per request. KServe runs from its own venv (``--kserve-python``; it
pins its own FastAPI): ``python3 -m venv /work/kserve-venv &&
/work/kserve-venv/bin/pip install 'kserve==0.21.*' onnxruntime``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.oracles import wait_for_version  # noqa: E402

K = 1000
MODEL = "bench"

CEILING = textwrap.dedent(
    """
    import json, os
    import numpy as np, onnxruntime as ort, orjson
    from fastapi import FastAPI, Request, Response

    opts = ort.SessionOptions(); opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(os.environ["MODEL_ONNX"], opts, providers=["CPUExecutionProvider"])
    app = FastAPI()

    def run(x):
        return sess.run(["probabilities"], {sess.get_inputs()[0].name: x})[0]

    @app.post("/v1/json")
    async def v1(request: Request) -> Response:
        x = np.asarray(orjson.loads(await request.body())["logits"], dtype=np.float32)
        p = run(x)
        out = {"probabilities": p, "labels": p.argmax(1), "confidence": p.max(1)}
        return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY),
                        media_type="application/json")

    # All four outputs of our graph, computed by it and answered (bench/serve_httpclient.py).
    @app.post("/v1/outputs")
    async def outputs(request: Request) -> Response:
        x = np.asarray(orjson.loads(await request.body())["logits"], dtype=np.float32)
        names = [o.name for o in sess.get_outputs()]
        out = dict(zip(names, sess.run(names, {sess.get_inputs()[0].name: x})))
        return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY),
                        media_type="application/json")

    @app.post("/v2/models/bench/infer")
    async def v2(request: Request) -> Response:
        body = await request.body()
        n = int(request.headers["inference-header-content-length"])
        head = json.loads(body[:n]); spec = head["inputs"][0]
        x = np.frombuffer(body[n:], dtype=np.float32).reshape(spec["shape"])
        p = run(x).astype(np.float32).tobytes()
        out = json.dumps({"model_name": "bench", "outputs": [{"name": "probabilities",
            "datatype": "FP32", "shape": spec["shape"],
            "parameters": {"binary_data_size": len(p)}}]}).encode()
        return Response(out + p, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(out))})
    """
)

KSERVE = textwrap.dedent(
    """
    import os, sys
    import numpy as np, onnxruntime as ort
    import kserve
    from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

    class Calibrator(Model):
        def __init__(self):
            super().__init__("bench")
            opts = ort.SessionOptions(); opts.intra_op_num_threads = 1
            self.sess = ort.InferenceSession(os.environ["MODEL_ONNX"], opts,
                                             providers=["CPUExecutionProvider"])
            self.ready = True

        def run(self, x):
            return self.sess.run(["probabilities"], {self.sess.get_inputs()[0].name: x})[0]

        def predict(self, payload, headers=None, response_headers=None):
            if isinstance(payload, InferRequest):
                p = self.run(payload.inputs[0].as_numpy().astype(np.float32))
                out = InferOutput("probabilities", list(p.shape), "FP32")
                out.set_data_from_numpy(p, binary_data=True)
                return InferResponse(payload.id or "1", self.name, [out])
            p = self.run(np.asarray(payload["instances"], dtype=np.float32))
            return {"predictions": p.tolist()}

    ModelServer(http_port=int(sys.argv[1]), enable_grpc=False).start([Calibrator()])
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(path: str, body: bytes, content_type: str, extra: dict[str, str] | None = None):
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\n"
    for name, value in (extra or {}).items():
        head += f"{name}: {value}\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def binary_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "logits",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (Linux /proc):
    a server's own work, whatever the load generator beside it costs."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime, stime
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port}")


def prepare_ours(tmp: Path, **settings: str) -> tuple[subprocess.Popen, int, Path]:
    import httpx

    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **{f"WELLTEMPERED_{k.upper()}": v for k, v in settings.items()},
        **os.environ,
        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{tmp / 'r.sqlite3'}",
        "WELLTEMPERED_DATA_DIR": str(tmp / "data"),
        "WELLTEMPERED_AUTH": "off",
        "WELLTEMPERED_METRICS_ADDRESS": "",
        "WELLTEMPERED_MAX_BODY_BYTES": str(64 << 20),
    }
    exe = Path(sys.executable).with_name("welltempered")
    proc = subprocess.Popen(
        [str(exe), "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    wait_port(port, proc, "welltempered serve")
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    labels = rng.integers(0, K, 4000)
    logits = rng.normal(size=(4000, K)).astype(np.float32)
    logits[np.arange(4000), labels] += 4
    buf = io.BytesIO()
    np.savez(buf, logits=logits, labels=labels)
    with httpx.Client(base_url=base, timeout=120) as c:
        c.post("/v1/models", json={"name": MODEL, "num_classes": K}).raise_for_status()
        ds = c.post(
            f"/v1/models/{MODEL}/datasets",
            content=buf.getvalue(),
            headers={"content-type": "application/octet-stream"},
        ).json()["id"]
        c.post(
            f"/v1/models/{MODEL}/calibrators", json={"dataset_id": ds, "method": "temperature"}
        ).raise_for_status()
        wait_for_version(c, MODEL, 1, timeout=math.inf, interval=0.1)
        c.put(f"/v1/models/{MODEL}/aliases/production", json={"version": 1}).raise_for_status()
        onnx = tmp / "model.onnx"
        onnx.write_bytes(c.get(f"/v1/models/{MODEL}/calibrators/1/onnx").content)
    return proc, port, onnx


def start(cmd: list[str], port: int, env: dict[str, str], cwd: Path, what: str):
    proc = subprocess.Popen(
        cmd, env={**os.environ, **env}, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    wait_port(port, proc, what)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="each server in turn, per case")
    parser.add_argument("--kserve-python", default="/work/kserve-venv/bin/python")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=("json", "binary"),
        default=("json", "binary"),
        help="which cases to run (KServe's binary case takes minutes a round)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from serve import load as closed_loop  # the keep-alive raw-socket client of bench/serve.py

    def load(port: int, req: bytes) -> np.ndarray:
        return closed_loop(port, req, args.seconds, args.concurrency)

    rng = np.random.default_rng(1)
    one = rng.normal(size=(1, K)).astype(np.float32)
    big = rng.normal(size=(4096, K)).astype(np.float32)
    json_ours = json.dumps({"logits": one.tolist()}).encode()
    json_kserve = json.dumps({"instances": one.tolist()}).encode()
    bin_body, bin_head = binary_body(big)

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="wt-serve-peers-") as d:
        tmp = Path(d)
        try:
            ours, ours_port, onnx = prepare_ours(tmp / "ours")
            procs.append(ours)
            # The same service on uvicorn's pure-Python parser and asyncio's loop: what
            # it ran before httptools and uvloop were its defaults.
            slow, slow_port, _ = prepare_ours(tmp / "h11", http_parser="h11", event_loop="asyncio")
            procs.append(slow)
            (tmp / "ceiling.py").write_text(CEILING)
            (tmp / "kserve_model.py").write_text(KSERVE)
            env = {"MODEL_ONNX": str(onnx), "OMP_NUM_THREADS": "1"}
            ceiling_port = free_port()
            loop_args = []
            try:
                import httptools  # noqa: F401
                import uvloop  # noqa: F401

                loop_args = ["--http", "httptools", "--loop", "uvloop"]
            except ImportError:
                print("(httptools/uvloop not installed: the ceiling runs on h11/asyncio)")
            ceiling = start(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "ceiling:app",
                    "--port",
                    str(ceiling_port),
                    "--log-level",
                    "warning",
                    *loop_args,
                ],
                ceiling_port,
                env,
                tmp,
                "ceiling",
            )
            procs.append(ceiling)
            kserve_port = free_port()
            kserve = start(
                [args.kserve_python, "kserve_model.py", str(kserve_port)],
                kserve_port,
                env,
                tmp,
                "kserve",
            )
            procs.append(kserve)
            servers = {
                "json 1 x 1,000": {
                    "ceiling": (ceiling_port, request("/v1/json", json_ours, "application/json")),
                    "kserve": (
                        kserve_port,
                        request("/v1/models/bench:predict", json_kserve, "application/json"),
                    ),
                    "ours": (
                        ours_port,
                        request(f"/v1/models/{MODEL}/predict", json_ours, "application/json"),
                    ),
                    "ours-h11": (
                        slow_port,
                        request(f"/v1/models/{MODEL}/predict", json_ours, "application/json"),
                    ),
                },
                "binary 4,096 x 1,000": {
                    name: (
                        port,
                        request(
                            f"/v2/models/{MODEL}/infer",
                            bin_body,
                            "application/octet-stream",
                            bin_head,
                        ),
                    )
                    for name, port in (
                        ("ceiling", ceiling_port),
                        ("kserve", kserve_port),
                        ("ours", ours_port),
                        ("ours-h11", slow_port),
                    )
                },
            }
            print(
                f"{args.concurrency} clients, {args.seconds:g} s per case and server; "
                f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}"
            )
            print(
                f"{'case':<22} {'server':<8} {'round':>5} {'req/s':>9} {'p50 ms':>9} "
                f"{'p99 ms':>9} {'cpu us/req':>10}"
            )
            pids = {"ceiling": ceiling.pid, "kserve": kserve.pid, "ours": ours.pid}
            pids["ours-h11"] = slow.pid
            for case, targets in servers.items():
                if case.split()[0] not in args.cases:
                    continue
                for port, req in targets.values():
                    load(port, req)  # warm-up (sessions, caches), not counted
                rates: dict[str, list[float]] = {name: [] for name in targets}
                cpu: dict[str, list[float]] = {name: [] for name in targets}
                for rnd in range(args.rounds):  # servers in turn: a noisy spell hits all
                    for name, (port, req) in targets.items():
                        before = tree_cpu_seconds(pids[name])
                        started = time.perf_counter()
                        lat = load(port, req)
                        # over the time it took: a request longer than the round (KServe's
                        # binary answers take tens of seconds) ends it late
                        elapsed = time.perf_counter() - started
                        cpu[name].append((tree_cpu_seconds(pids[name]) - before) / len(lat))
                        rates[name].append(len(lat) / elapsed)
                        print(
                            f"{case:<22} {name:<8} {rnd:>5} {rates[name][-1]:>9.1f} "
                            f"{1e3 * np.percentile(lat, 50):>9.2f} "
                            f"{1e3 * np.percentile(lat, 99):>9.2f} {1e6 * cpu[name][-1]:>10.1f}"
                        )
                peers = ("ceiling", "kserve", "ours-h11")
                ratios = {p: np.array(rates["ours"]) / np.array(rates[p]) for p in peers}
                print(
                    f"{case:<22} ours / peer per round, median [min, max]: "
                    + ", ".join(
                        f"/{peer} {np.median(r):.2f}x [{r.min():.2f}, {r.max():.2f}]"
                        for peer, r in ratios.items()
                    )
                )
                # The same in server CPU per request (peer's / ours: above 1, ours uses
                # less), the figure the load generator's share of the CPUs does not move.
                cpu_ratios = {p: np.array(cpu[p]) / np.array(cpu["ours"]) for p in peers}
                print(
                    f"{case:<22} CPU per request, peer / ours per round, median [min, max]: "
                    + ", ".join(
                        f"/{peer} {np.median(r):.2f}x [{r.min():.2f}, {r.max():.2f}]"
                        for peer, r in cpu_ratios.items()
                    )
                )
            print(f"load at the end {os.getloadavg()[0]:.1f}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
