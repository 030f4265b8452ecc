"""Our sms fit on wideresnet-16-4-cifar-100 (the shared split) in two source trees, alternating.

Fits ``sms`` (defaults, on the probabilities) in this checkout and in another one (for
example the code before a change: ``git worktree add /tmp/before <commit>``), each
round a fresh process per tree (after one untimed warm-up fit), ``--fits`` timed fits
per process, the trees alternating for ``--rounds`` rounds, so that load from other
jobs hits both alike. Prints min and median wall and process CPU seconds per tree,
their ratios, the evaluations and held-out NLL of each, and the load average at the
start and the end. ``--threads`` sets ``WELLTEMPERED_THREADS`` (1: CPU seconds of
one thread, the least sensitive to other jobs).

Usage::

    git worktree add /tmp/before 5d4f5d6
    .venv/bin/python bench/sms_before_after.py /tmp/before | tee bench/results/sms-before-after.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"
FILE = "wideresnet-16-4-cifar-100.npz"


def child(fits: int) -> None:
    """In a tree's process (its calibrators first on sys.path): time ``fits`` fits."""
    import time

    import calibrators
    from calibrators.evaluation.holdout import split_indices
    from calibrators.evaluation.metrics import nll_loss

    with np.load(DATA / FILE) as data:
        p, y = data["predictions"], data["ground_truth"]
    fit, test = split_indices(len(y), 0.5, seed=0)
    calibrators.create("sms").fit(p[fit], y[fit], kind="probabilities")  # warm-up
    wall, cpu = [], []
    for _ in range(fits):
        w0, c0 = time.perf_counter(), time.process_time()
        cal = calibrators.create("sms").fit(p[fit], y[fit], kind="probabilities")
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    nll = nll_loss(cal.predict_proba(p[test], kind="probabilities"), y[test])
    print(json.dumps({"wall": wall, "cpu": cpu, "nll": nll, "file": calibrators.__file__,
                      "evaluations": cal.fit_info_["evaluations"],
                      "multipliers": cal.fit_info_["multipliers"]}))


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", nargs="?", help="the other checkout (its repository root)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    trees = {"before": Path(args.before).resolve(), "after": HERE.parent}
    env = dict(os.environ)
    if args.threads:
        env["WELLTEMPERED_THREADS"] = str(args.threads)
    print(f"# bench/sms_before_after.py {' '.join(sys.argv[1:])}")
    print(f"start: load average {load()}")
    got = {name: {"wall": [], "cpu": []} for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            out = subprocess.run(
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "sys.argv = sys.argv[1:]; import runpy; runpy.run_path(sys.argv[1], "
                 "run_name='__main__')", str(root), str(Path(__file__).resolve()),
                 "--child", str(args.fits)],
                env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            if not result["file"].startswith(str(root)):
                raise SystemExit(f"{name}: imported {result['file']}, not from {root}")
            got[name]["wall"] += result["wall"]
            got[name]["cpu"] += result["cpu"]
            got[name].update(nll=result["nll"], evaluations=result["evaluations"],
                             multipliers=result["multipliers"])
    for name, g in got.items():
        print(f"{name}: wall min {min(g['wall']):.3f} s, median {np.median(g['wall']):.3f} s; "
              f"CPU min {min(g['cpu']):.3f} s, median {np.median(g['cpu']):.3f} s; "
              f"{g['evaluations']} evaluations; held-out NLL {g['nll']:.7f}; "
              f"multipliers {g['multipliers']}")
        print("   wall: " + ", ".join(f"{s:.3f}" for s in g["wall"]))
    b, a = got["before"], got["after"]
    for what in ("wall", "cpu"):
        print(f"after / before, {what}: min {min(a[what]) / min(b[what]):.3f}, median "
              f"{np.median(a[what]) / np.median(b[what]):.3f}")
    print(f"end: load average {load()}")


if __name__ == "__main__":
    main()
