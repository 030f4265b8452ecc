"""One answer per distribution (issue 21, item 1): how far apart two representations of
the same rows are answered, and what the feature map of vector and matrix scaling
does to their held-out NLL.

For each shared CIFAR file (probabilities):

1. every method (default: all of ``calibrators.METHODS``) is fitted on the
   probabilities of the seed-0 fit half, then asked for the score half given as
   probabilities and as logits ``log p + c`` with ``c ~ U(-s, s)`` per row, ``s`` in
   1, 10, 100: the largest absolute difference between the two answers;
2. vector and matrix scaling's held-out NLL on the 5-split protocol (fit on the first
   half of ``numpy.random.default_rng(seed).permutation(N)``, score the second, seeds
   0 to 4): mean [min, max].

``--phi`` sets vector and matrix scaling's feature map for the run: ``clr`` (the
code's, the centred log-ratio), ``logits`` (format 1's raw logits, the code before
issue 21) or ``log_softmax``. ``--onnx`` instead times the served graph of vector and
matrix scaling (format 2, which computes the centred log-ratio in the graph) against
format 1's graph of the same weights (raw logits), in the same run: the minimum of 100
alternating runs of 64 Ki float32 scores on one ONNX Runtime thread::

    .venv/bin/python bench/one_answer.py --phi clr
    .venv/bin/python bench/one_answer.py --phi logits --methods vector matrix
    .venv/bin/python bench/one_answer.py --onnx
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import calibrators
from calibrators.methods.matrix import MatrixScaler
from calibrators.methods.vector import VectorScaler

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FILES = ("lenet-5-cifar-10", "wideresnet-16-4-cifar-100")
SHIFTS = (1.0, 10.0, 100.0)


def nll(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(y)), y], 1e-300))))


def halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    return perm[: n // 2], perm[n // 2 :]


def graphs() -> None:
    import onnxruntime as ort

    from calibrators.base import PARAMS_FORMAT_1

    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for method in ("vector", "matrix"):
        for k in (10, 100, 1000):
            weight = rng.uniform(0.5, 2.0, k)
            params = {"method": method, "n_classes": k, "bias": rng.normal(size=k).tolist(),
                      "weight": (np.diag(weight) if method == "matrix" else weight).tolist()}
            sessions = {
                fmt: ort.InferenceSession(calibrators.from_params({**params, "format": fmt})
                                          .to_onnx(), options,
                                          providers=["CPUExecutionProvider"])
                for fmt in (PARAMS_FORMAT_1, calibrators.PARAMS_FORMAT)
            }
            x = (rng.normal(size=((1 << 16) // k, k)) * 5).astype(np.float32)
            times = {fmt: [] for fmt in sessions}
            for _ in range(100):
                for fmt, session in sessions.items():
                    started = time.perf_counter()
                    session.run(None, {"logits": x})
                    times[fmt].append(time.perf_counter() - started)
            old, new = (min(times[fmt]) for fmt in sessions)
            print(f"{method:6s} K = {k:5d}: format 1 {old * 1e3:.3f} ms, format 2 "
                  f"{new * 1e3:.3f} ms, ratio {new / old:.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phi", choices=("clr", "logits", "log_softmax"), default="clr")
    parser.add_argument("--methods", nargs="+", default=list(calibrators.METHODS))
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--onnx", action="store_true", help="time the served graphs only")
    args = parser.parse_args(argv)
    if args.onnx:
        graphs()
        return
    for cls in (VectorScaler, MatrixScaler):
        cls.feature = args.phi
    print(f"phi of vector and matrix: {args.phi}")
    for name in args.files:
        with np.load(DATA / f"{name}.npz") as f:
            probs, labels = f["predictions"], f["ground_truth"]
        fit_rows, score_rows = halves(len(labels), 0)
        held = probs[score_rows].astype(np.float64)
        rng = np.random.default_rng(1)
        for method in args.methods:
            cal = calibrators.create(method).fit(probs[fit_rows], labels[fit_rows],
                                                 kind="probabilities")
            if args.phi == "logits" and method in ("vector", "matrix"):
                cal.kind_ = None  # as before issue 21: both kinds served, raw logits
            as_probs = cal.predict_proba(probs[score_rows], kind="probabilities")
            diffs = []
            for s in SHIFTS:
                c = rng.uniform(-s, s, size=(len(score_rows), 1))
                logits = np.log(np.maximum(held, 2.0**-149)) + c
                diffs.append(np.abs(cal.predict_proba(logits) - as_probs).max())
            shown = "  ".join(f"U(-{s:g},{s:g}) {d:.3g}" for s, d in zip(SHIFTS, diffs,
                                                                          strict=True))
            print(f"{name} {method:11s} fitted on probabilities, max |p(log p + c) - p(p)|: "
                  f"{shown}", flush=True)
        for method in [m for m in ("vector", "matrix") if m in args.methods]:
            scores, seconds = [], []
            for seed in range(args.splits):
                fit_rows, score_rows = halves(len(labels), seed)
                started = time.perf_counter()
                cal = calibrators.create(method).fit(probs[fit_rows], labels[fit_rows],
                                                     kind="probabilities")
                seconds.append(time.perf_counter() - started)
                scores.append(nll(cal.predict_proba(probs[score_rows], kind="probabilities"),
                                  labels[score_rows]))
            print(f"{name} {method:11s} {args.splits}-split held-out NLL {np.mean(scores):.4f} "
                  f"[{min(scores):.4f}, {max(scores):.4f}] ("
                  f"{' '.join(f'{v:.4f}' for v in scores)}), fit {np.mean(seconds):.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
