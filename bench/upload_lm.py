"""An upload at language-model K against its floor, in one run (issue 22, item 5).

    .venv/bin/python bench/upload_lm.py [--n 2000] [--k 49152] [--rounds 5] [--before TREE]

The body is a ``.npz`` of ``n x k`` float32 logits shaped like a language model's
(bench/upload_metrics.py's ``make_logits``) and int64 labels, uploaded to a real
``welltempered serve`` (SQLite, auth off) on a 127.0.0.x port, streamed from its file
with its ``Content-Length``. The **floor** is what any upload must do at least: read
the ``.npz`` and write its two arrays as ``.npy`` files (``np.load`` + ``np.save``, no
fsync, no checks), measured in this process right before each upload. Each round
changes one label, so every upload is new content (an identical one is answered from
its hash without writing).

Printed per round: the upload's seconds (until its answer), the floor's, their ratio,
and the server's CPU seconds and RSS growth for the upload; then the seconds until the
dataset's metrics are there (``GET`` of the dataset until ``metrics`` is not null: they
are computed after the answer). With ``--before TREE`` (a checkout of another commit,
e.g. ``git worktree add /tmp/before COMMIT``), that tree's server is measured in the same
rounds, turn about. At the end: the ratio's mean [min, max] over the rounds, per server.

With ``--idempotency-key``, every upload carries a key of its own (the service then
fingerprints the body: ``service/api/idempotent.py``).

The **transfer** (``--transfer``, on by default): the same body streamed by the same
client to a bare uvicorn app (httptools, uvloop, as ``serve`` runs) that reads it and
throws it away, in each round: what moving the bytes from a Python client to a Python
server on this machine costs before any work on them. Printed per round beside the
floor, and at the end each server's upload against it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_peers  # free ports, waiting for a port, CPU of a process tree
from lm_vocab import stream, upload_floor
from upload_metrics import make_logits

MODEL = "lm"
MiB = 1 << 20

#: The transfer's server: reads every body to its end and answers its length.
SINK = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    n, more = 0, True
    while more:
        message = await receive()
        n += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(n).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
"""


def start_sink(where: Path) -> tuple[subprocess.Popen, str]:
    where.mkdir(parents=True)
    (where / "sink.py").write_text(SINK)
    port = serve_peers.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "sink:app", "--port", str(port), "--log-level",
         "warning", "--http", "httptools", "--loop", "uvloop"],
        cwd=where, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    serve_peers.wait_port(port, proc, "the transfer's sink")
    return proc, f"http://127.0.0.1:{port}"


def post_file(url: str, path: Path, key: str | None = None) -> tuple[httpx.Response, float]:
    """``path`` streamed as the body of a POST with its length (and ``key`` as its
    Idempotency-Key); the answer and seconds."""
    headers = {"content-type": "application/octet-stream",
               "content-length": str(path.stat().st_size)}  # fmt: skip
    if key is not None:
        headers["idempotency-key"] = key
    t0 = time.perf_counter()
    r = httpx.post(url, content=stream(path), timeout=600, headers=headers)
    return r, time.perf_counter() - t0


def transfer(base: str, path: Path) -> float:
    """Seconds to stream ``path`` to the sink, as :func:`upload` streams it."""
    r, seconds = post_file(f"{base}/", path)
    if r.status_code != 200 or int(r.text) != path.stat().st_size:
        raise RuntimeError(f"transfer: HTTP {r.status_code} {r.text[:100]}")
    return seconds


