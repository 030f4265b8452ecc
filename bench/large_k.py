"""Language-model vocabularies: fits at N x K = 2,000 x 262,144 float32 (1.95 GiB).

The scores live in a memory-mapped file (``--path``, written once in row chunks),
so the process never holds them in its own memory; every method must work in
memory proportional to a chunk of rows. Everything is measured in one process and
reported against the floor, one lean float32 numpy logsumexp pass over the same
memmap in row chunks (see ``bench/temperature.py``), measured (best of 3) again
right before each method:

* seconds and process CPU seconds of ``calibrators.create(method).fit(z, y)``;
* ``traced``: the peak of tracemalloc (numpy and scipy buffers) during the fit;
* ``anon``: the peak anonymous resident memory (``RssAnon``, sampled every 5 ms)
  above its level before the fit: allocations, without the memmap's file pages;
* ``NLL``: the fitted calibrator's mean NLL on the fitted rows, computed by this
  script a row chunk at a time after the fit (not part of its time or memory);
* ``estimate``: ``calibrators.estimate_cost(method, N, K).bytes``, the model the
  service's cost guard uses. A method whose estimate exceeds the memory
  available (``MemAvailable``) is skipped, as the guard would refuse it.

The synthetic logits are those of ``bench/temperature.py`` (``3.25 * (gaussian +
5 on a "predicted" class)``, predicted = label 70% of the time).

Usage::

    .venv/bin/python bench/large_k.py                           # 2,000 x 262,144 (minutes)
    .venv/bin/python bench/large_k.py --n 200 --k 65536 --methods temperature,pts
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

import calibrators

SEED = 20240917
SCALE, MARGIN, HIT = 3.25, 5.0, 0.7  # as in bench/temperature.py


def make_memmap(path: Path, n: int, k: int) -> tuple[np.memmap, np.ndarray]:
    """The float32 logits (n, k) in ``path`` (written in row chunks if absent) and labels."""
    rng = np.random.default_rng(SEED)
    y = rng.integers(0, k, n)
    pred = np.where(rng.random(n) < HIT, y, rng.integers(0, k, n))
    if not path.exists() or path.stat().st_size != n * k * 4:
        z = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, k))
        step = max(1, (1 << 22) // k)
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            block = rng.standard_normal((rows.stop - rows.start, k), dtype=np.float32)
            block[np.arange(block.shape[0]), pred[rows]] += MARGIN
            block *= SCALE
            z[rows] = block
        z.flush()
        del z
    return np.load(path, mmap_mode="r"), y


def floor_pass(z: np.ndarray) -> float:
    """One lean float32 logsumexp pass in row chunks; its checksum."""
    total = 0.0
    step = max(1, (1 << 18) // z.shape[1])
    for start in range(0, z.shape[0], step):
        block = z[start : start + step]
        m = block.max(axis=1, keepdims=True)
        total += float((np.log(np.exp(block - m).sum(axis=1)) + m[:, 0]).sum())
    return total


def _rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """Peak ``RssAnon`` of a block above its level before it, sampled every ``interval``
    seconds (bench/upload_metrics.py uses it too)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval

    def __enter__(self):
        self.before = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())
        self.extra = self.peak - self.before
        return False


def chunked_nll(cal, z: np.ndarray, y: np.ndarray) -> float:
    """Mean NLL of the fitted calibrator on ``z, y``, predicted a row chunk at a time."""
    total = 0.0
    step = max(1, (1 << 18) // z.shape[1])
    for start in range(0, z.shape[0], step):
        p = cal.predict_proba(z[start : start + step])
        rows = np.arange(p.shape[0])
        total -= float(np.log(np.maximum(p[rows, y[start : start + step]], 1e-300)).sum())
    return total / z.shape[0]


def run(method: str, z: np.ndarray, y: np.ndarray) -> dict:
    tracemalloc.start()
    try:
        with PeakAnon() as anon:
            c0, t0 = time.process_time(), time.perf_counter()
            cal = calibrators.create(method).fit(z, y)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        _, traced = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    info = cal.fit_info_
    passes = info.get("passes")
    if passes is None and "evaluations" in info:  # svs: loss evaluations, each one pass
        passes = f"{info['evaluations']} evaluations"
    return {
        "seconds": seconds, "cpu": cpu, "traced": traced, "anon": anon.extra,
        "passes": passes, "nll": chunked_nll(cal, z, y),
        "temperature": info.get("temperature", getattr(cal, "temperature_", None)),
    }


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy "
            f"{np.__version__}, threads {calibrators.numerics.n_threads()}; load average {load}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2_000)
    parser.add_argument("--k", type=int, default=262_144)
    parser.add_argument("--methods", default="temperature,svs,pts,ets")
    parser.add_argument("--path", type=Path, default=None,
                        help="the memmap file (default: /tmp/welltempered-large-k-NxK.npy)")
    parser.add_argument("--keep", action="store_true", help="keep the memmap file")
    args = parser.parse_args(argv)
    n, k = args.n, args.k
    path = args.path or Path(f"/tmp/welltempered-large-k-{n}x{k}.npy")
    print(f"# bench/large_k.py --n {n} --k {k}: {machine()}")
    t0 = time.perf_counter()
    z, y = make_memmap(path, n, k)
    print(f"memmap {path} ({z.nbytes / 2**30:.2f} GiB float32) ready in "
          f"{time.perf_counter() - t0:.1f} s")
    def measure_floor() -> tuple[float, list[float], int, int]:
        rounds = []
        tracemalloc.start()
        with PeakAnon() as anon:
            for _ in range(3):
                t0 = time.perf_counter()
                floor_pass(z)
                rounds.append(time.perf_counter() - t0)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return min(rounds), rounds, traced, anon.extra

    # The floor is measured again before every method (best of 3 each time), and each
    # method's ratio is to the floor measured just before it: load from other jobs
    # comes and goes within a run of several minutes.
    rows = []
    for method in args.methods.split(","):
        cost = calibrators.estimate_cost(method, n, k)
        if cost.bytes > _mem_available():
            rows.append(f"| {method} | skipped: estimate {cost.bytes / 2**30:.1f} GiB > "
                        f"available {_mem_available() / 2**30:.1f} GiB | | | | | | | | | | |")
            continue
        base, rounds, traced, anon = measure_floor()
        print(f"floor before {method}: one lean float32 logsumexp pass, best of 3: "
              f"{base:.2f} s (rounds {', '.join(f'{f:.2f}' for f in rounds)}); traced "
              f"{traced / 2**20:.1f} MiB, anon {anon / 2**20:.1f} MiB", flush=True)
        r = run(method, z, y)
        temperature = "-" if r["temperature"] is None else f"{r['temperature']:.4f}"
        rows.append(
            f"| {method} | {r['seconds']:.1f} | {r['cpu']:.1f} | {base:.2f} "
            f"| {r['seconds'] / base:.1f} | {r['passes']} | {r['nll']:.5f} | {temperature} "
            f"| {r['traced'] / 2**20:.1f} | {r['anon'] / 2**20:.1f} | {cost.bytes / 2**20:.1f} "
            f"| {cost.bytes / r['traced']:.2f} |")
        print(rows[-1], flush=True)
    print("\n| method | seconds | CPU s | floor s | x floor | passes | NLL | T | traced MiB "
          "| anon MiB | estimate MiB | estimate / traced |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    print(f"\n# load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.keep:
        del z
        path.unlink()


if __name__ == "__main__":
    main()
