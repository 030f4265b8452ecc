"""ODIR speed: temperature, vector, matrix and Dirichlet scaling with the default
cross-validated penalty search, on N=50,000 x K=100 synthetic logits.

The synthetic "model" distorts Bayes-optimal evidence the way real networks
do, so that each richer calibrator has something to fix: evidence
``u = gaussian + MARGIN * onehot(y)`` is mixed by a fixed matrix ``M`` (a
per-class scale on the diagonal; 50 pairs of classes whose evidence leaks into
each other, i.e. systematic confusions), shifted by a per-class bias and scaled
up (over-confidence)::

    z = SCALE * M u + b0        (float32)

The Bayes-optimal calibrated logits are linear in ``z``, so matrix scaling is
the right family here; temperature and vector scaling are not.

For each method, in one process: fit seconds (ratios to temperature), peak
memory of the fit (tracemalloc: numpy buffers, as a multiple of the input
array), the chosen penalties, L-BFGS evaluations, and NLL / ECE / accuracy on a
separate synthetic test split of the same size. The time of the search is then
broken down: per stage (wall seconds, evaluations), and the cost of one
evaluation of the objective (loss + gradient) at the fold size.

Usage::

    .venv/bin/python bench/odir.py                       # full size
    .venv/bin/python bench/odir.py --n 5000 --k 20       # quick check
    .venv/bin/python bench/odir.py --refine              # the second pass, shared files
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import calibrators
from calibrators.evaluation.metrics import report
from calibrators.methods import _linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.oracles import softmax

#: The shared CIFAR outputs (``--refine``).
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEED = 20240917
SCALE, MARGIN, LEAK = 7.0, 3.5, 0.6
METHODS = ("temperature", "vector", "matrix", "dirichlet")


def make_model(k: int):
    """The fixed distortion (M, b0) of the synthetic model."""
    rng = np.random.default_rng(SEED)
    mix = np.diag(rng.uniform(0.6, 1.4, k))
    bias = rng.normal(0.0, 1.0, k)
    perm = rng.permutation(k)
    for a, b in zip(perm[0::2], perm[1::2], strict=False):
        mix[b, a] = LEAK
        mix[a, b] = LEAK * rng.uniform()
    return mix, bias


def make_logits(n: int, k: int, split: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 logits and labels of one split (0 = fit, 1 = test)."""
    mix, bias = make_model(k)
    rng = np.random.default_rng([SEED, split])
    y = rng.integers(0, k, n)
    u = rng.standard_normal((n, k))
    u[np.arange(n), y] += MARGIN
    return (SCALE * (u @ mix.T) + bias).astype(np.float32), y


def machine() -> str:
    cpu, ram = "?", "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
        with open("/proc/meminfo") as fh:
            ram = f"{int(fh.readline().split()[1]) / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({cpu}), RAM {ram}, Python {platform.python_version()}, "
        f"numpy {np.__version__}; load average {load}"
    )


class StageLog:
    """Records (candidates, seconds, evaluations) of every cross-validation stage.

    Wraps the private ``LinearScaler._cross_validate`` for the breakdown only;
    the fit itself is unchanged.
    """

    def __init__(self):
        self.stages = []
        self.solves = []  # (lam, mu, rows, evaluations, iterations, seconds)
        self._orig = _linear.LinearScaler._cross_validate
        self._orig_solve = _linear._Problem.solve

    def __enter__(self):
        orig, stages, solves, orig_solve = self._orig, self.stages, self.solves, self._orig_solve

        def spy_solve(prob, theta0, **kw):
            t0, e0 = time.perf_counter(), prob.evaluations
            res = orig_solve(prob, theta0, **kw)
            solves.append(
                (
                    prob.lam,
                    prob.mu,
                    prob.n,
                    prob.evaluations - e0,
                    int(res.nit),
                    time.perf_counter() - t0,
                )
            )
            return res

        def spy(scaler, feats, y, fold_of, candidates, warm, progress):
            t0 = time.perf_counter()
            out = orig(scaler, feats, y, fold_of, candidates, warm, progress)
            stages.append((len(out[0]), time.perf_counter() - t0, out[2]))  # candidates tried
            return out

        _linear.LinearScaler._cross_validate = spy
        _linear._Problem.solve = spy_solve
        return self

    def __exit__(self, *exc):
        _linear.LinearScaler._cross_validate = self._orig
        _linear._Problem.solve = self._orig_solve
        return False


def fit_one(method, z, y, *, trace_memory: bool):
    cal = calibrators.create(method)
    if trace_memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
    with StageLog() as log:
        t0 = time.perf_counter()
        cal.fit(z, y)
        seconds = time.perf_counter() - t0
    peak = None
    if trace_memory:
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        peak = top - start
    return cal, seconds, peak, log


