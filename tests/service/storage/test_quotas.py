"""Per-namespace quotas: each refusal names its quota, limit and usage, writes nothing,
and holds under concurrent uploads; on SQLite and PostgreSQL."""

from __future__ import annotations

import io
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from fastapi.testclient import TestClient

import calibrators
from service.api.app import create_app
from service.settings import Settings
from service.storage import usage
from service.storage.arrays import ArrayStore
from service.vocabulary import DEFAULT_NAMESPACE
from tests.security import payloads as pl
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    hold_queue,
    import_params,
    logits_data,
    make_settings,
    npz,
    upload,
)

#: Bytes of the .npy files of a logits_data(N_ROWS, 4) dataset (float64 scores, int64
#: labels, a 128-byte header each).
N_ROWS = 100
VERSIONS = "/v1/models/m/calibrators"
IMPORT = f"{VERSIONS}/import"
DATASET_BYTES = 2 * 128 + N_ROWS * 4 * 8 + N_ROWS * 8


def quota_client(database_url, tmp_path, **quotas):
    return TestClient(
        create_app(make_settings(database_url, tmp_path, **quotas)), raise_server_exceptions=False
    )


def on_disk(c: TestClient) -> set[str]:
    arrays: ArrayStore = c.app.state.welltempered.arrays
    return {f.sha256 for f in arrays.files()} | {p.name for p in arrays.tmp.iterdir()}


def body(seed: int, n: int = N_ROWS) -> dict:
    z, y = logits_data(n, 4, seed=seed)
    return {"logits": z.tolist(), "labels": y.tolist()}


def quota_problem(r, status: int, quota: str, limit: int, used: int | None, requested: int):
    slug = "quota-exceeded" if status == 409 else "request-over-quota"
    p = assert_problem(r, status, quota)
    assert p["type"] == f"/problems/{slug}", p
    assert (p["quota"], p["limit"], p["requested"]) == (quota, limit, requested), p
    assert p["setting"] == usage.SETTINGS[quota]
    assert p.get("usage") == used, p
    return p


def test_a_dataset_is_what_its_files_weigh(database_url, tmp_path):
    with quota_client(database_url, tmp_path) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(N_ROWS, 4))
        arrays = c.app.state.welltempered.arrays
        assert sum(f.size for f in arrays.files()) == DATASET_BYTES
        with c.app.state.welltempered.sessions() as s:
            assert usage.usage(s, DEFAULT_NAMESPACE) == usage.Usage(DATASET_BYTES, 1, 1)
        assert c.delete(f"/v1/models/m/datasets/{ds['id']}").json()["stored_bytes_released"] == (
            DATASET_BYTES
        )


def test_models_quota(database_url, tmp_path):
    with quota_client(database_url, tmp_path, quota_models=2) as c:
        create_model(c, "a", 4)
        create_model(c, "b", 4)
        r = c.post("/v1/models", json={"name": "c", "num_classes": 4})
        quota_problem(r, 409, "models", 2, 2, 1)
        assert [m["name"] for m in c.get("/v1/models").json()["models"]] == ["a", "b"]
        assert c.delete("/v1/models/a").status_code == 200
        create_model(c, "c", 4)


def test_datasets_quota_writes_nothing_and_keeps_duplicates(database_url, tmp_path):
    with quota_client(database_url, tmp_path, quota_datasets=2) as c:
        create_model(c, "m", 4)
        first = c.post("/v1/models/m/datasets", json=body(1)).json()
        c.post("/v1/models/m/datasets", json=body(2))
        before = on_disk(c)
        quota_problem(c.post("/v1/models/m/datasets", json=body(3)), 409, "datasets", 2, 2, 1)
        assert on_disk(c) == before
        assert len(c.get("/v1/models/m/datasets").json()["datasets"]) == 2
        # the same content again is not a new dataset: 200 with the existing one
        r = c.post("/v1/models/m/datasets", json=body(1))
        assert r.status_code == 200 and r.json()["id"] == first["id"]
        # the quota is per namespace: another model of it counts
        create_model(c, "other", 4)
        quota_problem(c.post("/v1/models/other/datasets", json=body(4)), 409, "datasets", 2, 2, 1)
        assert c.delete(f"/v1/models/m/datasets/{first['id']}").status_code == 200
        assert c.post("/v1/models/other/datasets", json=body(4)).status_code == 201


