"""Temperature scaling speed: ours vs the floor vs scikit-learn vs the torch recipe.

Everything is measured in one process, on one float32 array of synthetic,
over-confident logits (N x K, default 200,000 x 1,000; optimal T about 2),
and reported as ratios (see ../STYLE point 15 in the shared notes):

* floor: one lean float32 numpy logsumexp pass over the array,
  ``m = z.max(1, keepdims=True); np.log(np.exp(z - m).sum(1)) + m[:, 0]``;
* ours: ``calibrators.TemperatureScaler().fit(z, y)``;
* scikit-learn 1.9: ``CalibratedClassifierCV(FrozenEstimator(clf), method="temperature")``
  where ``clf.decision_function`` returns the precomputed logits (the
  documented way to calibrate an already-fitted model), and the
  ``sklearn.calibration._TemperatureScaling`` it runs inside, called directly;
* torch, "the common way" (Guo et al.'s ``temperature_scaling.py``):
  ``nn.Parameter`` T = 1.5, ``optim.LBFGS([t], lr=0.01, max_iter=50)``, one
  closure of ``CrossEntropyLoss(z / t, y)`` over the full float32 data; plus
  the same with ``line_search_fn="strong_wolfe"`` (torch used well) for context.

NLL is recomputed for every method by the same float64 routine. "peak extra"
is the peak resident memory during the call minus the resident memory before
it (Linux ``/proc/self/clear_refs`` resets the peak), as a fraction of the
array's size; for ours it is cross-checked with ``tracemalloc`` (numpy reports
its buffers to it).

Usage::

    .venv/bin/python bench/temperature.py                 # full size (~5 min)
    .venv/bin/python bench/temperature.py --n 20000 --k 200 --skip-torch   # quick
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

import calibrators
from calibrators.methods import temperature as _temperature_module

SEED = 20240917
# Synthetic model: logits = SCALE * (gaussian + MARGIN on the predicted class);
# the predicted class is the true label with probability HIT, else uniform.
# With these numbers the NLL-optimal temperature is about 2 (over-confident).
SCALE, MARGIN, HIT = 3.25, 5.0, 0.7
#: Floor calls before the measured rounds (printed, not used).
WARM_UP_FLOORS = 4


# -- data -------------------------------------------------------------------
def make_logits(n: int, k: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Over-confident float32 logits (n, k) and int64 labels, built in row chunks.

    Generated chunk by chunk straight into the float32 array, so building it
    needs no float64 temporary the size of the array.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    pred = np.where(rng.random(n) < HIT, y, rng.integers(0, k, n))
    z = np.empty((n, k), dtype=np.float32)
    step = max(1, (1 << 20) // k)
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        block = rng.standard_normal((rows.stop - rows.start, k), dtype=np.float32)
        block[np.arange(block.shape[0]), pred[rows]] += MARGIN
        block *= SCALE
        z[rows] = block
    return z, y


def nll64(z: np.ndarray, y: np.ndarray, beta: float) -> float:
    """Mean NLL of softmax(beta * z) in float64, in row chunks (the common yardstick)."""
    total = 0.0
    step = max(1, (1 << 18) // z.shape[1])
    for start in range(0, z.shape[0], step):
        c = beta * z[start : start + step].astype(np.float64)
        m = c.max(axis=1)
        lse = np.log(np.exp(c - m[:, None]).sum(axis=1)) + m
        total += float(np.sum(lse - c[np.arange(c.shape[0]), y[start : start + step]]))
    return total / z.shape[0]


# -- measurement ------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """Peak resident memory of a block above the resident memory before it (bytes)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset VmHWM to the current VmRSS
            self.before = _status_kib("VmRSS")
        except OSError:
            self.before = None
        return self

    def __exit__(self, *exc):
        peak = _status_kib("VmHWM")
        self.extra = None if self.before is None or peak is None else (peak - self.before) * 1024
        return False


def measure(fn):
    """One call: (wall seconds, process CPU seconds of all threads, result, peak extra RSS)."""
    with PeakRSS() as mem:
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, cpu, result, mem.extra


def timed(fn, repeats: int = 1):
    """The fastest of ``repeats`` calls, as :func:`measure` returns it."""
    return min((measure(fn) for _ in range(repeats)), key=lambda r: r[0])


