"""Intra order-preserving calibration (``iop``) on the shared CIFAR outputs: how much the
seed moves it, and what ``n_top`` buys.

For each shared file (``../shared/data``, split by the shared convention: fit on the
first half of ``default_rng(0).permutation(10000)``, evaluate on the other half), in
one process:

* temperature scaling, the baseline;
* ``iop`` with its defaults and ``seed`` 0..4 (the seed only assigns rows to the
  cross-validation folds): held-out NLL, top-label ECE (15 equal-width bins),
  predictions changed, the chosen penalties, fit seconds; then the spread
  (max - min) of NLL and ECE over the seeds;
* ``iop`` with seed 0 and ``n_top`` in 8, 16, 32, 64 and K - 1.

Usage::

    .venv/bin/python bench/iop_seeds.py | tee bench/results/iop_seeds.txt
    .venv/bin/python bench/iop_seeds.py --seeds 2 --skip-n-top     # quick check
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

import calibrators
from calibrators.evaluation.holdout import split_indices
from calibrators.evaluation.metrics import expected_calibration_error, nll_loss

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FILES = ("wideresnet-16-4-cifar-100", "lenet-5-cifar-10")


def load(stem: str):
    with np.load(DATA / f"{stem}.npz") as f:
        probs, labels = f["predictions"], f["ground_truth"]
    fit, test = split_indices(labels.shape[0], 0.5, seed=0)
    return probs[fit], labels[fit], probs[test], labels[test]


def run(method: str, options: dict, data) -> dict:
    x_fit, y_fit, x_test, y_test = data
    started = time.perf_counter()
    cal = calibrators.create(method, **options).fit(x_fit, y_fit, kind="probabilities")
    seconds = time.perf_counter() - started
    p = cal.predict_proba(x_test, kind="probabilities")
    info = cal.fit_info_
    return {
        "nll": nll_loss(p, y_test),
        "ece": expected_calibration_error(p, y_test),
        "changed": int((p.argmax(axis=1) != x_test.argmax(axis=1)).sum()),
        "seconds": seconds,
        "penalties": (info.get("reg_lambda"), info.get("reg_mu")) if method == "iop" else None,
    }


def row(name: str, r: dict) -> str:
    pen = r["penalties"]
    chosen = "-" if pen is None else (
        "temperature" if pen[0] is None else f"lambda={pen[0]:g}, mu={pen[1]:g}")
    return (f"| {name} | {r['nll']:.4f} | {100 * r['ece']:.2f} | {r['changed']} | {chosen} "
            f"| {r['seconds']:.1f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--skip-n-top", action="store_true")
    args = ap.parse_args(argv)
    load_avg = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"# iop_seeds: python {platform.python_version()}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load_avg} at the start")
    header = ("| fit | held-out NLL | ECE % | changed | penalties | fit s |\n"
              "| --- | ---: | ---: | ---: | --- | ---: |")
    for stem in FILES:
        data = load(stem)
        k = data[0].shape[1]
        print(f"\n## {stem} (fit {data[0].shape[0]} x {k}, held out {data[2].shape[0]})\n")
        print(header)
        print(row("temperature", run("temperature", {}, data)))
        seeds = [run("iop", {"seed": s}, data) for s in range(args.seeds)]
        for s, r in enumerate(seeds):
            print(row(f"iop, seed {s}", r))
        nll = [r["nll"] for r in seeds]
        ece = [100 * r["ece"] for r in seeds]
        print(f"\nspread over {args.seeds} seeds: NLL {min(nll):.4f} .. {max(nll):.4f} "
              f"(range {max(nll) - min(nll):.4f}); ECE {min(ece):.2f} .. {max(ece):.2f} % "
              f"(range {max(ece) - min(ece):.2f} points)")
        if not args.skip_n_top:
            print(f"\n{header}")
            for n_top in sorted({8, 16, 32, 64, k - 1}):
                print(row(f"iop, n_top {n_top}", run("iop", {"n_top": n_top}, data)))
    load_avg = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"\n# load average {load_avg} at the end")


if __name__ == "__main__":
    main()
