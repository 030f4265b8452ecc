"""Vector, matrix and Dirichlet scaling with their defaults on both shared files.

The shared split (fit on the first half of ``default_rng(0).permutation(10000)``,
evaluate on the other half), probabilities in: the penalties the search chose, the
held-out NLL, the L-BFGS evaluations of the whole search and the fit seconds.

Usage::

    .venv/bin/python bench/odir_shared.py | tee bench/results/odir_shared.txt
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from calibrators.evaluation.holdout import split_indices
from calibrators.methods.dirichlet import DirichletScaler
from calibrators.methods.matrix import MatrixScaler
from calibrators.methods.vector import VectorScaler

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> None:
    print("# bench/odir_shared.py")
    print(f"start: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| data | method | lambda | mu | held-out NLL | evaluations | fit s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for stem in ("lenet-5-cifar-10", "wideresnet-16-4-cifar-100"):
        with np.load(DATA / f"{stem}.npz") as f:
            p, y = f["predictions"], f["ground_truth"]
        fit, test = split_indices(len(y), 0.5, seed=0)
        for cls in (VectorScaler, MatrixScaler, DirichletScaler):
            started = time.perf_counter()
            cal = cls().fit(p[fit], y[fit], kind="probabilities")
            seconds = time.perf_counter() - started
            q = cal.predict_proba(p[test], kind="probabilities")
            nll = -np.mean(np.log(q[np.arange(len(test)), y[test]]))
            info = cal.fit_info_
            lam = "-" if info["reg_lambda"] is None else f"{info['reg_lambda']:.5g}"
            print(f"| {stem} | {cls.method} | {lam} | {info['reg_mu']:.5g} | {nll:.5f} | "
                  f"{info['evaluations']} | {seconds:.2f} |", flush=True)
    print(f"end: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