def start(tree: Path | None, where: Path, k: int) -> tuple[subprocess.Popen, str]:
    where.mkdir(parents=True)
    port = serve_peers.free_port()
    env = {
        **os.environ,
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        "WELLTEMPERED_DATABASE_URL": f"sqlite:///{where / 'r.sqlite3'}",
        "WELLTEMPERED_DATA_DIR": str(where / "data"),
        "WELLTEMPERED_AUTH": "off",
        "WELLTEMPERED_METRICS_ADDRESS": "",
        "WELLTEMPERED_MAX_CLASSES": str(max(k, 1000)),
        "WELLTEMPERED_MAX_BODY_BYTES": str(2 << 30),
        # Every round stores a new dataset: room for more rounds than the default quota.
        "WELLTEMPERED_QUOTA_STORED_BYTES": str(64 << 30),
    }
    exe = Path(sys.executable).with_name("welltempered")
    proc = subprocess.Popen(
        [str(exe), "serve", "--port", str(port), "--log-level", "warning"],
        env=env, cwd=where, stdout=open(where / "serve.out", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    serve_peers.wait_port(port, proc, f"welltempered serve ({tree or 'this tree'})")
    base = f"http://127.0.0.1:{port}"
    httpx.post(f"{base}/v1/models", json={"name": MODEL, "num_classes": k}).raise_for_status()
    return proc, base


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def upload(proc: subprocess.Popen, base: str, path: Path, key: str | None = None) -> dict:
    cpu0, rss0 = serve_peers.tree_cpu_seconds(proc.pid), rss(proc.pid)
    t0 = time.perf_counter()
    r, seconds = post_file(f"{base}/v1/models/{MODEL}/datasets", path, key)
    if r.status_code != 201:
        raise RuntimeError(f"upload: HTTP {r.status_code} {r.text[:300]}")
    out = {
        "seconds": seconds,
        "cpu": serve_peers.tree_cpu_seconds(proc.pid) - cpu0,
        "rss": rss(proc.pid) - rss0,
    }
    dataset = r.json()
    while dataset.get("metrics") is None:
        time.sleep(0.05)
        got = httpx.get(f"{base}/v1/models/{MODEL}/datasets/{dataset['id']}", timeout=60)
        got.raise_for_status()
        dataset = got.json()
    out["metrics"] = time.perf_counter() - t0
    return out


def print_ratios(ratios: dict[str, list[float]]) -> None:
    for name, r in ratios.items():
        a = np.array(r)
        print(f"{name:<10} {a.mean():.2f}x [{a.min():.2f}, {a.max():.2f}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--k", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another commit's tree, served beside")
    parser.add_argument("--no-transfer", dest="transfer", action="store_false",
                        help="skip the bare transfer of the body")
    parser.add_argument("--idempotency-key", action="store_true",
                        help="send every upload with an Idempotency-Key of its own")
    args = parser.parse_args()
    z, y = make_logits(args.n, args.k, "float32")
    with tempfile.TemporaryDirectory(prefix="wt-upload-lm-") as d:
        tmp = Path(d)
        servers = {"this tree": start(None, tmp / "now", args.k)}
        if args.before is not None:
            servers["before"] = start(args.before.resolve(), tmp / "before", args.k)
        sink = start_sink(tmp / "sink") if args.transfer else None
        body = tmp / "body.npz"
        print(f"{args.n} x {args.k} float32 ({z.nbytes / MiB:.0f} MiB) .npz uploads; cpus "
              f"{os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
        print(f"{'server':<10} {'round':>5} {'upload s':>9} {'floor s':>8} {'x floor':>8} "
              f"{'server CPU s':>13} {'RSS growth MiB':>15} {'metrics at s':>13} "
              f"{'transfer s':>11}")
        ratios: dict[str, list[float]] = {name: [] for name in servers}
        over_transfer: dict[str, list[float]] = {name: [] for name in servers}
        try:
            for rnd in range(args.rounds):
                for name, (proc, base) in servers.items():
                    y[0] = (y[0] + 1) % args.k  # new content: nothing is deduplicated
                    np.savez(body, logits=z, labels=y)
                    base_floor = min(upload_floor(body, tmp) for _ in range(2))
                    key = f"upload-lm-{rnd}-{name.replace(' ', '-')}"
                    key = key if args.idempotency_key else None
                    got = upload(proc, base, body, key)
                    ratios[name].append(got["seconds"] / base_floor)
                    moved = transfer(sink[1], body) if sink is not None else float("nan")
                    over_transfer[name].append(got["seconds"] / moved)
                    print(f"{name:<10} {rnd:>5} {got['seconds']:>9.2f} {base_floor:>8.2f} "
                          f"{ratios[name][-1]:>8.2f} {got['cpu']:>13.2f} "
                          f"{got['rss'] / MiB:>15.0f} {got['metrics']:>13.2f} "
                          f"{moved:>11.2f}", flush=True)
        finally:
            for proc, _ in [*servers.values(), *([sink] if sink is not None else [])]:
                proc.terminate()
                proc.wait(timeout=60)
        print(f"\nupload / floor, mean [min, max] over {args.rounds} rounds; load "
              f"{os.getloadavg()[0]:.1f} at the end")
        print_ratios(ratios)
        if sink is not None:
            print("upload / the bare transfer of the same body in the same round:")
            print_ratios(over_transfer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
