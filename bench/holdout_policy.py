"""The held-out NLL policy (service.jobs.evaluation) on temperature fits of real outputs,
and on the one-hot parameters of the adversarial import.

For each shipped real output (the two CIFAR files beside the project, and the digits
MLP of ``serve --demo``), whole and in random subsets of ``--sizes`` rows, temperature
scaling is fitted as a fit job fits it (the hold-out split of ``calibrators.evaluation.holdout``,
holdouts 0.1, 0.2, 0.5, ``--splits`` seeds each) and judged as the job judges it
(``calibrators.evaluation.checks.nll_report``, ``evaluation.nll_worse``). Printed per case:
the splits, how many the policy rejects, how many have a held-out NLL worse than the
raw scores' at all, the largest relative worsening and the largest t (the difference
in standard errors of the paired per-row differences).

Then the one-hot parameters (vector scaling, every weight 1e30) on the synthetic data
of the service tests, at growing hold-outs: the t the policy compares with its
threshold, and whether it rejects.

Usage::

    .venv/bin/python bench/holdout_policy.py                # about a minute
    .venv/bin/python bench/holdout_policy.py --splits 5 --sizes 500
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrators
from calibrators.evaluation.checks import nll_report
from calibrators.evaluation.holdout import split_indices
from service.demo import digits_logits
from service.jobs import evaluation
from tests.helpers import DATA_DIR
from tests.service.helpers import logits_data

HOLDOUTS = (0.1, 0.2, 0.5)


def real_outputs():
    for stem in ("wideresnet-16-4-cifar-100", "lenet-5-cifar-10"):
        data = np.load(DATA_DIR / f"{stem}.npz")
        yield stem, data["predictions"], data["ground_truth"], "probabilities"
    _, _, z, y = digits_logits()
    yield "digits-mlp", z, y, "logits"


def judge(cal, z, y, kind, hold):
    report = nll_report(z[hold], cal.predict_proba(z[hold], kind=kind), y[hold], kind=kind)
    t = report["difference"] / report["standard_error"] if report["standard_error"] else 0.0
    return report, t


def temperature_case(z, y, kind, splits: int, size: int | None, rng) -> dict:
    rejected = worse = 0
    rel, t_max = -np.inf, -np.inf
    for seed in range(splits):
        rows = np.arange(len(y)) if size is None else rng.permutation(len(y))[:size]
        zs, ys = z[rows], y[rows]
        for holdout in HOLDOUTS:
            fit_idx, hold = split_indices(len(ys), holdout, seed)
            cal = calibrators.create("temperature").fit(zs[fit_idx], ys[fit_idx], kind=kind)
            report, t = judge(cal, zs, ys, kind, hold)
            rejected += evaluation.nll_worse(report)
            worse += report["difference"] > 0
            rel = max(rel, report["difference"] / report["before_loss"])
            t_max = max(t_max, t)
    return {"fits": splits * len(HOLDOUTS), "rejected": rejected, "worse": worse,
            "rel": rel, "t": t_max}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=40)
    parser.add_argument("--sizes", default="200,500,1000", help="subset sizes (rows)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s] + [None]
    rng = np.random.default_rng(0)
    print(f"policy: worse by > {evaluation.NLL_RELATIVE_TOLERANCE:.0%} of the raw NLL and "
          f"> {evaluation.NLL_STANDARD_ERRORS:g} standard errors")
    print(f"{'output':28s} {'rows':>6s} {'fits':>5s} {'rejected':>8s} {'worse':>6s} "
          f"{'max rel':>9s} {'max t':>6s}")
    for name, z, y, kind in real_outputs():
        for size in sizes:
            if size is not None and size >= len(y):
                continue
            r = temperature_case(z, y, kind, args.splits if size else 10, size, rng)
            print(f"{name:28s} {size or len(y):6d} {r['fits']:5d} {r['rejected']:8d} "
                  f"{r['worse']:6d} {r['rel']:+9.2%} {r['t']:6.2f}")
    print("\none-hot parameters (vector, weight 1e30), logits_data(n, 4), holdout 0.2:")
    print(f"{'held-out rows':>13s} {'NLL raw':>8s} {'NLL after':>9s} {'t':>6s} rejected")
    for n in (50, 100, 200, 500, 1000, 5000):
        z, y = logits_data(n, 4)
        params = calibrators.create("vector").fit(z, y).to_params()
        cal = calibrators.from_params({**params, "weight": [1e30] * 4})
        _, hold = split_indices(n, 0.2, 0)
        report, t = judge(cal, z, y, "logits", hold)
        print(f"{report['n']:13d} {report['before_loss']:8.3f} {report['after_loss']:9.2f} "
              f"{t:6.1f} {evaluation.nll_worse(report)}")


if __name__ == "__main__":
    main()
