"""Crash safety: array files before rows, one-transaction results, recovery at start."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from service.api.app import create_app
from service.storage import registry
from service.storage.arrays import ArrayStore
from service.storage.db import make_engine
from service.vocabulary import DEFAULT_NAMESPACE
from tests.service.helpers import create_model, logits_data, upload


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


def test_clean_tmp_removes_leftovers(tmp_path):
    arrays = ArrayStore(tmp_path)
    leftover = arrays.temp_path(".npz")
    leftover.write_bytes(b"half an upload")
    assert arrays.clean_tmp() == 1 and not leftover.exists()


def test_start_up_fails_jobs_left_by_a_dead_process(settings):
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        logits, labels = logits_data()
        ds = upload(c, "m", logits, labels)
    # A "dead server" left a queued job: the row exists, no pool ever ran it.
    engine = make_engine(settings.database_url)
    try:
        with sessionmaker(engine, expire_on_commit=False)() as s:
            model = registry.find_model(s, "m", DEFAULT_NAMESPACE)
            dataset = registry.find_dataset(s, model, ds["id"])
            row = registry.create_version(
                s, model, dataset, method="temperature", holdout=0.2, seed=0, options={}
            )
            assert row.status == "queued"
    finally:
        engine.dispose()
    with TestClient(create_app(settings)) as c:
        v = c.get(f"/v1/models/m/calibrators/{row.version}").json()
        assert v["status"] == "failed" and "interrupted" in v["error"], v
        assert v["params"] is None
