"""Suite-wide fixtures: the shared CIFAR outputs, hypothesis profiles, and the
rule that CI (WELLTEMPERED_CI=1, set by .ci/run) fails instead of skipping."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import IN_CI, SharedData, load_shared

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=["wideresnet-16-4-cifar-100", "lenet-5-cifar-10"])
def shared(request) -> SharedData:
    return load_shared(request.param)


@pytest.fixture
def cifar100() -> SharedData:
    return load_shared("wideresnet-16-4-cifar-100")


@pytest.fixture
def cifar10() -> SharedData:
    return load_shared("lenet-5-cifar-10")


def pytest_collection_modifyitems(items):
    """A test that uses the PostgreSQL server (the ``pg_admin`` fixture, directly or
    through another fixture) is marked ``postgres``, so ``-m "not postgres"`` (make
    test-fast) leaves out exactly the tests that need the server."""
    for item in items:
        if "pg_admin" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI every part of the suite must run: a skip is turned into a failure."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (WELLTEMPERED_CI=1), which must run everything: {reason}"
