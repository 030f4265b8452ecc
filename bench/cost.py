"""The cost model against measurement: ``estimate_cost(...).bytes`` beside the peak
that tracemalloc sees during the fit (numpy and scipy buffers), per method and size.

The estimate is meant to bound the measured peak (ratio >= 1) within a small
factor. Synthetic logits ``2 * gaussian + 3 on the label``, float32, seed K.
``tests/calibrators/test_cost.py`` asserts the same at two sizes per method.

Usage::

    .venv/bin/python bench/cost.py                      # every case (about a minute)
    .venv/bin/python bench/cost.py --methods temperature,pts
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc

import numpy as np

import calibrators

#: (method, N, K, options)
CASES = [
    ("temperature", 64, 2**17, {}),
    ("temperature", 4, 2**19, {}),
    ("temperature", 40_000, 1_000, {}),
    ("ets", 64, 2**17, {}),
    ("ets", 20_000, 100, {}),
    ("pts", 64, 2**17, {}),
    ("pts", 20_000, 100, {}),
    ("vector", 2_000, 100, {"reg_mu": 1.0}),
    ("vector", 2_000, 200, {}),
    ("matrix", 2_000, 50, {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix", 2_000, 100, {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix", 500, 200, {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix", 500, 400, {"reg_lambda": 1.0, "reg_mu": 1.0}),
    ("matrix", 2_000, 100, {}),
    ("dirichlet", 2_000, 100, {}),
    ("svs", 2_000, 100, {}),
    ("sms", 2_000, 100, {}),
    ("iop", 2_000, 100, {}),
]


def measured_peak(method: str, n: int, k: int, options: dict) -> tuple[int, float]:
    rng = np.random.default_rng(k)
    y = rng.integers(0, k, n)
    z = rng.standard_normal((n, k), dtype=np.float32) * 2
    z[np.arange(n), y] += 3.0
    gc.collect()
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        calibrators.create(method, **options).fit(z, y)
        return tracemalloc.get_traced_memory()[1], time.perf_counter() - t0
    finally:
        tracemalloc.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(calibrators.METHODS))
    args = parser.parse_args(argv)
    wanted = set(args.methods.split(","))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# bench/cost.py: numpy {np.__version__}, threads "
          f"{calibrators.numerics.n_threads()}; load average {load}\n")
    print("| method | N | K | options | measured MiB | estimate MiB | estimate / measured |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for method, n, k, options in CASES:
        if method not in wanted or method not in calibrators.METHODS:
            continue
        estimate = calibrators.estimate_cost(method, n, k, options).bytes
        peak, _ = measured_peak(method, n, k, options)
        shown = ", ".join(f"{key}={value}" for key, value in options.items()) or "defaults"
        print(f"| {method} | {n:,} | {k:,} | {shown} | {peak / 2**20:.1f} "
              f"| {estimate / 2**20:.1f} | {estimate / peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