def spy_passes(fn):
    """Run ``fn`` recording every data pass of our fit: [(rows, dtype name, seconds)]."""
    orig, log = _temperature_module._pass, []

    def spy(x, y, kind, beta, dtype=np.float64, exponent=0):
        t0 = time.perf_counter()
        out = orig(x, y, kind, beta, dtype, exponent)
        log.append((x.shape[0], np.dtype(dtype).name, time.perf_counter() - t0))
        return out

    _temperature_module._pass = spy
    try:
        fn()
    finally:
        _temperature_module._pass = orig
    return log


def tracemalloc_peak(fn) -> int:
    """Peak bytes traced (numpy buffers included) during ``fn()`` above the start."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - start


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        pass
    mem = None
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1])
    except OSError:
        pass
    ram = f"{mem / 2**20:.1f} GiB" if mem else "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({cpu}), RAM {ram}, Python {platform.python_version()}, "
        f"numpy {np.__version__}; load average {load}"
    )


def spread(values) -> str:
    """``mean [min, max]`` of ratios."""
    v = np.asarray(values, dtype=np.float64)
    return f"{v.mean():.2f}x [{v.min():.2f}, {v.max():.2f}]"


def load_before(path: str):
    """``fit(z, y) -> (beta, fit_info)`` of the ``TemperatureScaler`` in another version's
    ``calibrators/methods/temperature.py`` (``git show REV:calibrators/methods/temperature.py``),
    loaded beside ours; it imports the rest of ``calibrators`` from this checkout."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("temperature_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)

    def fit(z, y):
        cal = module.TemperatureScaler().fit(z, y)
        return cal.beta_, cal.fit_info_

    return fit


# -- methods ----------------------------------------------------------------
def floor(z: np.ndarray) -> np.ndarray:
    m = z.max(1, keepdims=True)
    return np.log(np.exp(z - m).sum(1)) + m[:, 0]


def ours(z, y):
    cal = calibrators.TemperatureScaler().fit(z, y)
    return cal.beta_, cal.fit_info_


def sklearn_public(z, y, cv):
    from sklearn.base import BaseEstimator, ClassifierMixin
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.frozen import FrozenEstimator

    class Logits(ClassifierMixin, BaseEstimator):
        """A 'fitted model' whose decision_function is the precomputed logits."""

        def fit(self, x, y):
            self.classes_ = np.arange(x.shape[1])
            return self

        def decision_function(self, x):
            return x

        def predict(self, x):
            return x.argmax(axis=1)

    clf = Logits().fit(z[:1], y[:1])
    cal = CalibratedClassifierCV(FrozenEstimator(clf), method="temperature", cv=cv).fit(z, y)
    return float(cal.calibrated_classifiers_[0].calibrators[0].beta_)


def sklearn_core(z, y):
    from sklearn.calibration import _TemperatureScaling

    return float(_TemperatureScaling().fit(z, y).beta_)


def torch_recipe(z, y, *, init=1.5, line_search=None, lr=0.01):
    import torch
    from torch import nn, optim

    logits, labels = torch.from_numpy(z), torch.from_numpy(y)  # no copies
    t = nn.Parameter(torch.ones(1) * init)
    opt = optim.LBFGS([t], lr=lr, max_iter=50, line_search_fn=line_search)
    crit = nn.CrossEntropyLoss()
    calls = [0]

    def closure():
        opt.zero_grad()
        loss = crit(logits / t, labels)
        loss.backward()
        calls[0] += 1
        return loss

    opt.step(closure)
    return 1.0 / float(t.item()), calls[0]


