"""svs's (or sms's) held-out NLL on the 5-split protocol, to six digits (issue 21).

The protocol of :mod:`bench.search_splits` (fit on the first half of
``default_rng(seed).permutation(N)``, seeds 0 to 4, score the second), on both shared
files, for ``svs`` (``--method sms``: sms): a change that speeds up its fit must leave
each file's mean held-out NLL within 1e-4 (``search_splits.py`` prints four digits). Per seed: the
held-out NLL, the multipliers chosen and the fit's loss evaluations.

Usage (run it in two checkouts and compare; options as ``name=value``)::

    PYTHONPATH=$PWD .venv/bin/python bench/svs_splits.py [--method sms] [grid="(1.0, 0.25)"]
"""

from __future__ import annotations

import ast
import sys

import numpy as np
from search_splits import DATA, SEEDS, choice, held_out_nll

import calibrators
from calibrators.evaluation.holdout import split_indices

FILES = ("wideresnet-16-4-cifar-100.npz", "lenet-5-cifar-10.npz")


def main(argv: list[str]) -> None:
    method = "svs"
    if argv[:1] == ["--method"]:
        method, argv = argv[1], argv[2:]
    options = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in argv)}
    print(f"# bench/svs_splits.py {method} {' '.join(argv)} ({calibrators.__file__})")
    for name in FILES:
        with np.load(DATA / name) as f:
            p, y = f["predictions"], f["ground_truth"]
        nll = []
        for seed in SEEDS:
            fit, test = split_indices(len(y), 0.5, seed=seed)
            cal = calibrators.create(method, **options).fit(p[fit], y[fit], kind="probabilities")
            nll.append(held_out_nll(cal, p[test], y[test]))
            print(f"{name} seed {seed}: {nll[-1]:.6f}  {choice(cal.fit_info_)}  "
                  f"evaluations {cal.fit_info_['evaluations']}")
        print(f"{name} mean {np.mean(nll):.6f}")


if __name__ == "__main__":
    main(sys.argv[1:])
