"""Every method of ours beside probmetrics' TS, VS, SVS, SMS, ETS, IOP and Dirichlet,
on the shared data, over several fit/score splits.

Protocol (issue 21): per shared file (``../shared/data/*.npz``: float32
probabilities ``predictions``, labels ``ground_truth``) and per seed (default 0
to 4), fit on the rows :func:`calibrators.evaluation.holdout.split_indices` ``(N, 0.5,
seed)`` picks (the first half of ``numpy.random.default_rng(seed).permutation(N)``)
and score on the other half. Every method, ours and the peers', is scored here by
:mod:`calibrators.evaluation.metrics`: held-out NLL, top-label ECE (15 equal-width bins) and
accuracy. The table gives each figure as ``mean [min, max]`` over the seeds, the
NLL also paired against our temperature scaling on the same split
(``NLL - temperature``), and the fit seconds the same way.

Ours are every method of the registry (``calibrators.METHODS``) with default
options, fitted on the probabilities (``kind="probabilities"``), and ``auto``:
the service's choice among them (:func:`service.jobs.fitting.fit_job` with
``method="auto"``, ``argmax_policy="off"``, its default inner hold-out of the
fit half and the split's seed), scored on the same held-out half.

The peers are probmetrics 1.3.0's calibrators with their defaults:
``get_calibrator("temp-scaling")`` (TS), ``VectorScalingCalibrator()`` (VS),
``get_calibrator("svs")``, ``get_calibrator("sms")``, ``ETSCalibrator()``,
``IntraOrderPreservingCalibrator()`` (IOP) and ``get_calibrator("dircal")``
(Dirichlet: its ``DirichletCalibrator``, dirichletcal's full Dirichlet map with
``reg_lambda = reg_mu = 1e-3``; only where K <= ``PEER_MAX_K``, 10: at K = 100 it
is dirichletcal's unvectorised fit). ``torch.manual_seed(0)`` precedes every
peer's fit. probmetrics needs torch, so it runs in a separate Python (a virtual
environment of its own, never the project's) as a child process of this script:
``--peers-python`` or the environment variable ``WELLTEMPERED_PEERS_PYTHON``
names that interpreter. One child per file gets the scores and the splits, fits
and times every peer on every split, and hands back their held-out
probabilities; nothing of probmetrics is imported here.

Timing: every method is first fitted once, untimed, on ``WARM_UP_ROWS`` rows
(imports, torch's and numba's first calls), then ``--rounds`` times (default 1) per
seed, and the fastest of them counts (for the fit-time goals); the seconds
include everything ``fit`` does (validation, penalty searches, for the peers'
SVS and SMS their temperature-scaling preprocessing, for ``auto`` all its
candidates). The peers run first on a file, then ours, so both meet the same
machine; the load average is printed at the start and the end.

Usage::

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install torch==2.13.0        # first: the pinned CPU wheel
    /work/bench-venv/bin/pip install probmetrics==1.3.0 numba
    /work/bench-venv/bin/pip install --ignore-requires-python dirichletcal==0.5.3   # Dirichlet
    WELLTEMPERED_PEERS_PYTHON=/work/bench-venv/bin/python .venv/bin/python bench/peers.py
    .venv/bin/python bench/peers.py --seeds 0 --methods svs sms --peers SVS SMS   # quick

Writes the tables to ``bench/results/peers.txt`` (``--out``) and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"
FILES = ("wideresnet-16-4-cifar-100.npz", "lenet-5-cifar-10.npz")
PEERS = ("TS", "VS", "SVS", "SMS", "ETS", "IOP", "Dirichlet")
#: Peers fitted only up to this many classes.
PEER_MAX_K = {"Dirichlet": 10}
SEEDS = (0, 1, 2, 3, 4)
AUTO = "auto"
ENV_PYTHON = "WELLTEMPERED_PEERS_PYTHON"
#: Every method, ours and the peers', is first fitted once, untimed, on this many rows.
WARM_UP_ROWS = 300
#: Issue 21's goal: every method's mean held-out NLL at most temperature's plus this.
NLL_MARGIN = 0.002
#: NLL differences within this count as ties ("lower than temperature" needs more).
TIE = 1e-5


# -- the child: runs in the peers' interpreter, imports only numpy and probmetrics --
def _peer(name: str):
    from probmetrics.calibrators import (
        ETSCalibrator,
        VectorScalingCalibrator,
        get_calibrator,
    )
    from probmetrics.calibrators.orderpreserving import IntraOrderPreservingCalibrator

    if name == "TS":
        return get_calibrator("temp-scaling")
    if name == "VS":
        return VectorScalingCalibrator()
    if name == "SVS":
        return get_calibrator("svs", svs_print_init_info=False)
    if name == "SMS":
        return get_calibrator("sms", sms_print_init_info=False)
    if name == "ETS":
        return ETSCalibrator()
    if name == "IOP":
        return IntraOrderPreservingCalibrator()
    if name == "Dirichlet":
        return get_calibrator("dircal")
    raise ValueError(f"peer must be one of {', '.join(PEERS)}. Got {name!r}.")


def child(job: str) -> None:
    """Fit and time the peers named in the job file on every split; write their
    held-out probabilities (``NAME/SEED``) and seconds."""
    import warnings

    import torch

    spec = json.loads(Path(job).read_text())
    data = np.load(spec["arrays"])
    p, y = data["p"], data["y"]
    out, seconds = {}, {}
    for name in spec["peers"]:
        torch.manual_seed(0)
        first = data[f"fit/{spec['seeds'][0]}"][:WARM_UP_ROWS]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _peer(name).fit(p[first], y[first])  # first-call costs, untimed
        for seed in spec["seeds"]:
            fit, test = data[f"fit/{seed}"], data[f"test/{seed}"]
            p_fit, y_fit = p[fit], y[fit]
            times = []
            for _ in range(spec["rounds"]):
                torch.manual_seed(0)
                cal = _peer(name)
                start = time.perf_counter()
                cal.fit(p_fit, y_fit)
                times.append(time.perf_counter() - start)
            seconds[f"{name}/{seed}"] = min(times)
            out[f"{name}/{seed}"] = np.asarray(cal.predict_proba(p[test]), dtype=np.float64)
    np.savez(spec["result"], **out)
    from importlib.metadata import PackageNotFoundError, version

    try:
        dirichletcal = f", dirichletcal {version('dirichletcal')}"
    except PackageNotFoundError:
        dirichletcal = ""
    versions = (f"probmetrics {version('probmetrics')}{dirichletcal}, torch {torch.__version__} "
                f"({torch.get_num_threads()} threads), numpy {np.__version__}")
    Path(spec["seconds"]).write_text(json.dumps({"seconds": seconds, "versions": versions}))


# -- the parent ----------------------------------------------------------------
def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
            f"numpy {np.__version__}; load average {load}; {time.strftime('%Y-%m-%d %H:%M:%S')}")


def run_peers(python: str, peers, p, y, splits: dict, rounds: int, tmp: Path):
    """Every peer on every split in one child process:
    ({(peer, seed): probabilities}, {(peer, seed): seconds}, versions)."""
    arrays, result, seconds, job = (tmp / n for n in ("in.npz", "out.npz", "s.json", "job.json"))
    parts = {f"{half}/{seed}": rows for seed, (fit, test) in splits.items()
             for half, rows in (("fit", fit), ("test", test))}
    np.savez(arrays, p=p, y=y, **parts)
    job.write_text(json.dumps({"arrays": str(arrays), "result": str(result),
                               "seconds": str(seconds), "peers": list(peers),
                               "seeds": list(splits), "rounds": rounds}))
    subprocess.run([python, str(Path(__file__).resolve()), "--child", str(job)], check=True,
                   cwd=tmp)
    told = json.loads(seconds.read_text())

    def key(name: str) -> tuple[str, int]:
        peer, seed = name.rsplit("/", 1)
        return peer, int(seed)

    with np.load(result) as out:
        probs = {key(name): out[name] for name in out.files}
    return probs, {key(n): s for n, s in told["seconds"].items()}, told["versions"]


def fit_ours(method: str, p_fit, y_fit, p_test, seed: int):
    """(held-out probabilities, fit seconds, what was chosen or None)."""
    import calibrators

    if method == AUTO:
        from calibrators.evaluation.holdout import DEFAULT_HOLDOUT
        from service.jobs.fitting import fit_job

        start = time.perf_counter()
        job = fit_job(p_fit, y_fit, kind="probabilities", method=AUTO,
                      holdout=DEFAULT_HOLDOUT, seed=seed, options={}, argmax_policy="off")
        elapsed = time.perf_counter() - start
        cal = calibrators.from_params(job["params"])
        return cal.predict_proba(p_test, kind="probabilities"), elapsed, job["chosen_method"]
    cal = calibrators.create(method)
    start = time.perf_counter()
    cal.fit(p_fit, y_fit, kind="probabilities")
    elapsed = time.perf_counter() - start
    return cal.predict_proba(p_test, kind="probabilities"), elapsed, None


def scores(probs, labels) -> dict:
    from calibrators.evaluation.metrics import accuracy_score, expected_calibration_error, nll_loss

    probs = np.maximum(np.asarray(probs, dtype=np.float64), 0.0)
    probs /= probs.sum(axis=1, keepdims=True)  # peers' float32 rows, summed in float64
    return {"nll": nll_loss(probs, labels), "ece": expected_calibration_error(probs, labels),
            "accuracy": accuracy_score(probs, labels)}


def spread(values, fmt: str, scale: float = 1.0) -> str:
    """``mean [min, max]`` of ``values`` (times ``scale``), each in format ``fmt``."""
    v = scale * np.asarray(values, dtype=np.float64)
    if v.size == 1:
        return format(v[0], fmt)
    return f"{format(v.mean(), fmt)} [{format(v.min(), fmt)}, {format(v.max(), fmt)}]"


def bench_file(path: Path, args, lines: list[str]) -> None:
    import calibrators
    from calibrators.evaluation.holdout import split_indices

    with np.load(path) as data:
        p, y = data["predictions"], data["ground_truth"]
    k = p.shape[1]
    splits = {seed: split_indices(len(y), 0.5, seed=seed) for seed in args.seeds}
    methods = args.methods or [*calibrators.METHODS, AUTO]
    peers = [m for m in args.peers if k <= PEER_MAX_K.get(m, k)]
    python = args.peers_python or os.environ.get(ENV_PYTHON)
    # (side, method) -> {seed: {"nll", "ece", "accuracy", "seconds"}}
    results: dict[tuple[str, str], dict[int, dict]] = {}
    chosen: dict[int, str] = {}
    versions = "not run"
    file_start = time.perf_counter()
    if python and peers:
        with tempfile.TemporaryDirectory() as tmp:
            probs, seconds, versions = run_peers(python, peers, p, y, splits, args.rounds,
                                                 Path(tmp))
        for (peer, seed), pr in probs.items():
            results.setdefault(("probmetrics", peer), {})[seed] = {
                **scores(pr, y[splits[seed][1]]), "seconds": seconds[(peer, seed)]}
    first_fit = splits[args.seeds[0]][0][:WARM_UP_ROWS]
    for method in methods:  # untimed warm-up (imports, first-call costs)
        fit_ours(method, p[first_fit], y[first_fit], p[:10], 0)
    for seed, (fit, test) in splits.items():
        for method in methods:
            runs = [fit_ours(method, p[fit], y[fit], p[test], seed) for _ in range(args.rounds)]
            pr, _, choice = runs[-1]
            results.setdefault(("ours", method), {})[seed] = {
                **scores(pr, y[test]), "seconds": min(r[1] for r in runs)}
            if choice is not None:
                chosen[seed] = choice
    elapsed = time.perf_counter() - file_start

    seeds = list(args.seeds)
    base = results.get(("ours", "temperature"))
    rows = [(side, m) for side, m in results if side == "ours"]
    rows += [("probmetrics", m) for m in peers if ("probmetrics", m) in results]
    means = {r: float(np.mean([results[r][s]["nll"] for s in seeds])) for r in rows}
    best = min(means.values())
    lines += [
        f"## {path.name}: N = {len(y)}, K = {k}; {len(seeds)} splits (seeds "
        f"{', '.join(map(str, seeds))}), each fit on {len(splits[seeds[0]][0])} rows, "
        f"scored on {len(splits[seeds[0]][1])}",
        f"peers: {versions}" + (f"; not fitted at K = {k}: "
                                + ", ".join(m for m in args.peers if m not in peers)
                                if len(peers) < len(args.peers) else ""),
        f"this file took {elapsed:.0f} s",
        "",
        "mean [min, max] over the splits; NLL - temperature is paired by split, against "
        f"our temperature scaling; 'lower' counts the splits where it is below -{TIE:g}.",
        "",
        "| side | method | NLL | NLL - best mean | NLL - temperature | lower "
        "| ECE % | accuracy | fit s |",
        "| --- | --- | --- | ---: | --- | ---: | --- | --- | --- |",
    ]
    for r in rows:
        per = [results[r][s] for s in seeds]
        nll = [x["nll"] for x in per]
        if base is not None:
            diff = [x["nll"] - base[s]["nll"] for x, s in zip(per, seeds, strict=True)]
            paired = spread(diff, "+.5f")
            wins = f"{sum(d < -TIE for d in diff)} of {len(diff)}"
        else:
            paired = wins = "-"
        lines.append(
            f"| {r[0]} | {r[1]} | {spread(nll, '.5f')} | {means[r] - best:+.5f} | {paired} | "
            f"{wins} | {spread([x['ece'] for x in per], '.2f', 100)} | "
            f"{spread([x['accuracy'] for x in per], '.4f')} | "
            f"{spread([x['seconds'] for x in per], '.3f')} |"
        )
    lines += ["", "per split, held-out NLL:", "",
              "| side | method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "| --- | --- |" + " ---: |" * len(seeds)]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | "
                     + " | ".join(f"{results[r][s]['nll']:.5f}" for s in seeds) + " |")
    lines.append("")
    if chosen:
        lines.append("auto chose: " + ", ".join(f"seed {s}: {m}" for s, m in chosen.items()))
    if base is not None:
        t = means[("ours", "temperature")]
        over = [f"{m} ({means[('ours', m)] - t:+.5f})" for side, m in rows
                if side == "ours" and means[(side, m)] > t + NLL_MARGIN]
        lines.append(f"goal (every method's mean NLL <= temperature's + {NLL_MARGIN}): "
                     + ("met" if not over else "not met by " + ", ".join(over)))
    if ("ours", AUTO) in means:
        singles = {m: v for (side, m), v in means.items() if side == "ours" and m != AUTO}
        top = min(singles, key=singles.__getitem__)
        gap = means[("ours", AUTO)] - singles[top]
        lines.append(f"goal (auto within {NLL_MARGIN} of the best single method's mean): "
                     f"{'met' if gap <= NLL_MARGIN else 'not met'}, {gap:+.5f} against {top}")
    for ours, peer in (("svs", "SVS"), ("sms", "SMS")):
        a, b = results.get(("ours", ours)), results.get(("probmetrics", peer))
        if a and b:
            ratio = [a[s]["seconds"] / b[s]["seconds"] for s in seeds]
            lines.append(
                f"{ours} fit time / probmetrics {peer}'s, per split: {spread(ratio, '.2f')} "
                f"(goal <= 2); mean NLL {means[('ours', ours)] - means[('probmetrics', peer)]:+.5f}"
            )
    lines.append("")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peers-python", help=f"Python with probmetrics (default ${ENV_PYTHON})")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="files in ../shared/data")
    parser.add_argument("--methods", nargs="+",
                        help=f"ours (default: every registered method and {AUTO!r})")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="fits of every method per split; the fastest one's seconds count")
    parser.add_argument("--out", default=str(HERE / "results" / "peers.txt"))
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return
    if not (args.peers_python or os.environ.get(ENV_PYTHON)):
        print(f"no peers' Python (--peers-python or ${ENV_PYTHON}): ours only", file=sys.stderr)
    command = "bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# {command.strip()}", f"start: {machine()}", ""]
    print("\n".join(lines), flush=True)
    start = time.perf_counter()
    for name in args.files:
        done = len(lines)
        bench_file(DATA / name, args, lines)
        print("\n".join(lines[done:]), flush=True)
    lines.append(f"end: {machine()}; the whole run took {time.perf_counter() - start:.0f} s")
    print(lines[-1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