def test_stored_bytes_quota(database_url, tmp_path):
    limit = 2 * DATASET_BYTES + DATASET_BYTES // 2
    with quota_client(database_url, tmp_path, quota_stored_bytes=limit) as c:
        create_model(c, "m", 4)
        for seed in (1, 2):
            assert c.post("/v1/models/m/datasets", json=body(seed)).status_code == 201
        before = on_disk(c)
        r = c.post("/v1/models/m/datasets", json=body(3))
        quota_problem(r, 409, "stored_bytes", limit, 2 * DATASET_BYTES, DATASET_BYTES)
        # one dataset larger than the whole quota: 413, whatever is stored
        big = 2 * 128 + 400 * 4 * 8 + 400 * 8
        r = c.post("/v1/models/m/datasets", json=body(4, n=400))
        quota_problem(r, 413, "stored_bytes", limit, 2 * DATASET_BYTES, big)
        assert on_disk(c) == before


def test_rows_per_dataset(database_url, tmp_path):
    with quota_client(database_url, tmp_path, max_dataset_rows=50) as c:
        create_model(c, "m", 4)
        for sent in (
            {"json": body(1, n=51)},
            {
                "content": _npz(51),
                "headers": {"content-type": "application/octet-stream"},
            },
        ):
            r = c.post("/v1/models/m/datasets", **sent)
            p = quota_problem(r, 413, "dataset_rows", 50, None, 51)
            assert p["max_rows"] == 50
        assert on_disk(c) == set()
        assert c.post("/v1/models/m/datasets", json=body(1, n=50)).status_code == 201


def test_default_quotas_refuse_the_zero_npz_of_issue_12(tmp_path):
    # issue 12: a valid all-zero .npz of 467 KB was stored as a 10,000,000 x 10 dataset
    # (458 MB) under the default settings. The same file, under the defaults now.
    rows, k = 10_000_000, 10
    bomb = pl.deflated_members({
        "logits.npy": (pl.npy_header((rows, k), "<f4"), rows * k * 4),
        "labels.npy": (pl.npy_header((rows,), "<i8"), rows * 8),
    })
    with zipfile.ZipFile(io.BytesIO(bomb)) as zf:  # valid: every member inflates whole
        assert [i.file_size for i in zf.infolist()] == [128 + rows * k * 4, 128 + rows * 8]
    assert 400_000 < len(bomb) < 500_000
    defaults = Settings()
    with quota_client(f"sqlite:///{tmp_path / 'r.sqlite3'}", tmp_path) as c:
        assert c.app.state.welltempered.settings.max_dataset_rows == defaults.max_dataset_rows
        create_model(c, "m", k)
        r = c.post(
            "/v1/models/m/datasets",
            content=bomb,
            headers={"content-type": "application/octet-stream"},
        )
        quota_problem(r, 413, "dataset_rows", defaults.max_dataset_rows, None, rows)
        assert on_disk(c) == set()


def test_default_quotas_are_finite_and_hold_the_largest_upload():
    s = Settings()
    # one dataset of MAX_BODY_BYTES fits in an empty namespace, and a few such do not fit
    assert s.max_body_bytes <= s.quota_stored_bytes <= 4 * s.max_body_bytes
    assert s.max_dataset_rows <= 1_000_000
    assert s.quota_datasets <= 1_000 and s.quota_models <= 1_000
    assert s.quota_versions <= 1_000


# ---------------------------------------------------------------------------
# calibrator versions: their params count in stored_bytes; versions per model


