"""Helpers shared by every test: the CI rule (fail, never skip, in CI) and the
shared CIFAR outputs. Test files import from here, never from a conftest."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from calibrators.evaluation.holdout import split_indices

#: What the wheel is built from: the files the Dockerfile's build stage copies.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "calibrators", "service", "migrations")
IN_CI = os.environ.get("WELLTEMPERED_CI") == "1"
DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def skip_or_fail(reason: str):
    """Skip with a clear message on a user's machine; fail in CI."""
    if IN_CI:
        pytest.fail(f"{reason} (required in CI: WELLTEMPERED_CI=1)", pytrace=False)
    pytest.skip(reason)


class SharedData:
    """One ../shared/data file split by the convention of its README."""

    def __init__(self, path: Path):
        with np.load(path) as f:
            self.probs = f["predictions"]
            self.labels = f["ground_truth"]
        # The convention of the shared data: half/half, seed 0.
        self.fit_idx, self.test_idx = split_indices(self.labels.shape[0], 0.5, seed=0)
        self.name = path.stem

    @property
    def fit(self):
        return self.probs[self.fit_idx], self.labels[self.fit_idx]

    @property
    def test(self):
        return self.probs[self.test_idx], self.labels[self.test_idx]


_cache: dict[str, SharedData] = {}


def load_shared(stem: str) -> SharedData:
    path = DATA_DIR / f"{stem}.npz"
    if not path.exists():
        skip_or_fail(f"shared data {path} not found: the CIFAR outputs live beside the project")
    if stem not in _cache:
        _cache[stem] = SharedData(path)
    return _cache[stem]


