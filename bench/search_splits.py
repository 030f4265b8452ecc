"""Every method, and ``auto``, against temperature scaling on the 5-split protocol (issue 21).

For each shared file and each seed 0 to 4: ``perm = default_rng(seed).permutation(N)``
(:func:`calibrators.evaluation.holdout.split_indices` at ``holdout=0.5``), fit on the first
half with the method's defaults, and score the mean NLL of the held-out second half.
``auto`` is the service's fit job as a user gets it (``method="auto"``,
``argmax_policy="off"``, its default inner hold-out, seed and refit) run on the fit
half: it races the candidates over folds of the fit half and serves its choice
fitted on the whole fit half, scored on the same held-out half (``--no-refit``:
served as fitted without the inner hold-out). The best candidate per split (the
lowest held-out NLL of the single methods on each split) is printed too.

Prints, per file, each method's mean [min, max] over the seeds, its mean minus
temperature's (the goal: <= +0.002 for every method), the number of seeds on which
it loses to temperature, the penalties its search chose and its mean fit seconds;
then ``auto``'s mean against the best single method's (the goal: within 0.002).

Usage::

    .venv/bin/python bench/search_splits.py | tee bench/results/search_splits.txt
    .venv/bin/python bench/search_splits.py --files lenet-5-cifar-10.npz --methods vector
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import calibrators
from calibrators.evaluation.holdout import split_indices
from service.jobs.fitting import fit_job

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEEDS = (0, 1, 2, 3, 4)
#: What each method's search chose, from its fit_info (absent keys are skipped).
CHOICES = ("reg_lambda", "reg_mu", "reg", "multipliers")


def held_out_nll(cal, p, y) -> float:
    q = cal.predict_proba(p, kind="probabilities")
    return float(-np.mean(np.log(q[np.arange(len(y)), y])))


def choice(info: dict) -> str:
    parts = []
    for key in CHOICES:
        value = info.get(key)
        if isinstance(value, dict):
            value = ",".join(f"{v:g}" for v in value.values() if isinstance(v, int | float))
        elif isinstance(value, int | float):
            value = f"{value:g}"
        else:
            continue
        parts.append(f"{key}={value}")
    return " ".join(parts)


def summary(values) -> str:
    v = np.asarray(values)
    return f"{v.mean():.4f} [{v.min():.4f}, {v.max():.4f}]"


def run_file(path: Path, methods, with_auto: bool, refit: bool | None) -> None:
    with np.load(path) as f:
        p, y = f["predictions"], f["ground_truth"]
    print(f"\n## {path.name}: {p.shape[0]:,} x {p.shape[1]}")
    nll = {m: [] for m in methods}
    secs = {m: [] for m in methods}
    chosen = {m: [] for m in methods}
    auto, auto_pick, auto_secs = [], [], []
    for seed in SEEDS:
        fit, test = split_indices(len(y), 0.5, seed=seed)
        for m in methods:
            started = time.perf_counter()
            cal = calibrators.create(m).fit(p[fit], y[fit], kind="probabilities")
            secs[m].append(time.perf_counter() - started)
            nll[m].append(held_out_nll(cal, p[test], y[test]))
            chosen[m].append(choice(cal.fit_info_ or {}))
        if with_auto:
            started = time.perf_counter()
            job = fit_job(p[fit], y[fit], kind="probabilities", method="auto", holdout=0.2,
                          seed=0, options={}, argmax_policy="off", refit=refit)
            auto_secs.append(time.perf_counter() - started)
            auto.append(held_out_nll(calibrators.from_params(job["params"]), p[test], y[test]))
            auto_pick.append(job["chosen_method"])
    base = np.asarray(nll.get("temperature", [np.nan] * len(SEEDS)))
    print(f"{'method':<12} {'held-out NLL mean [min, max]':<30} {'- temp':>8} {'losses':>6} "
          f"{'fit s':>7}  chosen penalties per seed")
    for m in methods:
        v = np.asarray(nll[m])
        print(f"{m:<12} {summary(v):<30} {v.mean() - base.mean():>+8.4f} "
              f"{int(np.sum(v > base + 1e-12)):>4}/5 {np.mean(secs[m]):>7.2f}  "
              + " | ".join(chosen[m]))
    best = min(methods, key=lambda m: np.mean(nll[m]))
    per_split = np.min([nll[m] for m in methods], axis=0)
    print(f"best candidate per split (a choice that knew the held-out labels): "
          f"{summary(per_split)}, {per_split.mean() - np.mean(nll[best]):+.4f} against {best}")
    if with_auto:
        a = np.asarray(auto)
        label = "auto" if refit is None else "auto no refit"
        print(f"{label:<12} {summary(a):<30} {a.mean() - base.mean():>+8.4f} "
              f"{int(np.sum(a > base + 1e-12)):>4}/5 {np.mean(auto_secs):>7.2f}  "
              + " | ".join(auto_pick))
        print(f"auto - best single method ({best}, {np.mean(nll[best]):.4f}): "
              f"{a.mean() - np.mean(nll[best]):+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=None,
                        help="file names in ../shared/data (default: every .npz there)")
    parser.add_argument("--methods", nargs="*", default=None,
                        help="methods (default: all; temperature is always included)")
    parser.add_argument("--no-auto", action="store_true", help="leave out auto")
    parser.add_argument("--no-refit", action="store_true",
                        help="auto serves its choice as fitted without the inner hold-out "
                        "(the fit request's refit false); default: the service's, refitted "
                        "on the whole fit half")
    args = parser.parse_args()
    files = [DATA / f for f in args.files] if args.files else sorted(DATA.glob("*.npz"))
    methods = tuple(args.methods or calibrators.METHODS)
    if "temperature" not in methods:
        methods = ("temperature", *methods)
    print("# bench/search_splits.py")
    print(f"start: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for path in files:
        run_file(path, methods, with_auto=not args.no_auto and args.methods is None,
                 refit=False if args.no_refit else None)
    print(f"\nend: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
