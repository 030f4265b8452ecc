"""lenet-5's 1.2818 goal (issue 11): averages of calibrators weighted by the fit half alone.

On the shared split (fit on the first half of ``default_rng(0).permutation(10000)``,
held-out NLL on the other half), per shared file:

1. every method listed, fitted with its defaults on the fit half: held-out NLL;
2. out-of-fold probabilities on the fit half: the fit half's rows dealt into
   ``--folds`` folds (seed 0), each method fitted on the other folds (its defaults,
   its own penalty search inside) and applied to the fold's rows;
3. weights chosen on those out-of-fold probabilities only (convex problems, solved
   exactly), then applied to the methods fitted on the whole fit half:

   * ``linear pool``: ``p = sum_m w_m p_m``, ``w`` on the simplex;
   * ``log pool``: ``p = softmax(sum_m w_m log p_m)``, ``w >= 0`` (a temperature
     comes with it: the weights need not sum to 1);

4. bagging: the mean of the fold models' probabilities (each fitted on
   ``(F - 1) / F`` of the fit half) against the one model fitted on all of it;
5. ``--exact-cv``: sms's penalty search with every fold scored and every fit solved
   to 1e-9 (not ``CV_TOL``), the whole grid walked, repeated over 5 fold seeds, and
   with 10 folds: where the fit half's exact CV minimum lies (module constants of
   :mod:`calibrators.methods._structured` set for the experiment only).

The test half's labels are used only to score what the fit half chose.

Usage::

    .venv/bin/python bench/stacking.py --files lenet-5-cifar-10.npz --exact-cv \\
        | tee bench/results/stacking.txt
    .venv/bin/python bench/stacking.py --files lenet-5-cifar-10.npz --methods sms dirichlet
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

import calibrators
from calibrators.evaluation.holdout import split_indices
from calibrators.solvers.crossval import fold_assignment

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FILES = ("lenet-5-cifar-10.npz", "wideresnet-16-4-cifar-100.npz")
METHODS = ("temperature", "vector", "matrix", "dirichlet", "svs", "sms", "pts", "iop")
TINY = 1e-300


def nll(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    return -np.log(np.maximum(p[np.arange(len(y)), y], TINY))


def fit_predict(method: str, p_fit, y_fit, p_apply) -> np.ndarray:
    cal = calibrators.create(method).fit(p_fit, y_fit, kind="probabilities")
    return cal.predict_proba(p_apply, kind="probabilities")


def linear_pool(oof: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Simplex weights minimising the mean NLL of ``sum_m w_m p_m`` (oof: M x N x K)."""
    py = oof[:, np.arange(len(y)), y].T  # N x M: each method's probability of the label
    m = py.shape[1]

    def f(a):  # softmax parametrisation of the simplex
        w = np.exp(a - a.max())
        w /= w.sum()
        mix = py @ w
        loss = -np.mean(np.log(np.maximum(mix, TINY)))
        gw = -np.mean(py / mix[:, None], axis=0)
        return loss, w * (gw - w @ gw)

    res = minimize(f, np.zeros(m), jac=True, method="L-BFGS-B", options={"gtol": 1e-10})
    w = np.exp(res.x - res.x.max())
    return w / w.sum()


