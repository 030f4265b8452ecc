"""The metrics of a dataset upload at language-model K: the code before against now.

Every upload computes :func:`calibrators.evaluation.metrics.scores_report` of the raw scores
(``service/storage/registry.py``, ``add_dataset``). ``bench/lm_vocab.py`` found it
7.8 of the 10.8 s an upload of SmolLM2's 2,000 x 49,152 float32 logits spends in
the service's own steps. This script measures, in one process, on the same array:

* **rounds**: ``scores_report`` of ``--before`` (``calibrators/evaluation/metrics.py`` at that
  commit, read with ``git show`` and loaded as a module beside today's; it imports
  ``row_chunks``, ``softmax`` and the validation, unchanged) and of this checkout,
  alternating, ``--rounds`` times each: wall and CPU seconds, and the peak
  anonymous resident memory above its level before the call (``RssAnon``, sampled
  every 2 ms: allocations, the array itself excluded; glibc keeps freed blocks, so a
  call after a bigger one shows less); then one more call of each under
  tracemalloc, whose peak counts every numpy buffer exactly;
* **floor**: one float64 softmax pass over the array in row chunks (float64 copy,
  max, exp, sum, divide) on one thread: what both must compute at least;
* **per metric**: one pass of each version on one thread with each step timed
  separately over the chunks, and tracemalloc's peak during each step above the
  memory held before it (the largest over the chunks);
* **equality**: each figure of the two dicts, equal to the bit or the difference;
* **upload steps** (``--upload-cases``): the service's steps of an upload called in
  this process on a ``.npz`` of the case in a temporary folder, as
  ``bench/lm_vocab.py`` times them (read and validate, hash, metrics, write and
  fsync), with the metrics of both versions.

The synthetic logits look like a language model's next-token logits: a Zipf prior
over the vocabulary (``-1.1 log(rank)``), gaussian noise per entry (sd 1.5) and 16
boosted candidates per row (gamma(2, 2.5)); the labels are drawn from
``softmax(0.95 z)``, so the scores are a little over-confident. At 2,000 x 49,152:
top-1 accuracy about 0.48, mean entropy 3.6 nats, 1.6 probabilities a row at
least 1/15 (the other 49,150 are in the first of the 15 bins). A ``float16`` case
is rounded to float16 and widened to float32, as the service does while it reads
a float16 body.

Usage::

    .venv/bin/python bench/upload_metrics.py     # the three default cases (10-15 min)
    .venv/bin/python bench/upload_metrics.py --cases 400x49152:float32 --rounds 1 --upload-cases ''
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path

import numpy as np
from scipy.special import entr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from large_k import PeakAnon  # noqa: E402  (bench/, the script's own folder)

from calibrators import numerics  # noqa: E402
from calibrators.evaluation import metrics  # noqa: E402
from calibrators.numerics import row_chunks, softmax  # noqa: E402

#: The commit this change started from (main before the upload metrics were reworked).
BEFORE = "9a37d88"
CASES = "2000x49152:float32,2000x262144:float16,1000000x10:float32"
SEED = 20261204
N_BINS = metrics.DEFAULT_N_BINS


def make_logits(n: int, k: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Language-model-like float32 logits (n, k), written in row chunks, and labels."""
    rng = np.random.default_rng(SEED)
    prior = (-1.1 * np.log1p(rng.permutation(k))).astype(np.float32)
    z = np.empty((n, k), dtype=np.float32)
    y = np.empty(n, dtype=np.int64)
    for rows in row_chunks(n, k, 1 << 22):
        m = rows.stop - rows.start
        block = rng.standard_normal((m, k), dtype=np.float32)
        block *= 1.5
        block += prior
        cand = rng.integers(0, k, (m, 16))
        boost = rng.gamma(2.0, 2.5, (m, 16)).astype(np.float32)
        np.put_along_axis(block, cand, np.take_along_axis(block, cand, 1) + boost, 1)
        if dtype == "float16":
            block = block.astype(np.float16).astype(np.float32)
        z[rows] = block
        cdf = softmax(0.95 * block.astype(np.float64)).cumsum(axis=1)
        draw = rng.random((m, 1)) * cdf[:, -1:]
        y[rows] = np.minimum((cdf < draw).sum(axis=1), k - 1)
    return z, y


