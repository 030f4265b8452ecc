"""How ``auto`` should choose: selection rules compared on the 5-split protocol (issue 21).

For each shared file and seed 0 to 4 (``split_indices(N, 0.5, seed)``: fit half, test
half), every candidate of ``auto`` under ``off`` is fitted

* on the whole fit half, and scored on the test half (the single method's figure,
  and what a refit serves);
* without each part of :func:`calibrators.evaluation.holdout.fold_indices` of the fit
  half at ``auto``'s defaults (holdout 0.2, seed 0: five parts of 1,000 rows, the
  first the job's own hold-out), scored per row on that part and on the test half.

A rule sees only the fit half's per-row NLLs and picks a method per seed; it is
scored by what it would serve on the test half. The rules:

* ``one hold-out``: the lowest NLL on the first part (``auto`` before the race),
  served as fitted without that part, or refitted on the whole fit half;
* ``race z``: :func:`service.jobs.selection.race` with the drop threshold ``z``
  (``inf``: every candidate on every part, 5-fold cross-validation; ``0``: one
  hold-out), refitted;
* ``fewest params``: among the candidates within one standard error (paired
  per-row differences) of the best, the one with the fewest fitted parameters, on
  the first part or on all five.

The race is run again with the parts after the first in the reverse order: a
threshold that keeps its choice however the further folds come is the safer one.

Cost: the fits a rule needs (every candidate on the first part, the race's further
fits, the refit) and their seconds (measured here, under whatever load the machine
has: see the load printed). The fits are cached in ``--cache`` (per-row NLLs), so
the rules can be changed without fitting again.

Usage::

    .venv/bin/python bench/auto_choice.py --cache /tmp/auto | tee bench/results/auto_choice.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrators
from calibrators.evaluation.holdout import DEFAULT_HOLDOUT, fold_indices, split_indices
from calibrators.evaluation.metrics import nll_per_row
from service.jobs import selection
from service.jobs.fitting import auto_candidates

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEEDS = (0, 1, 2, 3, 4)
CANDIDATES = auto_candidates("off")


def fitted(cache: Path, p, y, rows, scored: dict, m: str) -> dict:
    """``m`` fitted on ``rows`` of ``p``; its per-row NLL on each of ``scored``."""
    path = cache / f"{m}.npz"
    if path.exists():
        with np.load(path) as f:
            return dict(f)
    started = time.perf_counter()
    cal = calibrators.create(m).fit(p[rows], y[rows], kind="probabilities")
    out = {"sec": time.perf_counter() - started}
    for name, idx in scored.items():
        out[name] = nll_per_row(cal.predict_proba(p[idx], kind="probabilities"), y[idx])
    params = cal.to_params()
    out["n_params"] = sum(np.asarray(params[k]).size for k in type(cal).fitted_arrays
                          if params.get(k) is not None)
    np.savez(path, **out)
    return out


def gather(path: Path, cache: Path) -> list[dict]:
    """Per seed: ``full[m]`` and ``parts[r][m]`` (see the module docstring)."""
    with np.load(path) as f:
        p, y = f["predictions"], f["ground_truth"]
    seeds = []
    for seed in SEEDS:
        fit, test = split_indices(len(y), 0.5, seed=seed)
        parts = fold_indices(len(fit), DEFAULT_HOLDOUT, 0, max_folds=selection.MAX_FOLDS)
        here = cache / path.stem / f"seed{seed}"
        full, by_part = {}, []
        for r, part in enumerate(parts):
            keep = np.ones(len(fit), dtype=bool)
            keep[part] = False
            (here / f"part{r}").mkdir(parents=True, exist_ok=True)
            by_part.append({m: fitted(here / f"part{r}", p, y, fit[keep],
                                      {"held": fit[part], "test": test}, m)
                            for m in CANDIDATES})
        (here / "full").mkdir(parents=True, exist_ok=True)
        full = {m: fitted(here / "full", p, y, fit, {"test": test}, m) for m in CANDIDATES}
        seeds.append({"full": full, "parts": by_part})
        print(f"  {path.stem} seed {seed} fitted", file=sys.stderr, flush=True)
    return seeds


def race_rule(s: dict, z: float, reverse: bool = False) -> tuple[str, int, float]:
    """The race's choice with threshold ``z``, its fits (the refit included) and seconds;
    with ``reverse``, the parts after the first in the reverse order (other folds, the
    same rows)."""
    parts = s["parts"]
    if reverse:
        parts = [parts[0], *parts[:0:-1]]
    fits = len(CANDIDATES)
    secs = sum(float(parts[0][m]["sec"]) for m in CANDIDATES)

    def score(m: str, r: int) -> np.ndarray:
        nonlocal fits, secs
        fits += 1
        secs += float(parts[r][m]["sec"])
        return parts[r][m]["held"]

    chosen, _ = selection.race({m: parts[0][m]["held"] for m in CANDIDATES}, score,
                               len(parts), standard_errors=z)
    return chosen, fits + 1, secs + float(s["full"][chosen]["sec"])


def fewest_params(s: dict, n_parts: int) -> str:
    rows = {m: np.concatenate([s["parts"][r][m]["held"] for r in range(n_parts)])
            for m in CANDIDATES}
    best = min(CANDIDATES, key=lambda m: rows[m].mean())
    near = [m for m in CANDIDATES
            if (lambda d, se: d <= se)(*selection.paired_difference(rows[m], rows[best]))]
    return min(near, key=lambda m: int(s["full"][m]["n_params"]))


def run_file(path: Path, cache: Path) -> None:
    seeds = gather(path, cache)
    single = {m: np.mean([s["full"][m]["test"].mean() for s in seeds]) for m in CANDIDATES}
    best = min(single, key=single.get)
    print(f"\n## {path.name}: best single method {best} {single[best]:.4f} "
          f"(5-split mean held-out NLL); fitted parameters: "
          + ", ".join(f"{m} {int(seeds[0]['full'][m]['n_params'])}" for m in CANDIDATES))
    print(f"{'rule':<40} {'test NLL mean [min, max]':<26} {'- best':>8} {'fits':>5} "
          f"{'fit s':>7}  chosen per seed")
    one = len(CANDIDATES)
    one_secs = [sum(float(s["parts"][0][m]["sec"]) for m in CANDIDATES) for s in seeds]

    def line(name, picks, served, fits, secs):
        v = np.asarray(served)
        print(f"{name:<40} {v.mean():.4f} [{v.min():.4f}, {v.max():.4f}] "
              f"{v.mean() - single[best]:>+8.4f} {np.mean(fits):>5.1f} {np.mean(secs):>7.2f}  "
              + " ".join(picks))

    picks = [min(CANDIDATES, key=lambda m, s=s: s["parts"][0][m]["held"].mean()) for s in seeds]
    line("one hold-out, no refit", picks,
         [s["parts"][0][m]["test"].mean() for s, m in zip(seeds, picks, strict=True)],
         [one] * len(seeds), one_secs)
    line("one hold-out, refit", picks,
         [s["full"][m]["test"].mean() for s, m in zip(seeds, picks, strict=True)],
         [one + 1] * len(seeds),
         [t + float(s["full"][m]["sec"]) for s, m, t in zip(seeds, picks, one_secs, strict=True)])
    for z in (1.0, 1.5, 2.0, 3.0, np.inf):
        raced = [race_rule(s, z) for s in seeds]
        name = "5-fold CV (race z=inf), refit" if np.isinf(z) else f"race z={z:g}, refit"
        if z == selection.DROP_STANDARD_ERRORS:
            name += " (auto)"
        line(name, [r[0] for r in raced],
             [s["full"][r[0]]["test"].mean() for s, r in zip(seeds, raced, strict=True)],
             [r[1] for r in raced], [r[2] for r in raced])
    for z in (1.0, 2.0):
        raced = [race_rule(s, z, reverse=True) for s in seeds]
        line(f"race z={z:g}, refit, folds 2-5 reversed", [r[0] for r in raced],
             [s["full"][r[0]]["test"].mean() for s, r in zip(seeds, raced, strict=True)],
             [r[1] for r in raced], [r[2] for r in raced])
    for n_parts, label in ((1, "one hold-out"), (len(seeds[0]["parts"]), "5 folds")):
        picks = [fewest_params(s, n_parts) for s in seeds]
        line(f"fewest params within 1 SE, {label}", picks,
             [s["full"][m]["test"].mean() for s, m in zip(seeds, picks, strict=True)],
             [one * n_parts + 1] * len(seeds),
             [sum(float(s["parts"][r][m]["sec"]) for r in range(n_parts) for m in CANDIDATES)
              + float(s["full"][pick]["sec"]) for s, pick in zip(seeds, picks, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=None,
                        help="file names in ../shared/data (default: every .npz there)")
    parser.add_argument("--cache", type=Path, required=True,
                        help="folder of the fits' per-row NLLs (made if missing; reused)")
    args = parser.parse_args()
    files = [DATA / f for f in args.files] if args.files else sorted(DATA.glob("*.npz"))
    print("# bench/auto_choice.py")
    print(f"start: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for path in files:
        run_file(path, args.cache)
    print(f"\nend: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"drop_standard_errors": selection.DROP_STANDARD_ERRORS,
                      "max_folds": selection.MAX_FOLDS}))


if __name__ == "__main__":
    main()
