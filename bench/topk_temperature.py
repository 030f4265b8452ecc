"""Temperature from the top-k log-probabilities against temperature from the full vocabulary.

    .venv/bin/python bench/topk_temperature.py [--full /tmp/welltempered-lm-fixture-full.npy]

A team that calls a hosted model sees the top 20 log-probabilities of each token, never
the full vocabulary: how close does :class:`calibrators.topk.TopKTemperature` come to
the temperature fitted on every logit? On the positions of the committed fixture
(``tests/data/lm/smollm2_top20.npz``, SmolLM2-135M on Python's help texts) and their full
logits (N x 49,152 float32, written by ``bench/lm_fixture.py`` in its own venv: see its
docstring; never committed):

1. ``TemperatureScaler`` on the full logits: ``beta_full``, the floor;
2. ``TopKTemperature`` on the top-k of the same rows for each ``--ks`` (20 is the
   fixture's own rows, the others are cut from the full logits the same way) and each
   tail model: its ``beta`` and its gap ``beta / beta_full - 1``;
3. what the gap costs: the full-vocabulary mean NLL at each ``beta`` minus the NLL at
   ``beta_full`` (nats per token; the full fit's own NLL is the minimum);
4. the shape of the real tail, which the tail models guess: on every 10th row, the
   median least-squares slope of the sorted log-probabilities against ``log rank`` over
   rank ranges, and the median of the tail's mass-weighted mean log-probability beside
   the uniform tail's ``log(T / (V - 20))``;
5. on held-out texts: the fixture split by sequence (``split_indices`` with the
   sequence ids, hold-out 0.2, seed 0), each fit made on the fit rows, and the
   held-out rows' full-vocabulary mean NLL at beta 1 (uncalibrated) and at each fit's
   beta.

Each fit's seconds are printed beside the full fit's. The machine's load average is
printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibrators import topk  # noqa: E402
from calibrators.evaluation.holdout import split_indices  # noqa: E402
from calibrators.methods.temperature import TemperatureScaler  # noqa: E402
from calibrators.numerics import log_softmax  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "lm" / "smollm2_top20.npz"


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def full_nll(z: np.ndarray, labels: np.ndarray, beta: float) -> float:
    """Mean NLL of ``softmax(beta z)`` on the full vocabulary, in row blocks."""
    total = 0.0
    for start in range(0, len(z), 256):
        block = log_softmax(beta * z[start:start + 256].astype(np.float64))
        total -= block[np.arange(len(block)), labels[start:start + 256]].sum()
    return total / len(z)


def top_k_rows(z: np.ndarray, k: int) -> topk.TopK:
    """The top-k of each row of the full logits, as an API gives them (sorted)."""
    ids = np.empty((len(z), k), np.int64)
    lp = np.empty((len(z), k), np.float64)
    for start in range(0, len(z), 256):
        block = log_softmax(z[start:start + 256].astype(np.float64))
        part = np.argpartition(-block, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(block, part, 1), axis=1, kind="stable")
        ids[start:start + 256] = np.take_along_axis(part, order, 1)
        lp[start:start + 256] = np.take_along_axis(block, ids[start:start + 256], 1)
    return topk.as_topk(ids, lp.astype(np.float32), z.shape[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", type=Path, default=Path("/tmp/welltempered-lm-fixture-full.npy"))
    parser.add_argument("--ks", type=int, nargs="+", default=[5, 20, 100, 1000])
    args = parser.parse_args(argv)
    if not args.full.exists():
        raise SystemExit(f"{args.full} is missing: run bench/lm_fixture.py (see its docstring)")
    print(f"load average {load_average()}")
    with np.load(FIXTURE) as npz:
        fixture, labels = topk.from_arrays(npz)
        sequence_ids = npz["sequence_ids"]
        sequences = len(np.unique(sequence_ids))
    z = np.load(args.full, mmap_mode="r")
    print(f"{len(labels):,} positions ({sequences} sequences) x {z.shape[1]:,}; label in the "
          f"top-20: {(fixture.label_in_top_k(labels) >= 0).mean():.3f}")
    t0 = time.perf_counter()
    full = TemperatureScaler().fit(z, labels)
    full_seconds = time.perf_counter() - t0
    floor = full_nll(z, labels, full.beta_)
    print(f"full vocabulary: beta {full.beta_:.6f} (T = {1 / full.beta_:.4f}), NLL {floor:.5f} "
          f"(at beta 1: {full_nll(z, labels, 1.0):.5f}), {full_seconds:.2f} s")
    print(f"{'k':>6} {'tail':>8} {'in top-k':>8} {'beta':>10} {'gap':>8} {'NLL - floor':>12} "
          f"{'seconds':>8}")
    for k in args.ks:
        rows = fixture if k == fixture.k else top_k_rows(z, k)
        if k == fixture.k:  # the fixture's rows are exactly these: checked, not assumed
            np.testing.assert_array_equal(top_k_rows(z, k).ids, rows.ids)
        for tail in topk.TAILS:
            t0 = time.perf_counter()
            cal = topk.TopKTemperature(tail=tail).fit(rows, labels)
            seconds = time.perf_counter() - t0
            gap = cal.beta_ / full.beta_ - 1
            cost = full_nll(z, labels, cal.beta_) - floor
            print(f"{k:>6} {tail:>8} {cal.fit_info_['label_in_top_k']:>8.3f} {cal.beta_:>10.6f} "
                  f"{gap:>+8.2%} {cost:>12.2e} {seconds:>8.3f}")
    tail_shape(z)
    held_out(z, fixture, labels, sequence_ids)
    print(f"load average {load_average()}")


def held_out(z, rows: topk.TopK, labels, sequence_ids) -> None:
    """Part 5 of the module docstring."""
    fit, test = split_indices(len(labels), 0.2, 0, groups=sequence_ids)
    zt = np.asarray(z[np.sort(test)])
    yt = labels[np.sort(test)]
    print(f"held out: {len(test):,} rows of {len(np.unique(sequence_ids[test]))} sequences; "
          f"full-vocabulary NLL at beta 1 {full_nll(zt, yt, 1.0):.5f}")
    fits = {"full vocabulary": TemperatureScaler().fit(z[np.sort(fit)], labels[np.sort(fit)])}
    part = topk.as_topk(rows.ids[fit], rows.logprobs[fit], rows.vocab_size)
    for tail in topk.TAILS:
        fits[f"top-20, {tail}"] = topk.TopKTemperature(tail=tail).fit(part, labels[fit])
    for name, cal in fits.items():
        print(f"  {name:<18} beta {cal.beta_:.6f}  held-out NLL {full_nll(zt, yt, cal.beta_):.5f}")


def tail_shape(z: np.ndarray, k: int = 20) -> None:
    """Part 4 of the module docstring."""
    lp = -np.sort(-log_softmax(z[::10].astype(np.float64)), axis=1)
    log_r = np.log(np.arange(1, lp.shape[1] + 1))
    for a, b in ((1, 20), (20, 100), (100, 1000), (1000, 10_000), (10_000, lp.shape[1])):
        x = log_r[a - 1:b] - log_r[a - 1:b].mean()
        print(f"ranks {a:>6,}-{b:<6,} median slope against log rank "
              f"{np.median(lp[:, a - 1:b] @ x / (x @ x)):+.2f}")
    p = np.exp(lp[:, k:])
    mass = p.sum(axis=1)
    print(f"tail beyond {k}: mass-weighted mean log-probability (median) "
          f"{np.median((p * lp[:, k:]).sum(axis=1) / mass):.2f}; the uniform tail's "
          f"{np.median(np.log(mass / (lp.shape[1] - k))):.2f}")


if __name__ == "__main__":
    main()