def _params(fit_info_bytes: int = 0) -> dict:
    """Vector params for K = 4 with a fit_info of about ``fit_info_bytes`` bytes."""
    params = calibrators.create("vector").fit(*logits_data(N_ROWS, 4)).to_params()
    params["fit_info"] = {f"k{i}": "x" * 1000 for i in range(fit_info_bytes // 1008)}
    return params


def _stored(c: TestClient) -> int:
    with c.app.state.welltempered.sessions() as s:
        return usage.usage(s, DEFAULT_NAMESPACE).stored_bytes


def test_versions_count_in_stored_bytes(database_url, tmp_path):
    """An import's params count from its creation, a fit's from its outcome; each is
    released by its delete. The import that would pass the quota is a 409."""
    params = _params(fit_info_bytes=30_000)
    posted = _bytes(calibrators.from_params(params).to_params())
    limit = DATASET_BYTES + posted + posted // 2
    with quota_client(database_url, tmp_path, quota_stored_bytes=limit) as c:
        create_model(c, "m", 4, argmax_policy="off")
        ds = upload(c, "m", *logits_data(N_ROWS, 4))["id"]
        assert _stored(c) == DATASET_BYTES
        hold_queue(c)
        r = c.post(IMPORT, json={"dataset_id": ds, "params": params})
        assert r.status_code == 202, r.text
        imported = r.json()["version"]
        assert _stored(c) == DATASET_BYTES + posted
        r = c.post(IMPORT, json={"dataset_id": ds, "params": params})
        quota_problem(r, 409, "stored_bytes", limit, DATASET_BYTES + posted, posted)
        assert [v["version"] for v in c.get(VERSIONS).json()["calibrators"]] == [imported]
        c.post(f"{VERSIONS}/{imported}/cancel")
        r = c.delete(f"{VERSIONS}/{imported}")
        assert r.json()["stored_bytes_released"] == posted, r.text
        assert _stored(c) == DATASET_BYTES
    with quota_client(database_url, tmp_path, quota_stored_bytes=limit) as c:
        fitted = _bytes(fit(c, "m", ds, "vector")["params"])
        assert _stored(c) == DATASET_BYTES + fitted
        evaluated = _bytes(import_params(c, "m", ds, params)["params"])
        assert _stored(c) == DATASET_BYTES + fitted + evaluated
        # the dataset's cascade releases its versions' bytes with its own
        r = c.delete(f"/v1/models/m/datasets/{ds}?cascade=true")
        assert r.json()["stored_bytes_released"] == DATASET_BYTES + fitted + evaluated
        assert _stored(c) == 0


def _bytes(params: dict) -> int:
    return len(orjson.dumps(params))


def test_params_larger_than_the_whole_quota_are_a_413(database_url, tmp_path):
    params = _params(fit_info_bytes=30_000)
    limit = DATASET_BYTES + 1000
    with quota_client(database_url, tmp_path, quota_stored_bytes=limit) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(N_ROWS, 4))["id"]
        r = c.post(IMPORT, json={"dataset_id": ds, "params": params})
        requested = _bytes(calibrators.from_params(params).to_params())
        quota_problem(r, 413, "stored_bytes", limit, DATASET_BYTES, requested)
        assert c.get(VERSIONS).json()["calibrators"] == []


def test_a_namespace_over_stored_bytes_gets_no_new_version(database_url, tmp_path):
    """A fit's params are counted at its outcome and may take the namespace past the
    quota; then no version is created there (fit or import) until something is deleted."""
    with quota_client(database_url, tmp_path, quota_stored_bytes=DATASET_BYTES + 10) as c:
        create_model(c, "m", 4)
        ds = upload(c, "m", *logits_data(N_ROWS, 4))["id"]
        v = fit(c, "m", ds, "temperature")
        over = DATASET_BYTES + len(orjson.dumps(v["params"]))
        r = c.post(VERSIONS, json={"dataset_id": ds, "method": "temperature"})
        quota_problem(r, 409, "stored_bytes", DATASET_BYTES + 10, over, 0)
        assert c.delete(f"{VERSIONS}/{v['version']}").status_code == 200
        assert fit(c, "m", ds, "temperature")["status"] == "succeeded"


def test_versions_quota(database_url, tmp_path):
    """Versions per model, fitted and imported, whatever their status: a 409 naming the
    quota; another model has its own; a delete makes room."""
    with quota_client(database_url, tmp_path, quota_versions=2) as c:
        create_model(c, "m", 4, argmax_policy="off")
        ds = upload(c, "m", *logits_data(N_ROWS, 4))["id"]
        first = fit(c, "m", ds, "temperature")
        import_params(c, "m", ds, _params())
        for r in (
            c.post(VERSIONS, json={"dataset_id": ds, "method": "temperature"}),
            c.post(IMPORT, json={"dataset_id": ds, "params": _params()}),
        ):
            p = quota_problem(r, 409, "versions", 2, 2, 1)
            assert "'m'" in p["detail"]
        assert len(c.get(VERSIONS).json()["calibrators"]) == 2
        create_model(c, "other", 4)
        other = upload(c, "other", *logits_data(N_ROWS, 4))["id"]
        assert fit(c, "other", other, "temperature")["status"] == "succeeded"
        assert c.delete(f"{VERSIONS}/{first['version']}").status_code == 200
        assert fit(c, "m", ds, "temperature")["version"] == 3


def test_concurrent_imports_cannot_overrun_the_versions_quota(database_url, tmp_path):
    with quota_client(database_url, tmp_path, quota_versions=3) as c:
        create_model(c, "m", 4, argmax_policy="off")
        ds = upload(c, "m", *logits_data(N_ROWS, 4))["id"]
        hold_queue(c)
        params = _params()
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda _: c.post(IMPORT, json={"dataset_id": ds, "params": params}).status_code,
                    range(8),
                )
            )
        assert sorted(codes) == [202] * 3 + [409] * 5, codes
        assert len(c.get(VERSIONS).json()["calibrators"]) == 3


