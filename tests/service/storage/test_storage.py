"""Crash safety: array files before rows, one-transaction results, recovery at start."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from service.api.app import create_app
from service.jobs.queue import job_engine
from service.storage import fits, registry
from service.storage.arrays import ArrayStore
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_NAMESPACE
from tests.oracles import wait_for_version
from tests.service.helpers import create_model, dead_process_temp, logits_data, upload


def test_put_is_content_addressed_and_atomic(tmp_path, monkeypatch):
    arrays = ArrayStore(tmp_path)
    arrays.ensure()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    sha = arrays.put(a)
    assert arrays.put(a.copy()) == sha  # same content, same name
    np.testing.assert_array_equal(arrays.load(sha), a)
    assert len(list(arrays.arrays.rglob("*.npy"))) == 1

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        arrays.put(a + 1)
    # Nothing under the final name, no temp file left behind.
    assert len(list(arrays.arrays.rglob("*.npy"))) == 1
    assert list(arrays.tmp.iterdir()) == []


def test_clean_tmp_removes_leftovers_of_dead_processes_only(tmp_path):
    arrays = ArrayStore(tmp_path)
    leftover = dead_process_temp(arrays, ".npz")
    leftover.write_bytes(b"half an upload")
    mine = arrays.temp_path(".npz")  # this process is alive: its upload stays
    elsewhere = arrays.tmp / "other.host-1-abc.npz"  # another host's: by age only
    elsewhere.write_bytes(b"x")
    assert arrays.clean_tmp(older_than_seconds=3600) == 0
    assert arrays.clean_tmp() == 2
    assert not leftover.exists() and not elsewhere.exists() and mine.exists()


def test_fits_left_by_a_dead_process_run_at_the_next_start(settings):
    """A stopped server left one fit queued and one running: the next start runs both
    (the running one as its second attempt); neither is marked failed."""
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        logits, labels = logits_data()
        ds = upload(c, "m", logits, labels)
    engine = make_engine(settings.database_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    left = []
    try:
        with sessions() as s:
            model = registry.find_model(s, "m", DEFAULT_NAMESPACE)
            dataset = registry.find_dataset(s, model, ds["id"])
            jobs = None if settings.is_sqlite else job_engine(settings, sessions)
            for _ in range(2):
                row = registry.create_version(
                    s,
                    model,
                    dataset,
                    method="temperature",
                    holdout=0.2,
                    seed=0,
                    options={},
                    enqueue=None if jobs is None else (lambda s, v: jobs.enqueue(s, v, "default")),
                )
                left.append(row.version)
        if settings.is_sqlite:  # the second one was running when its process died
            claimed = fits.claim(sessions, row.id, "dead:1:serve", max_attempts=5)
            assert claimed.attempt == 1
    finally:
        engine.dispose()
    with TestClient(create_app(settings)) as c:
        done = [wait_for_version(c, "m", v) for v in left]
    assert [v["status"] for v in done] == ["succeeded", "succeeded"], done
    assert [v["attempts"] for v in done] == [1, 2 if settings.is_sqlite else 1]
