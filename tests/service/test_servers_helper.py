"""The test helpers' processes do not outlive a start that failed (tests/service/servers.py):
``with Server(...)`` calls no ``__exit__`` when starting raises, so the helper kills the
process group itself."""

from __future__ import annotations

import os

import pytest

from tests.service.servers import Server

pytestmark = [pytest.mark.slow, pytest.mark.process]


def test_a_server_that_does_not_become_ready_in_time_is_killed_with_its_group(tmp_path):
    server = Server(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path / "data")
    with pytest.raises(AssertionError, match="did not become ready"):
        server.start(timeout=0)  # it is still importing when the deadline passes
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)  # no process of the group is left
