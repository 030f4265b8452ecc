"""What a temperature per row costs: row-entropy against temperature scaling, numpy and ONNX.

    .venv/bin/python bench/row_entropy.py [--rounds 5] [--n 256] [--k 32768]

Two score sets, each served by a fitted ``temperature`` (``target_entropy``, one beta) and
a fitted ``row-entropy`` (a beta per row, :data:`calibrators.methods.row_entropy.STEPS`
Newton steps): the CIFAR-100 outputs shipped in ``../shared/data`` (10,000 x 100,
probabilities: their floored log), and ``--n`` x ``--k`` heavy-tailed synthetic
logits (a language model's K). For each, the
best of ``--rounds`` of: ``predict_proba`` (numpy, float64) and one ONNX Runtime run on
one thread (float32 in), against a floor, one ``numpy.exp`` over a float64 copy of
the scores, all in this process. Printed: seconds, ratios to the floor and
row-entropy's to temperature's, and row-entropy's largest distance to the target
(nats) on the numpy path and on the ONNX graph's float32 ``entropy`` output.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import calibrators
from calibrators.onnx_export import INPUT_NAME

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def session(cal) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(cal.to_onnx(), options, providers=["CPUExecutionProvider"])


def entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=1)


def case(name: str, z: np.ndarray, target: float, rounds: int) -> None:
    z32 = z.astype(np.float32)
    floor = best(lambda: np.exp(z.astype(np.float64)), rounds)
    fitted = {
        m: calibrators.create(m, target_entropy=target).fit(z)
        for m in ("temperature", "row-entropy")
    }
    print(f"\n{name}: {z.shape[0]:,} x {z.shape[1]:,}, target {target:.3f} nats; "
          f"floor (one exp pass, float64) {floor:.4f} s")
    print(f"{'':<24}{'seconds':>10}{'/ floor':>10}")
    seconds = {}
    for m, cal in fitted.items():
        sess = session(cal)
        seconds[m, "numpy"] = best(lambda cal=cal: cal.predict_proba(z), rounds)
        seconds[m, "onnx"] = best(lambda sess=sess: sess.run(None, {INPUT_NAME: z32}), rounds)
        for path in ("numpy", "onnx"):
            s = seconds[m, path]
            print(f"{m + ' ' + path:<24}{s:>10.4f}{s / floor:>10.1f}")
    for path in ("numpy", "onnx"):
        ratio = seconds["row-entropy", path] / seconds["temperature", path]
        print(f"row-entropy / temperature, {path}: {ratio:.1f}x")
    cal = fitted["row-entropy"]
    numpy_error = np.abs(entropy(cal.predict_proba(z)) - target).max()
    out = dict(zip([o.name for o in session(cal).get_outputs()],
                   session(cal).run(None, {INPUT_NAME: z32}), strict=True))
    onnx_error = np.abs(out["entropy"].astype(np.float64) - target).max()
    print(f"row-entropy's largest |H - target|: numpy {numpy_error:.2e}, "
          f"ONNX float32 output {onnx_error:.2e} (unreachable rows: "
          f"{cal.fit_info_['unreachable_rows']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--k", type=int, default=32_768)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at start; one ONNX thread")
    with np.load(SHARED / "wideresnet-16-4-cifar-100.npz") as cifar:  # probabilities
        z = np.log(np.maximum(cifar["predictions"].astype(np.float64), 2.0**-149))
    case("wideresnet-16-4-cifar-100", z, 0.5, args.rounds)
    rng = np.random.default_rng(0)
    lm = rng.standard_t(3, size=(args.n, args.k)) * 2.0
    case("synthetic heavy-tailed", lm, 3.0, args.rounds)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