def eval_cost(feats: np.ndarray, y: np.ndarray, structure: str, repeats: int = 20) -> float:
    """Seconds of one loss+gradient evaluation (one BLAS thread, as inside the search)."""
    prob = _linear._Problem(feats, y, structure, 100.0, 100.0)
    theta = prob.initial()
    best = math.inf
    with threadpool_limits(limits=1, user_api="blas"):
        for _ in range(repeats):
            t0 = time.perf_counter()
            prob(theta)
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000, help="rows of the fit split (and test)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--no-tracemalloc",
        action="store_true",
        help="skip the memory tracing (it costs a little time)",
    )
    ap.add_argument("--refine", action="store_true",
                    help="instead: the search with and without a second pass on the shared files")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --refine")
    args = ap.parse_args(argv)
    if args.refine:
        refine(["wideresnet-16-4-cifar-100", "lenet-5-cifar-10"], args.rounds, math.sqrt(10))
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    print(f"machine: {machine()}")
    print(
        f"threads: WELLTEMPERED_THREADS={os.environ.get('WELLTEMPERED_THREADS', '-')}, "
        f"calibrators n_threads()={calibrators.numerics.n_threads()}"
    )
    z, y = make_logits(args.n, args.k, 0)
    zt, yt = make_logits(args.n, args.k, 1)
    print(f"data: fit {z.shape} float32 ({z.nbytes / 2**20:.1f} MiB), test {zt.shape}; seed {SEED}")
    raw = report(softmax(zt), yt)
    rows = [("uncalibrated", None, None, raw, None, None)]
    breakdowns = {}
    for method in methods:
        cal, seconds, peak, log = fit_one(method, z, y, trace_memory=not args.no_tracemalloc)
        rep = report(cal.predict_proba(zt), yt)
        rows.append((method, seconds, peak, rep, cal.fit_info_, log))
        breakdowns[method] = (seconds, log, cal.fit_info_)
        print(f"  fitted {method}: {seconds:.2f} s, test NLL {rep['nll']:.4f}", flush=True)

    base = next((r[1] for r in rows if r[0] == "temperature"), None)
    print()
    print(
        f"{'method':12s} {'seconds':>8s} {'x temp':>7s} {'peak mem':>15s} {'lambda':>7s} "
        f"{'mu':>7s} {'evals':>6s} {'conv':>5s} {'test NLL':>9s} {'ECE':>7s} {'acc':>7s}"
    )
    for method, seconds, peak, rep, info, _ in rows:
        if info is None:
            sec = ratio = mem = lam = mu = evals = conv = "-"
        else:
            sec = f"{seconds:.2f}"
            ratio = f"{seconds / base:.0f}" if base else "-"
            mem = "-" if peak is None else f"{peak / 2**20:.0f} MiB {peak / z.nbytes:.1f}x"
            lam = _fmt(info.get("reg_lambda"))
            mu = _fmt(info.get("reg_mu"))
            evals = str(info.get("evaluations", info.get("passes", "-")))
            conv = "yes" if info.get("converged", info.get("reason") == "converged") else "no"
        print(
            f"{method:12s} {sec:>8s} {ratio:>7s} {mem:>15s} {lam:>7s} {mu:>7s} {evals:>6s} "
            f"{conv:>5s} {rep['nll']:9.4f} {rep['ece']:7.4f} {rep['accuracy']:7.4f}"
        )
    print(
        "(peak mem: tracemalloc peak during fit, as a multiple of the float32 input; "
        "evals: L-BFGS loss+gradient evaluations over the whole search, or data passes "
        "for temperature)"
    )

    print()
    print("where the time goes (cross-validation stages, then the final refit):")
    n_folds = 3
    for method, (seconds, log, info) in breakdowns.items():
        if method == "temperature":
            continue
        stages = log.stages
        structure = "full" if method in ("matrix", "dirichlet") else "diagonal"
        feats = z.astype(np.float64)
        if method == "dirichlet":
            feats -= feats.max(axis=1, keepdims=True)
            feats -= np.log(np.exp(feats).sum(axis=1, keepdims=True))
        fold = feats[: args.n * (n_folds - 1) // n_folds]
        cost_fold = eval_cost(fold, y[: fold.shape[0]], structure)
        cost_full = eval_cost(feats, y, structure)
        cv_evals = sum(s[2] for s in stages)
        cv_secs = sum(s[1] for s in stages)
        final_evals = info["evaluations"] - cv_evals
        print(
            f"  {method}: total {seconds:.2f} s; one evaluation costs {cost_fold * 1e3:.1f} ms "
            f"at fold size ({fold.shape[0]} rows), {cost_full * 1e3:.1f} ms on all rows "
            "(1 BLAS thread)"
        )
        names = ["mu"] if structure == "diagonal" else ["lambda (mu tied)", "mu (lambda fixed)"]
        for name, (cands, secs, evals) in zip(names, stages, strict=False):
            per_fit = evals / (cands * n_folds)
            print(
                f"    stage {name}: {cands} candidates x {n_folds} folds: {secs:.2f} s, "
                f"{evals} evaluations ({per_fit:.0f} per fit), "
                f"{secs / max(evals, 1) * 1e3:.1f} ms wall per evaluation "
                f"(~{evals * cost_fold:.1f} s of single-thread evaluation work)"
            )
        print(
            "    per candidate (mean over folds): lambda, mu: evaluations, seconds of one fit;"
            " CV NLL"
        )
        cv = {}
        for c in (info.get("cross_validation") or {}).get("candidates", []):
            cv.setdefault((c["reg_lambda"], c["reg_mu"]), c["cv_nll"])
        folds = [s for s in log.solves if s[2] < args.n]  # fold fits, not the refit
        for lam, mu in dict.fromkeys((s[0], s[1]) for s in folds):
            these = [s for s in folds if (s[0], s[1]) == (lam, mu)]
            score = cv.get((lam if structure == "full" else None, mu))
            print(
                f"      {_fmt(lam) if structure == 'full' else '-':>7s}, {_fmt(mu):>7s}: "
                f"{np.mean([s[3] for s in these]):6.0f} evals, "
                f"{np.mean([s[5] for s in these]):6.2f} s"
                + ("" if score is None else f"; CV NLL {score:.5f}")
            )
        rest = seconds - cv_secs
        print(
            f"    final refit + features: {rest:.2f} s, {final_evals} evaluations, "
            f"{info['iterations']} iterations, {info['message']!r}"
        )

    print(f"machine at the end: {machine()}")


def refine(files: list[str], rounds: int, factor: float) -> None:
    """Item 5 of issue 11: the search with and without ``_linear.REFINE_FACTOR``.

    Vector, matrix and Dirichlet scaling on the shared files (the shared split: fit on
    the first half of ``default_rng(0).permutation(N)``, held-out NLL on the rest),
    each fitted ``rounds`` times per setting, the settings interleaved within each
    round; the fastest round of each is kept. The change of the held-out NLL is
    printed with the standard error of the mean paired per-row difference.
    """
    from calibrators.evaluation.holdout import split_indices
    from calibrators.evaluation.metrics import nll_loss

    default = _linear.REFINE_FACTOR
    print(f"machine: {machine()}")
    print(f"refine: second pass at x{factor:.4g} and /{factor:.4g} around each stage's choice")
    print("| data | method | pass | held-out NLL | refined - coarse (SE) | fit s (best) | "
          "fit s (rounds) | lambda | mu | evaluations |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for stem in files:
        with np.load(DATA / f"{stem}.npz") as data:
            probs, labels = data["predictions"], data["ground_truth"]
        fit, test = split_indices(len(labels), 0.5, seed=0)
        (x, y), (xt, yt) = (probs[fit], labels[fit]), (probs[test], labels[test])
        for method in ("vector", "matrix", "dirichlet"):
            times = {None: [], factor: []}
            fits = {}
            for _ in range(rounds):
                for setting in (None, factor):
                    _linear.REFINE_FACTOR = setting
                    t0 = time.perf_counter()
                    fits[setting] = calibrators.create(method).fit(x, y, kind="probabilities")
                    times[setting].append(time.perf_counter() - t0)
            _linear.REFINE_FACTOR = default
            per_row = {}
            for setting in (None, factor):
                cal, info = fits[setting], fits[setting].fit_info_
                p = cal.predict_proba(xt, kind="probabilities")
                per_row[setting] = -np.log(np.maximum(p[np.arange(len(yt)), yt], 1e-300))
                nll = nll_loss(p, yt)
                name = "coarse" if setting is None else "refined"
                change = ""
                if setting is not None:  # the paired difference and its standard error
                    diff = per_row[factor] - per_row[None]
                    change = f"{diff.mean():+.5f} ({diff.std(ddof=1) / np.sqrt(len(diff)):.5f})"
                print(f"| {stem} | {method} | {name} | {nll:.5f} | {change} | "
                      f"{min(times[setting]):.3f} | "
                      f"{', '.join(f'{t:.2f}' for t in times[setting])} | "
                      f"{_fmt(info['reg_lambda'])} | {_fmt(info['reg_mu'])} | "
                      f"{info['evaluations']} |", flush=True)
    print(f"machine at the end: {machine()}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:g}"


if __name__ == "__main__":
    main()