def load_before(commit: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{commit}:calibrators/evaluation/metrics.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    module = types.ModuleType("metrics_before")
    module.__file__ = f"{commit}:calibrators/evaluation/metrics.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def timed_call(module, z, y) -> tuple[dict, float, float, int]:
    with PeakAnon(interval=0.002) as anon:
        c0, t0 = time.process_time(), time.perf_counter()
        out = module.scores_report(z, y)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out, seconds, cpu, anon.extra


def traced_peak(module, z, y) -> int:
    """tracemalloc's peak during one ``scores_report`` call (the array excluded)."""
    tracemalloc.start()
    try:
        module.scores_report(z, y)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def floor_pass(z: np.ndarray) -> float:
    """One float64 softmax pass in row chunks, one thread; seconds."""
    t0 = time.perf_counter()
    for rows in row_chunks(*z.shape):
        softmax(z[rows].astype(np.float64))
    return time.perf_counter() - t0


class Steps:
    """Seconds and tracemalloc peak (above the memory held before it) of named steps."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}

    def __call__(self, name, fn, *args, **kwargs):
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        extra = tracemalloc.get_traced_memory()[1] - held
        self.peak[name] = max(self.peak.get(name, 0), extra)
        return out


def steps_before(old, z, y) -> Steps:
    """The loop of the old ``_report``, each step timed (one thread: it had none)."""
    n, k = z.shape
    step = Steps()
    classwise = np.zeros(k * N_BINS)
    for rows in row_chunks(n, k):
        u = step("float64 copy", z[rows].astype, np.float64)
        chunk = step("softmax", softmax, u)
        labels = y[rows]
        step("top label", old._top_label, chunk, labels)
        step("true class", old._true_class_probability, chunk, labels)
        step("brier", old._brier_sum, chunk, labels)
        step("entropy", lambda c: float(entr(c.astype(np.float64)).sum()), chunk)
        step("classwise", old._classwise_sums, chunk, N_BINS, classwise)
    return step


def steps_after(new, z, y) -> Steps:
    """The per-chunk work of today's ``_report``, each step timed, on one thread."""
    n, k = z.shape
    step = Steps()
    classwise = new._ClasswiseSums(k, N_BINS)
    inner = new.bin_edges(N_BINS)[1:-1]
    for rows in row_chunks(n, k):
        u = step("float64 copy", z[rows].astype, np.float64)
        chunk, _ = step("softmax + entropy", numerics.softmax_entropy, u)
        labels = y[rows]
        step("top label", new._top_label, chunk, labels)
        step("true class", new._true_class_probability, chunk, labels)
        step("brier", new._brier_sum, chunk, labels, scratch=True)
        part = step("classwise", new._classwise_chunk, chunk, inner)
        step("classwise", classwise.add, part)
    return step


def compare(a: dict, b: dict) -> str:
    """Which figures differ between the two reports, and by how much."""
    out = []
    for key, x in a.items():
        if x == b[key]:
            continue
        if isinstance(x, float):
            out.append(f"{key} {x!r} -> {b[key]!r} (abs {abs(b[key] - x):.1e}, "
                       f"rel {abs(b[key] - x) / max(abs(x), 1e-300):.1e})")
        else:
            out.append(f"{key} differs")
    return "every figure equal to the bit" if not out else "; ".join(out)


def upload_steps(old, z: np.ndarray, y: np.ndarray, dtype: str) -> None:
    """The service's steps of an upload of this case's ``.npz``, in this process."""
    from service.api.codecs import npz, rules
    from service.settings import Settings
    from service.storage.arrays import ArrayStore

    with tempfile.TemporaryDirectory(prefix="welltempered-upload-metrics-") as tmp:
        path = Path(tmp) / "dataset.npz"
        np.savez(path, logits=z.astype(dtype), labels=y)
        seconds = {}
        t0 = time.perf_counter()
        data = npz.labelled_from_npz(
            path, rules.bounds(Settings(), "dataset", z.shape[1], "bench")
        )
        seconds["read and validate"] = time.perf_counter() - t0
        store = ArrayStore(Path(tmp) / "arrays")
        for name, module in (("before", old), ("after", metrics)):
            t0 = time.perf_counter()
            module.scores_report(data.scores, data.labels, data.kind)
            seconds[f"metrics, {name}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for a in (data.scores, data.labels):
            store.write(a)
        seconds["write (hashed as written, fsync)"] = time.perf_counter() - t0
    rest = sum(v for key, v in seconds.items() if not key.startswith("metrics"))
    print(f"\nupload steps in this process ({dtype} .npz, stored as {data.scores.dtype}): "
          + ", ".join(f"{key} {v:.2f} s" for key, v in seconds.items()))
    print(f"together: before {rest + seconds['metrics, before']:.2f} s, after "
          f"{rest + seconds['metrics, after']:.2f} s", flush=True)


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_case(spec: str, old, rounds: int, upload: bool) -> None:
    shape, dtype = spec.split(":")
    n, k = (int(v) for v in shape.split("x"))
    t0 = time.perf_counter()
    z, y = make_logits(n, k, dtype)
    sample = softmax(z[: min(n, 200)].astype(np.float64))
    top = sample.max(axis=1)
    print(f"\n## {n:,} x {k:,} {dtype}" + (" (widened to float32)" if dtype != "float32" else ""))
    print(f"\n{z.nbytes / 2**20:,.1f} MiB float32, made in {time.perf_counter() - t0:.1f} s; "
          f"first {sample.shape[0]} rows: mean top-1 probability {top.mean():.3f}, "
          f"accuracy {(sample.argmax(axis=1) == y[: sample.shape[0]]).mean():.3f}, "
          f"probabilities >= 1/{N_BINS} per row {(sample >= 1 / N_BINS).sum(axis=1).mean():.2f}; "
          f"load average {load()}", flush=True)
    del sample

    floors = [floor_pass(z) for _ in range(2)]
    floor = min(floors)
    print(f"\nfloor (one float64 softmax pass, one thread): {floor:.2f} s "
          f"(rounds {', '.join(f'{f:.2f}' for f in floors)})", flush=True)

    results = {"before": [], "after": []}
    reports = {}
    for _ in range(rounds):
        for name, module in (("before", old), ("after", metrics)):
            out, seconds, cpu, anon = timed_call(module, z, y)
            results[name].append((seconds, cpu, anon))
            reports[name] = out
            print(f"  {name}: {seconds:.2f} s, CPU {cpu:.2f} s, anon +{anon / 2**20:.1f} MiB",
                  flush=True)
    print(f"\n{compare(reports['before'], reports['after'])}")
    after = reports["after"]
    print(f"(ECE {after['ece']:.4f}, classwise ECE {after['classwise_ece']:.3e}, NLL "
          f"{after['nll']:.4f}, entropy {after['entropy']:.4f}, accuracy {after['accuracy']:.4f})")

    traced = {"before": traced_peak(old, z, y), "after": traced_peak(metrics, z, y)}
    print("\n| code | best s | median s | CPU s (median) | x floor (best) | peak anon MiB "
          "| traced peak MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("before", "after"):
        seconds = [r[0] for r in results[name]]
        cpus = [r[1] for r in results[name]]
        anon = max(r[2] for r in results[name])
        print(f"| {name} | {min(seconds):.2f} | {statistics.median(seconds):.2f} "
              f"| {statistics.median(cpus):.2f} | {min(seconds) / floor:.1f} "
              f"| {anon / 2**20:.1f} | {traced[name] / 2**20:.1f} |")
    best = min(r[0] for r in results["before"]) / min(r[0] for r in results["after"])
    median = (statistics.median(r[0] for r in results["before"])
              / statistics.median(r[0] for r in results["after"]))
    cpu = (statistics.median(r[1] for r in results["before"])
           / statistics.median(r[1] for r in results["after"]))
    print(f"\nbefore / after: {best:.2f}x (best rounds), {median:.2f}x (median), "
          f"{cpu:.2f}x CPU seconds (median)", flush=True)

    tracemalloc.start()
    try:
        parts = {"before": steps_before(old, z, y), "after": steps_after(metrics, z, y)}
    finally:
        tracemalloc.stop()
    print("\nper metric, one thread, each step timed apart over the chunks "
          "(peak: tracemalloc, above what was held before the step):\n")
    print("| code | step | seconds | peak MiB |")
    print("| --- | --- | ---: | ---: |")
    for name, step in parts.items():
        for key, seconds in step.seconds.items():
            print(f"| {name} | {key} | {seconds:.2f} | {step.peak[key] / 2**20:.1f} |")
        print(f"| {name} | **all steps** | **{sum(step.seconds.values()):.2f}** | |")
    if upload:
        upload_steps(old, z, y, dtype)
    print(f"\nload average at the end of the case: {load()}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=CASES, help=f"N x K:dtype, comma-separated ({CASES})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default=BEFORE, help=f"the commit to compare with ({BEFORE})")
    parser.add_argument("--upload-cases", default=CASES.split(",")[0],
                        help="cases whose upload steps are timed too (comma-separated)")
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    print(f"# bench/upload_metrics.py --cases {args.cases} --rounds {args.rounds} "
          f"--before {args.before} (at {head}): {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, numpy {np.__version__}, threads "
          f"{numerics.n_threads()}; load average {load()}")
    old = load_before(args.before)
    for spec in args.cases.split(","):
        run_case(spec, old, args.rounds, spec in args.upload_cases.split(","))
    print(f"\n# load average at the end: {load()}")


if __name__ == "__main__":
    main()