# -- main -------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=1_000)
    ap.add_argument(
        "--repeats", type=int, default=5,
        help="rounds: a run of ours (and of --before) between two floor runs"
    )
    ap.add_argument(
        "--sklearn-cv",
        type=int,
        default=None,
        help="cv of CalibratedClassifierCV (default: sklearn's, 5-fold)",
    )
    ap.add_argument("--before", metavar="FILE",
                    help="another version of calibrators/methods/temperature.py, timed each round")
    ap.add_argument("--skip-sklearn", action="store_true")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-strong-wolfe", action="store_true")
    args = ap.parse_args(argv)

    print(f"machine: {machine()}")
    t0 = time.perf_counter()
    z, y = make_logits(args.n, args.k)
    gib = z.nbytes / 2**30
    print(
        f"data: float32 logits {args.n} x {args.k} ({gib:.2f} GiB), seed {SEED}, "
        f"accuracy {np.mean(z.argmax(1) == y):.4f}, built in {time.perf_counter() - t0:.1f} s"
    )

    rows = []  # (name, wall seconds, beta or None, peak extra bytes, cpu seconds)

    def add(name, run, beta, note=""):
        seconds, cpu, _, extra = run
        rows.append((name, seconds, beta, extra, cpu))
        t = "-" if beta is None else f"{1 / beta:.4f}"
        print(f"  {name}: {seconds:.3f} s (cpu {cpu:.3f} s), T {t}  {note}", flush=True)

    # Rounds: floor, ours (and the code before, with --before), floor, ... Each round's
    # ratio is ours over the faster of the floors on either side of it, so that load
    # from other jobs hits both alike. The first floor calls after other work pay for
    # fresh (huge) pages of its two array-sized temporaries (up to 3 s of kernel time
    # here), so WARM_UP_FLOORS come first and are only printed. Ours allocates only
    # chunk-sized temporaries.
    before = load_before(args.before) if args.before else None
    warm = [measure(lambda: floor(z)) for _ in range(WARM_UP_FLOORS)]
    floor_runs = [measure(lambda: floor(z))]
    ours_runs, before_runs = [], []
    for _ in range(args.repeats):
        ours_runs.append(measure(lambda: ours(z, y)))
        if before is not None:
            before_runs.append(measure(lambda: before(z, y)))
        floor_runs.append(measure(lambda: floor(z)))
    round_floor = [min(a[0], b[0]) for a, b in itertools.pairwise(floor_runs)]
    per_round = [o[0] / f for o, f in zip(ours_runs, round_floor, strict=True)]
    floor_best = min(floor_runs, key=lambda r: r[0])
    ours_best = min(ours_runs, key=lambda r: r[0])
    if all(r[3] is not None for r in ours_runs):  # memory: the worst run (the first, usually)
        ours_best = (*ours_best[:3], max(r[3] for r in ours_runs))
    beta, info = ours_best[2]
    add(
        "floor: numpy logsumexp pass (f32)",
        floor_best,
        None,
        f"best of {len(floor_runs)}, one before and one after each of ours",
    )
    add(
        "ours: TemperatureScaler.fit",
        ours_best,
        beta,
        f"best of {len(ours_runs)}; {info['passes']} float64 passes"
        f"{', the last step extrapolated' if info.get('extrapolated') else ''}, "
        f"{info.get('float32_passes', 0)} float32, {info['reason']}, "
        f"rel. grad {info['relative_gradient']:.1e}",
    )
    if before_runs:
        add("before: TemperatureScaler.fit of --before", min(before_runs, key=lambda r: r[0]),
            before_runs[0][2][0], f"best of {len(before_runs)}, {args.before}")
    floor_s, ours_s, ours_beta = floor_best[0], ours_best[0], beta
    print(
        "    floor warm-up runs (s): " + " ".join(f"{r[0]:.3f}" for r in warm)
        + "\n    floor runs (s): " + " ".join(f"{r[0]:.3f}" for r in floor_runs)
        + "\n    ours runs (s):  " + " ".join(f"{r[0]:.3f}" for r in ours_runs)
        + ("\n    before runs (s): " + " ".join(f"{r[0]:.3f}" for r in before_runs)
           if before_runs else "")
    )
    print(f"    ours / floor, per round (the faster floor beside it): {spread(per_round)}")
    if before_runs:
        print("    before / ours, per round: "
              + spread([b[0] / o[0] for b, o in zip(before_runs, ours_runs, strict=True)])
              + "; before / floor: "
              + spread([b[0] / f for b, f in zip(before_runs, round_floor, strict=True)]))

    # Where our time goes: the validation sweep, then every data pass of one fit.
    from calibrators.validation import as_scores_and_labels

    val_s = timed(lambda: as_scores_and_labels(z, y), args.repeats)[0]
    passes = spy_passes(lambda: ours(z, y))
    traced = tracemalloc_peak(lambda: ours(z, y))

    if not args.skip_sklearn:
        try:
            run = measure(lambda: sklearn_public(z, y, args.sklearn_cv))
            note = f"1 run; cv={args.sklearn_cv or 5}, cross_val_predict copies included"
            add("sklearn CalibratedClassifierCV(Frozen)", run, run[2], note)
        except ValueError as exc:  # too few rows per class for the folds
            print(f"  sklearn CalibratedClassifierCV skipped: {exc}")
        run = measure(lambda: sklearn_core(z, y))
        add("sklearn _TemperatureScaling (its core)", run, run[2], "1 run")

    if not args.skip_torch:
        import torch

        run = measure(lambda: torch_recipe(z, y))
        t_beta, calls = run[2]
        add(
            "torch LBFGS lr=0.01 max_iter=50",
            run,
            t_beta,
            f"1 run; {calls} closures, {torch.get_num_threads()} threads",
        )
        if not args.skip_strong_wolfe:
            run = measure(lambda: torch_recipe(z, y, line_search="strong_wolfe", lr=1.0))
            add("torch LBFGS strong_wolfe lr=1", run, run[2][0], f"1 run; {run[2][1]} closures")

    ours_nll = nll64(z, y, ours_beta)
    print()
    print(
        f"{'method':41s} {'seconds':>8s} {'cpu s':>7s} {'x floor':>8s} {'x ours':>7s} "
        f"{'T':>7s} {'NLL (f64)':>11s} {'NLL - ours':>10s} {'peak extra':>10s}"
    )
    nlls = {}
    for name, seconds, beta, extra, cpu in rows:
        mem = "-" if extra is None else f"{extra / z.nbytes:.2f}x"
        if beta is None:
            t = nll = diff = "-"
        else:
            nlls[name] = value = nll64(z, y, beta)
            t, nll, diff = f"{1 / beta:.4f}", f"{value:.8f}", f"{value - ours_nll:+.1e}"
        print(
            f"{name:41s} {seconds:8.3f} {cpu:7.2f} {seconds / floor_s:8.2f} "
            f"{seconds / ours_s:7.2f} {t:>7s} {nll:>11s} {diff:>10s} {mem:>10s}"
        )
    print(
        f"(NLL at T=1, uncalibrated: {nll64(z, y, 1.0):.6f}. cpu s: process CPU time, all "
        f"threads. peak extra: peak RSS during the call minus RSS before, as a multiple of the "
        f"array's {z.nbytes / 2**20:.0f} MiB)"
    )

    print()
    print("our fit, broken down (one more fit, every data pass timed):")
    print(
        f"  validation (as_scores_and_labels, finite check in blocks): {val_s:.3f} s "
        f"= {val_s / floor_s:.2f}x floor"
    )
    sub = [(r, d, t) for r, d, t in passes if r != z.shape[0]]
    if sub:
        print(
            f"  start: {len(sub)} {sub[0][1]} passes over {sub[0][0]} rows, "
            f"{sum(t for *_, t in sub):.3f} s"
        )
    for dtype in ("float32", "float64"):
        full = [t for r, d, t in passes if r == z.shape[0] and d == dtype]
        if full:
            print(
                f"  {dtype} passes over every row: {len(full)}, {sum(full):.3f} s; one pass "
                f"{min(full):.3f}-{max(full):.3f} s = {min(full) / floor_s:.2f}x floor at best"
            )
    print(
        f"  tracemalloc peak of the fit: {traced / 2**20:.1f} MiB = {traced / z.nbytes:.3f}x "
        f"the array"
    )

    print()
    print("targets (issue 2, Speed; issue 21):")

    def verdict(ok):
        return "MET" if ok else "NOT MET"

    ratio = ours_s / floor_s
    print(f"  ours <= 8x floor: {ratio:.2f}x -> {verdict(ratio <= 8)}")
    print(f"  ours <= 4x floor (issue 21): {ratio:.2f}x (best runs), per round "
          f"{spread(per_round)} -> {verdict(ratio <= 4)}")
    for name, seconds, *_ in rows[2:]:
        need = 5 if name.startswith("sklearn") else 10 if "lr=0.01" in name else None
        if need is None or name not in nlls:
            continue
        speed = seconds / ours_s
        worse = nlls[name] - ours_nll
        print(
            f"  >= {need}x faster than {name}: {speed:.1f}x -> {verdict(speed >= need)}; "
            f"NLL theirs - ours = {worse:+.2e} -> {verdict(worse >= -1e-12)}"
        )
    rss = ours_best[3]
    frac = traced / z.nbytes if rss is None else max(rss, traced) / z.nbytes
    print(
        f"  peak extra memory < 0.5x array: "
        f"{'?' if rss is None else f'{rss / z.nbytes:.3f}x'} (RSS), "
        f"{traced / z.nbytes:.3f}x (tracemalloc) -> {verdict(frac < 0.5)}"
    )
    print(f"machine at the end: {machine()}")


if __name__ == "__main__":
    main()
