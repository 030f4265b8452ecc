"""Deleting models, datasets, versions and aliases; array files freed exactly when the last
dataset naming them goes; the orphan sweep; on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service import cli
from service.api.app import create_app
from service.jobs.sweeper import Sweeper
from service.security import keys
from service.server.budget import flatten
from service.storage import array_refs, registry, usage
from service.storage.arrays import ArrayStore
from service.storage.db import ArrayFile, FeedbackBin
from service.vocabulary import DEFAULT_ALIAS, DEFAULT_NAMESPACE
from tests.service.helpers import (
    assert_problem,
    create_model,
    dead_process_temp,
    fit,
    hold_queue,
    logits_data,
    make_settings,
    promote,
    upload,
)


def store(client: TestClient) -> ArrayStore:
    return client.app.state.welltempered.arrays


def files_on_disk(client: TestClient) -> set[str]:
    return {f.sha256 for f in store(client).files()}


def dataset_files(client: TestClient, model: str, dataset_id: int) -> set[str]:
    state = client.app.state.welltempered
    with state.sessions() as s:
        ds = registry.find_dataset(s, registry.find_model(s, model, DEFAULT_NAMESPACE), dataset_id)
        return set(array_refs.dataset_files(ds))


def hold_fits(client: TestClient) -> None:
    """Fits are queued and never started: the queue neither writes a job (PostgreSQL) nor
    hands the version to a thread (SQLite)."""
    hold_queue(client)


def queue_fit(client: TestClient, model: str, dataset_id: int) -> int:
    body = {"dataset_id": dataset_id, "method": "temperature"}
    r = client.post(f"/v1/models/{model}/calibrators", json=body)
    assert r.status_code == 202, r.text
    return r.json()["version"]


def test_deletes_need_the_write_scope(client):
    declared = {
        route.path: route.limits.scope
        for route in flatten(client.app.routes)
        if "DELETE" in (getattr(route, "methods", None) or ())
    }
    for path in (
        "/v1/models/{model}",
        "/v1/models/{model}/datasets/{dataset_id}",
        "/v1/models/{model}/calibrators/{version}",
        "/v1/models/{model}/aliases/{alias}",
    ):
        assert declared[path] == "write"


def test_delete_alias_stops_serving_through_it(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)
    v = promote(client, "m", ds["id"])
    assert client.post("/v1/models/m/predict", json={"logits": z[:2].tolist()}).status_code == 200
    r = client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "model": "m",
        "datasets": [],
        "versions": [],
        "aliases": [DEFAULT_ALIAS],
        "stored_bytes_released": 0,
    }
    assert_problem(client.post("/v1/models/m/predict", json={"logits": z[:2].tolist()}), 404)
    assert_problem(client.get(f"/v1/models/m/aliases/{DEFAULT_ALIAS}"), 404)
    assert_problem(client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}"), 404)
    assert_problem(client.delete("/v1/models/m/aliases/bad%20name"), 404)
    # the version itself is still there and servable by number
    r = client.post(f"/v1/models/m/predict?version={v['version']}", json={"logits": z[:2].tolist()})
    assert r.status_code == 200


def test_delete_version_refused_while_aliased_or_fitting(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)
    v1 = promote(client, "m", ds["id"])["version"]
    client.put("/v1/models/m/aliases/canary", json={"version": v1})
    body = assert_problem(
        client.delete(f"/v1/models/m/calibrators/{v1}"), 409, "canary", "production"
    )
    assert body["type"] == "/problems/in-use"
    assert body["aliases"] == ["canary", DEFAULT_ALIAS] and body["versions"] == [v1]
    # feedback sums recorded for it go with it
    r = client.post(
        "/v1/models/m/feedback", json={"logits": z[:50].tolist(), "labels": y[:50].tolist()}
    )
    assert r.status_code == 200, r.text
    # a fit that has not finished
    hold_fits(client)
    v2 = queue_fit(client, "m", ds["id"])
    body = assert_problem(client.delete(f"/v1/models/m/calibrators/{v2}"), 409, "not finished")
    assert body["type"] == "/problems/in-use" and body["fits"] == [v2]
    # move one alias, delete the other: then it goes
    for alias in ("canary", DEFAULT_ALIAS):
        assert client.delete(f"/v1/models/m/aliases/{alias}").status_code == 200
    r = client.delete(f"/v1/models/m/calibrators/{v1}")
    assert r.status_code == 200, r.text
    assert r.json()["versions"] == [v1] and r.json()["datasets"] == []
    assert_problem(client.get(f"/v1/models/m/calibrators/{v1}"), 404)
    assert_problem(client.delete(f"/v1/models/m/calibrators/{v1}"), 404)
    r = client.post(f"/v1/models/m/predict?version={v1}", json={"logits": z[:2].tolist()})
    assert_problem(r, 404)
    with client.app.state.welltempered.sessions() as s:
        assert s.scalar(select(func.count()).select_from(FeedbackBin)) == 0
    # numbers are never given again
    assert queue_fit(client, "m", ds["id"]) == v2 + 1


def test_delete_dataset_refused_while_versions_need_it_unless_cascade(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    files = dataset_files(client, "m", ds)
    v1 = promote(client, "m", ds)["version"]
    v2 = fit(client, "m", ds)["version"]
    body = assert_problem(client.delete(f"/v1/models/m/datasets/{ds}"), 409, "cascade=true")
    assert body["type"] == "/problems/in-use" and body["versions"] == [v1, v2]
    # cascade: still refused while a version has an alias
    body = assert_problem(client.delete(f"/v1/models/m/datasets/{ds}?cascade=true"), 409, "alias")
    assert body["aliases"] == [DEFAULT_ALIAS] and body["versions"] == [v1]
    assert_problem(client.delete(f"/v1/models/m/datasets/{ds}?cascade="), 422)
    assert files <= files_on_disk(client)  # refusals change nothing
    assert client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}").status_code == 200
    # ... and while one is fitting
    hold_fits(client)
    v3 = queue_fit(client, "m", ds)
    body = assert_problem(client.delete(f"/v1/models/m/datasets/{ds}?cascade=true"), 409, "finish")
    assert body["fits"] == [v3]
    r = client.post(f"/v1/models/m/calibrators/{v3}/cancel")  # then it has finished
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    r = client.delete(f"/v1/models/m/datasets/{ds}?cascade=true")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["datasets"] == [ds] and out["versions"] == [v1, v2, v3]
    assert out["stored_bytes_released"] > 0
    assert_problem(client.get(f"/v1/models/m/datasets/{ds}"), 404)
    assert_problem(client.get(f"/v1/models/m/calibrators/{v1}"), 404)
    assert not files & files_on_disk(client)


def test_a_dataset_without_versions_goes_without_cascade(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    files = dataset_files(client, "m", ds)
    assert files <= files_on_disk(client)
    r = client.delete(f"/v1/models/m/datasets/{ds}")
    assert r.status_code == 200, r.text
    assert r.json()["datasets"] == [ds] and r.json()["versions"] == []
    assert files_on_disk(client) == set()
    assert client.get("/v1/models/m/datasets").json()["datasets"] == []
    assert_problem(client.delete(f"/v1/models/m/datasets/{ds}"), 404)
    # the same content again: a new dataset, its files written again
    again = upload(client, "m", z, y)
    assert dataset_files(client, "m", again["id"]) == files <= files_on_disk(client)


def test_shared_files_are_freed_exactly_when_the_last_dataset_goes(client):
    """Same scores in two models, same labels in two datasets of one model."""
    create_model(client, "a", 4)
    create_model(client, "b", 4)
    z, y = logits_data(seed=1)
    z2, _ = logits_data(seed=2)
    a1 = upload(client, "a", z, y)["id"]
    a2 = upload(client, "a", z2, y)["id"]  # shares the labels file with a1
    b1 = upload(client, "b", z, y)["id"]  # shares both files with a1
    scores1, labels = (
        dataset_files(client, "a", a1) - dataset_files(client, "a", a2),
        dataset_files(client, "a", a1) & dataset_files(client, "a", a2),
    )
    scores2 = dataset_files(client, "a", a2) - labels
    assert len(scores1) == len(labels) == len(scores2) == 1
    assert files_on_disk(client) == scores1 | scores2 | labels

    assert client.delete(f"/v1/models/a/datasets/{a1}").status_code == 200
    assert files_on_disk(client) == scores1 | scores2 | labels  # b1 still names them all
    assert client.delete(f"/v1/models/b/datasets/{b1}").status_code == 200
    assert files_on_disk(client) == scores2 | labels  # a2 names labels
    assert client.delete(f"/v1/models/a/datasets/{a2}").status_code == 200
    assert files_on_disk(client) == set()
    with client.app.state.welltempered.sessions() as s:
        assert s.scalar(select(func.count()).select_from(ArrayFile)) == 0


def test_delete_model_takes_everything_but_not_while_in_service(client):
    create_model(client, "m", 4)
    create_model(client, "other", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    other = upload(client, "other", z, y)["id"]  # the same files
    v1 = promote(client, "m", ds)["version"]
    v2 = fit(client, "m", ds)["version"]
    client.post(
        "/v1/models/m/feedback", json={"logits": z[:50].tolist(), "labels": y[:50].tolist()}
    )
    body = assert_problem(client.delete("/v1/models/m"), 409, DEFAULT_ALIAS)
    assert body["type"] == "/problems/in-use" and body["aliases"] == [DEFAULT_ALIAS]
    assert client.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}").status_code == 200
    hold_fits(client)
    v3 = queue_fit(client, "m", ds)
    body = assert_problem(client.delete("/v1/models/m"), 409, "not finished")
    assert body["fits"] == [v3]
    r = client.post(f"/v1/models/m/calibrators/{v3}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    r = client.delete("/v1/models/m")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "m" and out["datasets"] == [ds] and out["versions"] == [v1, v2, v3]
    assert_problem(client.get("/v1/models/m"), 404)
    assert_problem(client.delete("/v1/models/m"), 404)
    assert [m["name"] for m in client.get("/v1/models").json()["models"]] == ["other"]
    # the files are still named by the other model's dataset
    assert dataset_files(client, "other", other) <= files_on_disk(client)
    with client.app.state.welltempered.sessions() as s:
        assert s.scalar(select(func.count()).select_from(FeedbackBin)) == 0
    assert client.delete("/v1/models/other").status_code == 200
    assert files_on_disk(client) == set()


def test_a_deleted_version_is_not_served_by_any_process(settings):
    """A model deleted and created again under the same name, with a version 1 that
    calibrates differently: neither the process that deleted nor another one (whose
    caches were warm) serves the old version 1."""
    settings = settings.model_copy(update={"alias_cache_seconds": 0.2})
    z, y = logits_data(n=400)
    with (
        TestClient(create_app(settings), raise_server_exceptions=False) as a,
        TestClient(create_app(settings.model_copy(update={"recover_jobs": False}))) as b,
    ):
        create_model(a, "m", 4)
        ds = upload(a, "m", z, y)["id"]
        promote(a, "m", ds)
        old = {}
        for c in (a, b):  # warm every cache: by alias and by version
            for query in ("", "?version=1"):
                r = c.post(f"/v1/models/m/predict{query}", json={"logits": z[:3].tolist()})
                assert r.status_code == 200, r.text
                old[query] = r.json()["probabilities"]
        assert a.delete(f"/v1/models/m/aliases/{DEFAULT_ALIAS}").status_code == 200
        assert a.delete("/v1/models/m").status_code == 200
        create_model(a, "m", 4)
        ds = upload(a, "m", z[:200], (y[:200] + 1) % 4)["id"]  # wrong labels: another fit
        assert promote(a, "m", ds)["version"] == 1
        time.sleep(0.3)  # past the other process's cache time
        for c in (a, b):
            for query in ("", "?version=1"):
                r = c.post(f"/v1/models/m/predict{query}", json={"logits": z[:3].tolist()})
                assert r.status_code == 200, r.text
                assert not np.allclose(r.json()["probabilities"], old[query], atol=1e-4)


def test_another_namespace_cannot_delete(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, auth="on", key_cache_seconds=0.0)
    z, y = logits_data()
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        with c.app.state.welltempered.sessions() as s:
            owner = keys.create_key(s, "team-a", "write", None)[1]
            stranger = keys.create_key(s, "team-b", "write", None)[1]
            reader = keys.create_key(s, "team-a", "predict", None)[1]
        c.headers["Authorization"] = f"Bearer {owner}"
        create_model(c, "m", 4)
        ds = upload(c, "m", z, y)["id"]
        for key, status in ((stranger, 404), (reader, 403)):
            h = {"Authorization": f"Bearer {key}"}
            assert_problem(c.delete(f"/v1/models/m/datasets/{ds}", headers=h), status)
            assert_problem(c.delete("/v1/models/m", headers=h), status)
        assert c.get(f"/v1/models/m/datasets/{ds}").status_code == 200
        assert c.delete("/v1/models/m").status_code == 200


# ---------------------------------------------------------------------------
# an upload racing a release of the same content


def test_an_upload_rewrites_a_file_released_after_it_was_written(client, monkeypatch):
    """Model a's dataset and an upload of the same content to b: a's dataset is deleted
    (its files released: b's upload has not committed) after b wrote the files and
    before b took its locks. b writes them again under the lock, so its dataset is whole."""
    create_model(client, "a", 4)
    create_model(client, "b", 4)
    z, y = logits_data()
    a1 = upload(client, "a", z, y)["id"]
    files = dataset_files(client, "a", a1)
    real_lock = usage.lock
    released = []

    def lock_after_a_release(session, namespace):
        if not released:
            assert files <= files_on_disk(client)  # b's upload wrote them (again)
            released.append(client.delete(f"/v1/models/a/datasets/{a1}").status_code)
            assert not files & files_on_disk(client)  # really gone
        return real_lock(session, namespace)

    monkeypatch.setattr(usage, "lock", lock_after_a_release)
    b1 = upload(client, "b", z, y)["id"]
    assert released == [200]
    assert dataset_files(client, "b", b1) == files <= files_on_disk(client)
    assert fit(client, "b", b1)["status"] == "succeeded"  # the arrays load


def test_the_sweep_leaves_a_fresh_upload_alone(client, monkeypatch):
    """A sweep that runs between an upload's write and its commit keeps the young files
    (the grace period): they are not removed, so not written twice."""
    create_model(client, "m", 4)
    z, y = logits_data()
    state = client.app.state.welltempered
    real_lock = usage.lock
    seen = []

    def lock_after_a_sweep(session, namespace):
        seen.append(array_refs.sweep(state.sessions, state.arrays, grace_seconds=3600))
        return real_lock(session, namespace)

    monkeypatch.setattr(usage, "lock", lock_after_a_sweep)
    writes = []
    real_write = ArrayStore.write  # put's too (a file written again by hold)
    monkeypatch.setattr(
        ArrayStore, "write", lambda self, *a, **k: writes.append(1) or real_write(self, *a, **k)
    )
    ds = upload(client, "m", z, y)["id"]
    assert seen[0].young_kept == 2 and seen[0].files_removed == 0
    assert len(writes) == 2  # written once each, never again
    assert dataset_files(client, "m", ds) <= files_on_disk(client)


def test_the_sweep_removes_old_orphans_and_keeps_named_files(client):
    create_model(client, "m", 4)
    z, y = logits_data()
    ds = upload(client, "m", z, y)["id"]
    named = dataset_files(client, "m", ds)
    arrays = store(client)
    orphan = arrays.put(np.arange(10.0))  # written, never committed (a killed upload)
    leftover = dead_process_temp(arrays, ".npz")
    mine = arrays.temp_path(".npz")  # an upload of this (live) process, however old
    state = client.app.state.welltempered
    done = array_refs.sweep(state.sessions, arrays, grace_seconds=60)
    assert done.files_removed == 0 and done.young_kept == 1 and leftover.exists()
    old = time.time() - 120
    for path in (arrays.path(orphan), leftover, mine, *(arrays.path(s) for s in named)):
        os.utime(path, (old, old))
    done = array_refs.sweep(state.sessions, arrays, grace_seconds=60)
    assert (done.files_removed, done.tmp_removed, done.young_kept) == (1, 1, 0)
    assert mine.exists() and not leftover.exists()
    assert done.bytes_removed > 0
    assert files_on_disk(client) == named and not leftover.exists()


def test_orphans_of_a_killed_upload_go_at_the_next_start(settings):
    """SQLite: files written by an upload killed before its commit (and its temp file)
    are removed when the server starts again, however young; committed files stay.
    PostgreSQL: another replica may be uploading them, so a start removes nothing
    younger than the grace period (the periodic sweep takes them later)."""
    z, y = logits_data()
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", z, y)["id"]
        named = dataset_files(c, "m", ds)
        arrays = store(c)
    orphans = {arrays.put(np.full((50, 4), 7.0)), arrays.put(np.zeros(50, dtype=np.int64))}
    spool = dead_process_temp(arrays, ".npz")
    assert named | orphans == {f.sha256 for f in arrays.files()}
    with TestClient(create_app(settings)) as c:
        if settings.is_sqlite:
            assert files_on_disk(c) == named
            assert not spool.exists()
        else:
            assert files_on_disk(c) == named | orphans
            assert spool.exists()
        assert c.get(f"/v1/models/m/datasets/{ds}").status_code == 200


def test_gc_command(settings, monkeypatch, capsys):
    z, y = logits_data()
    with TestClient(create_app(settings)) as c:
        create_model(c, "m", 4)
        upload(c, "m", z, y)
        arrays = store(c)
    orphan = arrays.put(np.arange(5.0))
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("WELLTEMPERED_DATA_DIR", str(settings.data_dir))
    assert cli.main(["gc"]) == 0
    assert "kept 1 orphan" in capsys.readouterr().out and arrays.exists(orphan)
    assert cli.main(["gc", "--grace", "0"]) == 0
    assert "removed 1 orphan array file" in capsys.readouterr().out
    assert not arrays.exists(orphan) and len(list(arrays.files())) == 2
    assert cli.main(["gc", "--grace", "-1"]) == 2


def test_gc_refuses_to_create_a_database(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nowhere.sqlite3"
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", f"sqlite:///{missing}")
    monkeypatch.setenv("WELLTEMPERED_DATA_DIR", str(tmp_path / "data"))
    assert cli.main(["gc"]) == 2
    assert "no SQLite database" in capsys.readouterr().err and not missing.exists()


def test_a_release_after_a_crash_leaves_a_row_the_sweep_removes(client):
    """A row of array_files whose file is gone and no dataset names (a release that
    crashed after its unlink) is removed by the sweep."""
    state = client.app.state.welltempered
    with state.sessions() as s:
        s.add(ArrayFile(sha256="f" * 64, n_bytes=1))
        s.commit()
    done = array_refs.sweep(state.sessions, state.arrays, grace_seconds=0)
    assert done.rows_removed == 1
    with state.sessions() as s:
        assert s.scalar(select(func.count()).select_from(ArrayFile)) == 0


def test_uploads_survive_sweeps_without_grace(client, monkeypatch):
    """Sweeps that remove every file no committed dataset names, as fast as they can, while
    uploads (some of the same content) run in threads: every dataset ends up with its
    files, and nothing else is left. (Temp files are left alone here: removing one in the
    middle of a write is what the grace period is for.)"""
    create_model(client, "m", 4)
    create_model(client, "n", 4)
    state = client.app.state.welltempered
    monkeypatch.setattr(state.arrays, "clean_tmp", lambda older_than_seconds=0.0: 0)
    stop = threading.Event()
    sweeps = []

    def sweeping():
        while not stop.is_set():
            sweeps.append(array_refs.sweep(state.sessions, state.arrays, grace_seconds=0))

    def send(i):
        z, y = logits_data(200, 4, seed=i % 5)  # each content twice, in two models
        r = client.post(
            f"/v1/models/{'mn'[i % 2]}/datasets", json={"logits": z.tolist(), "labels": y.tolist()}
        )
        assert r.status_code in (200, 201), r.text
        return "mn"[i % 2], r.json()["id"]

    sweeper = threading.Thread(target=sweeping)
    sweeper.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            uploaded = list(pool.map(send, range(10)))
    finally:
        stop.set()
        sweeper.join()
    assert len(sweeps) > 1
    named = set().union(*(dataset_files(client, m, i) for m, i in uploaded))
    assert files_on_disk(client) == named
    arrays = store(client)
    for sha in named:
        arrays.load(sha, mmap=False)  # whole and readable


def test_the_periodic_sweep(client):
    arrays = store(client)
    orphan = arrays.put(np.arange(3.0))
    old = time.time() - 10
    os.utime(arrays.path(orphan), (old, old))
    state = client.app.state.welltempered
    sweeper = Sweeper(state.sessions, arrays, interval=0.05, grace=5).start()
    try:
        deadline = time.monotonic() + 10
        while arrays.exists(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sweeper.stop()
    assert not arrays.exists(orphan)
