"""WELLTEMPERED_ARRAY_STORE: the arrays in a folder or behind an fsspec URL
(``memory://`` in one process, ``local://`` across processes standing in for an
object store: replicas and workers share nothing else)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.storage.arrays import ArrayStore
from tests.service.helpers import (
    create_model,
    families,
    fit,
    logits_data,
    make_settings,
    upload,
)
from tests.service.servers import Server, Worker

fsspec = pytest.importorskip("fsspec")


def memory_url() -> str:
    return f"memory://wt-{uuid.uuid4().hex[:12]}"


def test_a_url_store_writes_reads_lists_and_removes(tmp_path):
    url = memory_url()
    store = ArrayStore(tmp_path, url)
    store.ensure()
    a = np.arange(12.0).reshape(3, 4)
    sha = store.put(a)
    fs, base = fsspec.core.url_to_fs(url)
    assert fs.isfile(f"{base}/{sha[:2]}/{sha}.npy")
    assert not (tmp_path / "arrays").exists()  # nothing of the arrays on local disk
    assert store.exists(sha) and not store.exists("0" * 64)
    np.testing.assert_array_equal(store.load(sha), a)
    assert (tmp_path / "cache" / sha[:2] / f"{sha}.npy").exists()  # the read copy
    listed = list(store.files())
    assert [f.sha256 for f in listed] == [sha] and listed[0].size > a.nbytes
    assert listed[0].mtime > 0
    assert store.remove(sha) > a.nbytes and store.remove(sha) == 0
    assert not store.exists(sha) and list(store.files()) == []
    assert not (tmp_path / "cache" / sha[:2] / f"{sha}.npy").exists()
    with pytest.raises(FileNotFoundError):
        store.load(sha)
    assert list(store.tmp.iterdir()) == []


def test_a_folder_url_is_a_folder(tmp_path):
    store = ArrayStore(tmp_path / "local", f"file://{tmp_path / 'shared'}")
    sha = store.put(np.ones(3))
    assert (tmp_path / "shared" / sha[:2] / f"{sha}.npy").is_file()


def test_the_service_on_a_url_store(database_url, tmp_path):
    url = memory_url()
    settings = make_settings(database_url, tmp_path, array_store=url)
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        z, y = logits_data()
        ds = upload(c, "m", z, y)["id"]
        fs, base = fsspec.core.url_to_fs(url)
        assert len(fs.find(base)) == 2
        v = fit(c, "m", ds)
        assert v["status"] == "succeeded", v
        assert c.delete(f"/v1/models/m/calibrators/{v['version']}").status_code == 200
        assert c.delete(f"/v1/models/m/datasets/{ds}").status_code == 200
        assert fs.find(base) == []  # freed in the store


@pytest.mark.slow
@pytest.mark.process
def test_a_worker_that_shares_only_the_store_and_the_database(pg_schema, tmp_path):
    """The API replica and the worker each have their own data folder; the arrays are
    behind a URL (local:// standing in for an object store)."""
    from service.storage import migrate
    from tests.oracles import wait_for_version
    from tests.service.test_fleet import FAST_HEARTBEATS, npz, version

    migrate.upgrade(pg_schema)
    store = f"local://{tmp_path / 'object-store'}"
    with (
        Server(
            pg_schema, tmp_path / "api", run_fits="false", array_store=store, **FAST_HEARTBEATS
        ) as api,
        Worker(
            pg_schema,
            tmp_path / "worker",
            array_store=store,
            fit_executor="process",
            **FAST_HEARTBEATS,
        ),
        api.client() as c,
    ):
        assert c.post("/v1/models", json={"name": "m", "num_classes": 4}).status_code == 201
        z, y = logits_data()
        r = c.post(
            "/v1/models/m/datasets",
            content=npz(z, y),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        r = c.post(
            "/v1/models/m/calibrators", json={"dataset_id": r.json()["id"], "method": "temperature"}
        )
        v = r.json()["version"]
        done = wait_for_version(c, "m", v, lambda b: b["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded", done
        assert version(c, "m", v)["params"]["method"] == "temperature"
    assert not (tmp_path / "api" / "arrays").exists()
    assert any((tmp_path / "worker" / "cache").rglob("*.npy"))  # the worker's read copies


@pytest.mark.parametrize(
    "executor", ["thread", pytest.param("process", marks=[pytest.mark.process, pytest.mark.slow])]
)
def test_fits_read_through_the_bounded_cache_and_metrics_count_it(tmp_path, executor):
    """WELLTEMPERED_ARRAY_CACHE_BYTES reaches the fits (in this process, or in a fit
    process that sends its figures back); /metrics counts hits, misses and evictions."""
    url = f"local://{tmp_path / 'object-store'}"
    settings = make_settings(
        f"sqlite:///{tmp_path / 'registry.sqlite3'}",
        tmp_path,
        array_store=url,
        array_cache_bytes=30_000,
        fit_executor=executor,
    )
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        first, second = (upload(c, "m", *logits_data(n=500, seed=s))["id"] for s in (1, 2))
        sizes = sorted(f.size for f in ArrayStore(tmp_path, url).files())
        assert sizes == [4128, 4128, 16128, 16128]  # labels, scores: one dataset fits
        for ds in (first, first, second):
            assert fit(c, "m", ds)["status"] == "succeeded"
        # 1st fit: 2 misses; 2nd: 2 hits; 3rd: its scores evict the least recently used
        # copy (the first scores), its labels fit beside
        cache = ArrayStore(settings.data_dir, url).read_cache
        assert cache.usage() == 4128 + 16128 + 4128 <= 30_000
        # A fit process's figures reach these counters when the worker reads its pipe,
        # after the process ended, so after the version's outcome is written: wait for
        # the third fit's (in a thread they are counted before the outcome).
        deadline = time.monotonic() + 30
        while True:
            got = families(c.get("/metrics").text)
            counted = got.get("welltempered_array_cache_misses_total", {}).get((), 0)
            if counted >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got["welltempered_array_cache_hits_total"][()] == 2
        assert got["welltempered_array_cache_misses_total"][()] == 4
        assert got["welltempered_array_cache_evictions_total"][()] == 1
        assert got["welltempered_array_cache_bytes"][()] == cache.usage()
