"""Suite-wide fixtures: the shared CIFAR outputs, hypothesis profiles, and the
rule that CI (WELLTEMPERED_CI=1, set by .ci/run) fails instead of skipping."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

IN_CI = os.environ.get("WELLTEMPERED_CI") == "1"
DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
        n = self.labels.shape[0]
        perm = np.random.default_rng(0).permutation(n)
        self.fit_idx, self.test_idx = perm[: n // 2], perm[n // 2 :]
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


@pytest.fixture(params=["wideresnet-16-4-cifar-100", "lenet-5-cifar-10"])
def shared(request) -> SharedData:
    return load_shared(request.param)


@pytest.fixture
def cifar100() -> SharedData:
    return load_shared("wideresnet-16-4-cifar-100")


@pytest.fixture
def cifar10() -> SharedData:
    return load_shared("lenet-5-cifar-10")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI every part of the suite must run: a skip is turned into a failure."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (WELLTEMPERED_CI=1), which must run everything: {reason}"
