"""Every method of ours beside probmetrics' TS, ETS, SVS, SMS and IOP, on the shared data.

Per shared file (``../shared/data/*.npz``: float32 probabilities ``predictions``,
labels ``ground_truth``): fit on the rows :func:`calibrators.holdout.split_indices`
``(N, 0.5, seed=0)`` picks (the first half of ``default_rng(0).permutation(N)``),
evaluate on the other half. For each method: held-out NLL and top-label ECE (15
equal-width bins), both computed here by :mod:`calibrators.metrics` for every
method, accuracy, and fit seconds.

Ours are every method of the registry (``calibrators.METHODS``) with default
options, fitted on the probabilities (``kind="probabilities"``). The peers are
probmetrics 1.3.0's ``TemperatureScalingCalibrator`` (``get_calibrator("temp-scaling")``),
``ETSCalibrator()``, ``get_calibrator("svs")``, ``get_calibrator("sms")`` and
``IntraOrderPreservingCalibrator()`` (``torch.manual_seed(0)`` before each fit), all
with their defaults. probmetrics needs torch, so it runs in a separate Python
(a virtual environment of its own, never the project's) as a child process of
this script: ``--peers-python`` or the environment variable
``WELLTEMPERED_PEERS_PYTHON`` names that interpreter. The child gets the same
fit/test rows, fits and times the peers, and hands back their test
probabilities; nothing of probmetrics is imported here.

Timing: ``--rounds`` rounds, each one fit of every peer (a fresh child process,
after one untimed warm-up fit of each peer on the first ``WARM_UP_ROWS`` fit rows,
so that torch's first-call costs are not counted) and one fit of every method of
ours (after one such warm-up fit before the first round); the table shows the
fastest round of each method, so that load from other jobs hits both sides
alike. Fit seconds include everything ``fit`` does (for ours: validation, the
penalty search of the ODIR and structured methods; for the peers' SVS and SMS
the temperature-scaling preprocessing). ``x SMS`` is the fit time over
probmetrics SMS's in the same run.

Usage::

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install torch==2.13.0        # first: the pinned CPU wheel
    /work/bench-venv/bin/pip install probmetrics==1.3.0 numba
    WELLTEMPERED_PEERS_PYTHON=/work/bench-venv/bin/python .venv/bin/python bench/peers.py
    .venv/bin/python bench/peers.py --rounds 1 --methods svs sms --peers TS SMS   # quick

Writes the table to ``bench/results/peers.txt`` (``--out``) and prints it.
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
PEERS = ("TS", "ETS", "SVS", "SMS", "IOP")
ENV_PYTHON = "WELLTEMPERED_PEERS_PYTHON"
#: Every method, ours and the peers', is first fitted once, untimed, on this many rows.
WARM_UP_ROWS = 300


# -- the child: runs in the peers' interpreter, imports only numpy and probmetrics --
def _peer(name: str):
    from probmetrics.calibrators import ETSCalibrator, get_calibrator
    from probmetrics.calibrators.orderpreserving import IntraOrderPreservingCalibrator

    if name == "TS":
        return get_calibrator("temp-scaling")
    if name == "ETS":
        return ETSCalibrator()
    if name == "SVS":
        return get_calibrator("svs", svs_print_init_info=False)
    if name == "SMS":
        return get_calibrator("sms", sms_print_init_info=False)
    if name == "IOP":
        return IntraOrderPreservingCalibrator()
    raise ValueError(f"peer must be one of {', '.join(PEERS)}. Got {name!r}.")


def child(job: str) -> None:
    """Fit and time the peers named in the job file; write their test probabilities."""
    import torch

    spec = json.loads(Path(job).read_text())
    data = np.load(spec["arrays"])
    p_fit, y_fit, p_test = data["p_fit"], data["y_fit"], data["p_test"]
    out, seconds = {}, {}
    for name in spec["peers"]:
        torch.manual_seed(0)
        _peer(name).fit(p_fit[:WARM_UP_ROWS], y_fit[:WARM_UP_ROWS])  # first-call costs
        torch.manual_seed(0)
        cal = _peer(name)
        start = time.perf_counter()
        cal.fit(p_fit, y_fit)
        seconds[name] = time.perf_counter() - start
        out[name] = np.asarray(cal.predict_proba(p_test), dtype=np.float64)
    np.savez(spec["result"], **out)
    from importlib.metadata import version

    versions = (f"probmetrics {version('probmetrics')}, torch {torch.__version__} "
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
            f"numpy {np.__version__}; load average {load}")


def run_peers(python: str, peers, p_fit, y_fit, p_test, tmp: Path) -> tuple[dict, dict, str]:
    """One round of the peers in a child process: (probabilities, seconds, versions)."""
    arrays, result, seconds, job = (tmp / n for n in ("in.npz", "out.npz", "s.json", "job.json"))
    np.savez(arrays, p_fit=p_fit, y_fit=y_fit, p_test=p_test)
    job.write_text(json.dumps({"arrays": str(arrays), "result": str(result),
                               "seconds": str(seconds), "peers": list(peers)}))
    subprocess.run([python, str(Path(__file__).resolve()), "--child", str(job)], check=True,
                   cwd=tmp)
    with np.load(result) as out:
        probs = {name: out[name] for name in peers}
    told = json.loads(seconds.read_text())
    return probs, told["seconds"], told["versions"]


def fit_ours(method, p_fit, y_fit, p_test):
    import calibrators

    cal = calibrators.create(method)
    start = time.perf_counter()
    cal.fit(p_fit, y_fit, kind="probabilities")
    elapsed = time.perf_counter() - start
    return cal.predict_proba(p_test, kind="probabilities"), elapsed, cal


def scores(probs, labels) -> dict:
    from calibrators.metrics import accuracy_score, expected_calibration_error, nll_loss

    probs = np.maximum(np.asarray(probs, dtype=np.float64), 0.0)
    probs /= probs.sum(axis=1, keepdims=True)  # peers' float32 rows, summed in float64
    return {"nll": nll_loss(probs, labels), "ece": expected_calibration_error(probs, labels),
            "accuracy": accuracy_score(probs, labels)}


def bench_file(path: Path, args, lines: list[str]) -> None:
    import calibrators
    from calibrators.holdout import split_indices

    with np.load(path) as data:
        p, y = data["predictions"], data["ground_truth"]
    fit, test = split_indices(len(y), 0.5, seed=0)
    p_fit, y_fit, p_test, y_test = p[fit], y[fit], p[test], y[test]
    methods = args.methods or list(calibrators.METHODS)
    ours_s = {m: [] for m in methods}
    ours_p, info = {}, {}
    peers_s = {m: [] for m in args.peers}
    peers_p, versions = {}, "not run"
    python = args.peers_python or os.environ.get(ENV_PYTHON)
    for method in methods:  # untimed warm-up (imports, first-call costs)
        fit_ours(method, p_fit[:WARM_UP_ROWS], y_fit[:WARM_UP_ROWS], p_test[:10])
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            if python and args.peers:
                probs, sec, versions = run_peers(python, args.peers, p_fit, y_fit, p_test,
                                                 Path(tmp))
                peers_p.update(probs)
                for name, s in sec.items():
                    peers_s[name].append(s)
            for method in methods:
                probs, s, cal = fit_ours(method, p_fit, y_fit, p_test)
                ours_p[method], info[method] = probs, cal.fit_info_
                ours_s[method].append(s)
    rows = [("ours", m, scores(ours_p[m], y_test), min(ours_s[m]), ours_s[m]) for m in methods]
    rows += [("probmetrics", m, scores(peers_p[m], y_test), min(peers_s[m]), peers_s[m])
             for m in args.peers if m in peers_p]
    sms = min(peers_s["SMS"]) if peers_s.get("SMS") else None
    best = min(r[2]["nll"] for r in rows)
    lines += [
        f"## {path.name}: N = {len(y)}, K = {p.shape[1]}, fit on {len(fit)} rows, "
        f"test on {len(test)}",
        f"peers: {versions}",
        "",
        "| side | method | NLL | NLL - best | ECE % | accuracy | fit s (fastest) | x SMS "
        "| fit s, every round |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for side, m, sc, sec, every in rows:
        ratio = f"{sec / sms:.2f}" if sms else "-"
        lines.append(
            f"| {side} | {m} | {sc['nll']:.5f} | {sc['nll'] - best:+.5f} | "
            f"{100 * sc['ece']:.2f} | {sc['accuracy']:.4f} | {sec:.3f} | {ratio} | "
            f"{', '.join(f'{s:.3f}' for s in every)} |"
        )
    for m in ("svs", "sms"):
        if m in info:
            cv = info[m].get("cross_validation") or {}
            tried = ", ".join(f"{c['multiplier']:g}: {c['cv_nll']:.5f}"
                              for c in cv.get("candidates", []))
            lines.append(f"\nours {m}: multipliers {info[m]['multipliers']}, "
                         f"{info[m]['evaluations']} evaluations; CV NLL {tried or '-'}")
    if sms and "sms" in ours_s:
        ours_nll = scores(ours_p["sms"], y_test)["nll"]
        peer_nll = scores(peers_p["SMS"], y_test)["nll"]
        median = float(np.median(ours_s["sms"]) / np.median(peers_s["SMS"]))
        lines.append(
            f"\ngoal (sms <= 2x probmetrics SMS's fit time at equal or lower NLL): "
            f"{min(ours_s['sms']) / sms:.2f}x the time (fastest rounds; median rounds "
            f"{median:.2f}x), NLL {ours_nll - peer_nll:+.5f}"
        )
    lines.append("")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peers-python", help=f"Python with probmetrics (default ${ENV_PYTHON})")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="files in ../shared/data")
    parser.add_argument("--methods", nargs="+", help="ours (default: every registered method)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    parser.add_argument("--rounds", type=int, default=3)
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
    for name in args.files:
        done = len(lines)
        bench_file(DATA / name, args, lines)
        print("\n".join(lines[done:]), flush=True)
    lines.append(f"end: {machine()}")
    print(lines[-1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