def log_pool(oof: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weights ``w >= 0`` minimising the mean NLL of ``softmax(sum_m w_m log p_m)``."""
    logs = np.log(np.maximum(oof, TINY))  # M x N x K
    n = len(y)

    def f(w):
        u = np.tensordot(w, logs, axes=1)
        u -= u.max(axis=1, keepdims=True)
        e = np.exp(u)
        s = e.sum(axis=1)
        q = e / s[:, None]
        loss = float(np.mean(np.log(s) - u[np.arange(n), y]))
        g = np.einsum("mnk,nk->m", logs, q) / n - logs[:, np.arange(n), y].mean(axis=1)
        return loss, g

    m = len(oof)
    res = minimize(f, np.full(m, 1.0 / m), jac=True, method="L-BFGS-B",
                   bounds=[(0.0, None)] * m, options={"gtol": 1e-10, "ftol": 1e-14})
    return res.x


def apply_log_pool(w, probs):
    u = np.tensordot(w, np.log(np.maximum(probs, TINY)), axes=1)
    u -= u.max(axis=1, keepdims=True)
    e = np.exp(u)
    return e / e.sum(axis=1, keepdims=True)


def paired(a: np.ndarray, b: np.ndarray) -> str:
    d = a - b
    return f"{d.mean():+.5f} (SE {d.std(ddof=1) / np.sqrt(len(d)):.5f})"


def bench_file(path: Path, methods, folds: int) -> None:
    with np.load(path) as data:
        p, y = data["predictions"], data["ground_truth"]
    first, second = split_indices(len(y), 0.5, seed=0)
    pf, yf, pt, yt = p[first], y[first], p[second], y[second]
    print(f"\n## {path.name}: fit on {len(yf)} rows, held-out {len(yt)}, K = {p.shape[1]}")
    started = time.perf_counter()
    test = {m: fit_predict(m, pf, yf, pt) for m in methods}
    rows = {m: nll(test[m], yt) for m in methods}
    print(f"\n1. each method, defaults (held-out NLL; {time.perf_counter() - started:.1f} s)")
    for m in methods:
        print(f"   {m:<12} {rows[m].mean():.5f}")
    best = min(methods, key=lambda m: rows[m].mean())

    started = time.perf_counter()
    fold_of = fold_assignment(len(yf), folds, 0)
    oof = np.empty((len(methods), *pf.shape))
    bagged = {m: np.zeros(pt.shape) for m in methods}
    for f in range(folds):
        train, held = fold_of != f, fold_of == f
        for i, m in enumerate(methods):
            cal = calibrators.create(m).fit(pf[train], yf[train], kind="probabilities")
            oof[i, held] = cal.predict_proba(pf[held], kind="probabilities")
            bagged[m] += cal.predict_proba(pt, kind="probabilities") / folds
    print(f"\n2. out-of-fold NLL on the fit half ({folds} folds; "
          f"{time.perf_counter() - started:.1f} s)")
    for i, m in enumerate(methods):
        print(f"   {m:<12} {nll(oof[i], yf).mean():.5f}")

    print("\n3. weights chosen on the out-of-fold probabilities, applied to the full-half fits")
    stack = np.stack([test[m] for m in methods])
    w_lin = linear_pool(oof, yf)
    lin = nll(np.tensordot(w_lin, stack, axes=1), yt)
    w_log = log_pool(oof, yf)
    log = nll(apply_log_pool(w_log, stack), yt)
    for name, w, r, o in (
        ("linear pool", w_lin, lin, nll(np.tensordot(w_lin, oof, axes=1), yf)),
        ("log pool", w_log, log, nll(apply_log_pool(w_log, oof), yf)),
    ):
        weights = ", ".join(f"{m} {v:.3f}" for m, v in zip(methods, w, strict=True) if v > 5e-4)
        print(f"   {name:<12} held-out {r.mean():.5f} (against {best}: {paired(r, rows[best])}); "
              f"out-of-fold {o.mean():.5f}; weights {weights}")

    print("\n4. bagging: the mean of the fold models against the full-half fit")
    for m in methods:
        r = nll(bagged[m], yt)
        print(f"   {m:<12} bagged {r.mean():.5f}, one fit {rows[m].mean():.5f}: "
              f"{paired(r, rows[m])}")


def exact_cv(path: Path) -> None:
    from calibrators.methods import _structured as structured

    with np.load(path) as data:
        p, y = data["predictions"], data["ground_truth"]
    first, second = split_indices(len(y), 0.5, seed=0)
    pf, yf, pt, yt = p[first], y[first], p[second], y[second]
    grid = (4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 1 / 16)
    saved = {k: getattr(structured, k) for k in ("SMS_SCORED_FOLDS", "PATIENCE", "CV_TOL",
                                                 "FOLD_SEED")}
    print(f"\n5. {path.name}: sms, exact CV on the fit half (every fold scored, fits to "
          "1e-9, the whole grid), held-out NLL of each fixed multiplier beside it")
    held = {}
    for m in grid:
        cal = calibrators.create("sms", reg_off_diagonal=m, reg_diagonal=m, reg_intercept=m)
        held[m] = nll(cal.fit(pf, yf, kind="probabilities").predict_proba(
            pt, kind="probabilities"), yt).mean()
    try:
        structured.SMS_SCORED_FOLDS, structured.PATIENCE, structured.CV_TOL = 99, 99, 1e-9
        curves = []
        for folds, seeds in ((4, range(5)), (10, (0,))):
            for seed in seeds:
                structured.FOLD_SEED = seed
                cal = calibrators.create("sms", grid=grid, n_folds=folds, tol=1e-9)
                cv = cal.fit(pf, yf, kind="probabilities").fit_info_["cross_validation"]
                curve = [c["cv_nll"] for c in cv["candidates"]]
                if folds == 4:
                    curves.append(curve)
                print(f"   {folds:>2} folds, seed {seed}: " + " ".join(
                    f"{g:g}:{c:.5f}" for g, c in zip(grid, curve, strict=True))
                    + f"  -> {grid[int(np.argmin(curve))]:g}")
        mean = np.mean(curves, axis=0)
        print("   mean of the 5 seeds: " + " ".join(
            f"{g:g}:{c:.5f}" for g, c in zip(grid, mean, strict=True))
            + f"  -> {grid[int(np.argmin(mean))]:g}")
    finally:
        for k, v in saved.items():
            setattr(structured, k, v)
    print("   held-out NLL at each multiplier: " + " ".join(
        f"{g:g}:{held[g]:.5f}" for g in grid))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--exact-cv", action="store_true", help="section 5 (sms)")
    args = parser.parse_args()
    print(f"# bench/stacking.py --files {' '.join(args.files)} --methods "
          f"{' '.join(args.methods)} --folds {args.folds}" + " --exact-cv" * args.exact_cv)
    print(f"start: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name in args.files:
        bench_file(DATA / name, args.methods, args.folds)
        if args.exact_cv:
            exact_cv(DATA / name)
    print(f"\nend: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
