"""svs and sms fit time against probmetrics' SVS and SMS, fit by fit in one run.

Issue 21's goal: our ``svs`` fits in at most twice the time of probmetrics 1.3.0's
SVS (``get_calibrator("svs")``), penalty search included, and ``sms`` in at most
twice SMS's, at 5,000 x 100: the fit half of the shared CIFAR-100 outputs
(``wideresnet-16-4-cifar-100.npz``, the first half of
``numpy.random.default_rng(seed).permutation(N)``), on the probabilities.

Every side is a server process that loads the file once, fits once untimed (imports,
first calls), then fits on request and answers with the wall and process CPU seconds
of ``fit``: the peers in their own Python (``--peers-python`` or
``WELLTEMPERED_PEERS_PYTHON``, as ``bench/peers.py``; ``torch.manual_seed(0)``
before each fit), ours in this checkout and, with ``--before PATH``, in another one
(say the code before a change: ``git worktree add /tmp/before <commit>``). The
servers take turns fit by fit (ours, the peer's, ours before; ``--rounds`` times per
seed), so load from other jobs meets every side alike; one fit runs at a time.

Prints, per method and side, the fastest and the median wall seconds, the ratios
against the peer (fastest against fastest, median against median, the median of the
per-round ratios, and the median process CPU seconds against the peer's: the figure
least moved by other jobs, and with ``OMP_NUM_THREADS=1 WELLTEMPERED_THREADS=1`` the
work of one thread on each side), the held-out NLL on the split's other half, and the
load average at the start and the end.

Usage::

    WELLTEMPERED_PEERS_PYTHON=/work/bench-venv/bin/python \\
        .venv/bin/python bench/structured_time.py --rounds 9 [--before /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"
FILE = "wideresnet-16-4-cifar-100.npz"
#: Ours -> probmetrics' method of the same name.
PAIRS = {"svs": "SVS", "sms": "SMS"}
ENV_PYTHON = "WELLTEMPERED_PEERS_PYTHON"


def serve(side: str) -> None:
    """A server: fit ``METHOD SEED`` per line of stdin, one JSON line of answer each."""
    if side == "peers":
        import torch

        sys.path.insert(0, str(HERE))
        from peers import _peer

        def fit(method, p, y):
            torch.manual_seed(0)
            cal = _peer(method)
            return cal, cal.fit

        def predict(cal, p):
            return np.asarray(cal.predict_proba(p), dtype=np.float64)
    else:
        import calibrators

        def fit(method, p, y):
            cal = calibrators.create(method)
            return cal, lambda p, y: cal.fit(p, y, kind="probabilities")

        def predict(cal, p):
            return cal.predict_proba(p, kind="probabilities")

    with np.load(DATA / FILE) as data:
        p, y = data["predictions"], data["ground_truth"]
    warmed = set()
    where = "probmetrics" if side == "peers" else calibrators.__file__
    print(json.dumps({"ready": where}), flush=True)
    for line in sys.stdin:
        method, seed = line.split()
        order = np.random.default_rng(int(seed)).permutation(len(y))
        fit_rows, test_rows = order[: len(y) // 2], order[len(y) // 2 :]
        p_fit, y_fit = p[fit_rows], y[fit_rows]
        if method not in warmed:
            fit(method, p_fit, y_fit)[1](p_fit, y_fit)
            warmed.add(method)
        cal, run = fit(method, p_fit, y_fit)
        w0, c0 = time.perf_counter(), time.process_time()
        run(p_fit, y_fit)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        q = predict(cal, p[test_rows])
        q = np.maximum(q, 0.0) / np.maximum(q, 0.0).sum(axis=1, keepdims=True)
        nll = float(-np.mean(np.log(np.maximum(q[np.arange(len(test_rows)), y[test_rows]],
                                               1e-300))))
        print(json.dumps({"wall": wall, "cpu": cpu, "nll": nll}), flush=True)


class Server:
    """A serving child process: ``ask(method, seed)`` -> its answer."""

    def __init__(self, python: str, side: str, root: Path | None = None):
        env = dict(os.environ)
        if root is not None:  # that checkout's calibrators first
            env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--serve", side], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, cwd=root or HERE.parent)
        where = self._read()["ready"]
        if root is not None and not where.startswith(str(root)):
            raise SystemExit(f"the server for {root} imported {where}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a server ended early (exit code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, method: str, seed: int) -> dict:
        self.proc.stdin.write(f"{method} {seed}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--peers-python", help=f"Python with probmetrics (default ${ENV_PYTHON})")
    parser.add_argument("--before", help="another checkout of ours, timed in the same turns")
    parser.add_argument("--methods", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--rounds", type=int, default=5, help="fits per side, method and seed")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return
    python = args.peers_python or os.environ.get(ENV_PYTHON)
    if not python:
        raise SystemExit(f"needs the peers' Python: --peers-python or ${ENV_PYTHON}")
    print(f"# bench/structured_time.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    threads = ", ".join(f"{name}={os.environ.get(name, 'unset')}"
                        for name in ("WELLTEMPERED_THREADS", "OMP_NUM_THREADS"))
    print(f"start: load average {load()}; {os.cpu_count()} CPUs; {threads}; {FILE}, fit half "
          "per seed")
    sides = {"ours": Server(sys.executable, "ours", HERE.parent),
             "probmetrics": Server(python, "peers")}
    if args.before:
        sides["ours before"] = Server(sys.executable, "ours", Path(args.before).resolve())
    got: dict[tuple[str, str], list[dict]] = {}
    try:
        for method in args.methods:
            for seed in args.seeds:
                for _ in range(args.rounds):
                    for side, server in sides.items():
                        name = PAIRS[method] if side == "probmetrics" else method
                        got.setdefault((side, method), []).append(server.ask(name, seed))
    finally:
        for server in sides.values():
            server.close()
    for method in args.methods:
        peer = got[("probmetrics", method)]
        for side in sides:
            runs = got[(side, method)]
            wall = np.array([r["wall"] for r in runs])
            line = (f"{side:12s} {method if side != 'probmetrics' else PAIRS[method]:4s} "
                    f"wall fastest {wall.min():.4f} s, median {np.median(wall):.4f} s; "
                    f"CPU median {np.median([r['cpu'] for r in runs]):.4f} s; held-out NLL "
                    + ", ".join(sorted({f'{r["nll"]:.5f}' for r in runs})))
            if side != "probmetrics":
                theirs = np.array([r["wall"] for r in peer])
                cpu = np.median([r["cpu"] for r in runs]) / np.median([r["cpu"] for r in peer])
                line += (f"; / {PAIRS[method]}: fastest {wall.min() / theirs.min():.2f}x, "
                         f"median {np.median(wall) / np.median(theirs):.2f}x, per round "
                         f"median {np.median(wall / theirs):.2f}x, CPU median {cpu:.2f}x")
            print(line)
    print(f"end: load average {load()}")


if __name__ == "__main__":
    main()