def _npz(n: int) -> bytes:
    z, y = logits_data(n, 4)
    return npz(logits=z, labels=y)


# ---------------------------------------------------------------------------
# concurrent uploads: every one passes the unlocked check before any takes the lock


@pytest.mark.parametrize(
    ("quota", "limit", "fits"),
    [("quota_datasets", 2, 2), ("quota_stored_bytes", 3 * DATASET_BYTES + 10, 3)],
)
def test_concurrent_uploads_cannot_overrun_a_quota(
    database_url, tmp_path, monkeypatch, quota, limit, fits
):
    uploads = 6
    barrier = threading.Barrier(uploads, timeout=60)
    real_lock = usage.lock

    def lock_together(session, namespace):
        barrier.wait()  # all six have passed the unlocked check and written their files
        return real_lock(session, namespace)

    with quota_client(database_url, tmp_path, **{quota: limit}) as c:
        create_model(c, "m", 4)
        monkeypatch.setattr(usage, "lock", lock_together)
        with ThreadPoolExecutor(uploads) as pool:
            answers = list(
                pool.map(lambda seed: c.post("/v1/models/m/datasets", json=body(seed)), range(6))
            )
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [201] * fits + [409] * (uploads - fits), [r.text for r in answers]
        for r in answers:
            if r.status_code == 409:
                assert r.json()["type"] == "/problems/quota-exceeded"
        kept = c.get("/v1/models/m/datasets").json()["datasets"]
        assert len(kept) == fits
        # the refused uploads' files are gone; the kept ones' are there
        with c.app.state.welltempered.sessions() as s:
            assert usage.usage(s, DEFAULT_NAMESPACE).datasets == fits
        assert len(on_disk(c)) == 2 * fits


def test_concurrent_model_creation_cannot_overrun_the_quota(database_url, tmp_path, monkeypatch):
    barrier = threading.Barrier(4, timeout=60)
    real_lock = usage.lock

    def lock_together(session, namespace):
        barrier.wait()
        return real_lock(session, namespace)

    monkeypatch.setattr(usage, "lock", lock_together)
    with quota_client(database_url, tmp_path, quota_models=1) as c:
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda i: c.post("/v1/models", json={"name": f"m{i}", "num_classes": 4}),
                    range(4),
                )
            )
        assert sorted(r.status_code for r in answers) == [201, 409, 409, 409]
        assert len(c.get("/v1/models").json()["models"]) == 1
