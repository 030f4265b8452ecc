"""What counting the served classes adds to predict, against the work predict already does.

Every /predict and /v2 infer adds its rows' predicted classes to an in-process count
(``service.observe.served.ServedCounts.add``: one ``bincount``, or ``np.add.at`` when
the batch has far fewer rows than classes, under a lock). The baseline is what the same
request already runs in the same process: the ONNX Runtime session of a temperature
calibrator on the batch (``service.serving.inference.run``). Printed per (K, rows): the
median seconds of each over ``--repeats`` calls, their ratio, and the load average at
the start and the end. The flush (one upsert per interval, off the request) is not on
the request's path and not measured here.

Usage::

    .venv/bin/python bench/served_counts.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import calibrators
from service.observe.served import ServedCounts
from service.serving import inference

SHAPES = ((10, 1), (10, 1000), (1000, 1), (1000, 100), (49_152, 1), (262_144, 1), (262_144, 8))


def median_seconds(fn, repeats: int) -> float:
    fn()  # first call: allocations, ONNX Runtime's arena
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    print(f"{'K':>8} {'rows':>5} {'count s':>10} {'onnx run s':>11} {'ratio':>7}")
    rng = np.random.default_rng(0)
    for k, rows in SHAPES:
        z = rng.normal(size=(max(64, rows), k)).astype(np.float32)
        cal = calibrators.create("temperature").fit(z, rng.integers(0, k, z.shape[0]))
        session = inference.SessionCache(threads=1, size=1).get(
            "bench", lambda cal=cal: cal.to_params()
        )
        batch = z[:rows]
        labels = inference.run(session, batch)["label"]
        counter = ServedCounts(60)
        count = median_seconds(
            lambda c=counter, k=k, y=labels: c.add((1, None), k, y), args.repeats
        )
        run = median_seconds(lambda s=session, b=batch: inference.run(s, b), args.repeats)
        print(f"{k:>8} {rows:>5} {count:>10.2e} {run:>11.2e} {count / run:>7.3f}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
