"""End to end on real outputs: WideResNet-16-4 on CIFAR-100 (../shared/data)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient

import calibrators
from service.api.app import create_app
from service.jobs.fitting import auto_candidates
from service.vocabulary import DEFAULT_ALIAS
from tests.helpers import DATA_DIR
from tests.oracles import wait_for_version
from tests.service.helpers import create_model, make_settings, race_leader

# Fixed penalties and an iteration cap bound the K=100 matrix/Dirichlet fits
# (no cross-validation), so `auto` takes seconds, not minutes.
BOUNDED = {"reg_lambda": 1.0, "reg_mu": 1.0, "max_iter": 100}


@pytest.mark.slow
def test_upload_auto_promote_predict(cifar100, database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, fit_executor="process")
    with TestClient(create_app(settings)) as c:
        create_model(c, "wrn", 100, argmax_policy="warn")
        body = (
            DATA_DIR / "wideresnet-16-4-cifar-100.npz"
        ).read_bytes()  # predictions, ground_truth
        r = c.post(
            "/v1/models/wrn/datasets",
            content=body,
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
        ds = r.json()
        assert (ds["n"], ds["k"], ds["kind"], ds["dtype"]) == (
            10000,
            100,
            "probabilities",
            "float32",
        )
        raw = c.get(f"/v1/models/wrn/datasets/{ds['id']}").json()["metrics"]
        assert raw["accuracy"] == pytest.approx(0.754, abs=0.002)

        r = c.post(
            "/v1/models/wrn/calibrators",
            json={
                "dataset_id": ds["id"],
                "method": "auto",
                "holdout": 0.2,
                "seed": 0,
                "options": {"matrix": BOUNDED, "dirichlet": BOUNDED},
            },
        )
        assert r.status_code == 202, r.text
        v = wait_for_version(c, "wrn", r.json()["version"], timeout=600)
        assert v["status"] == "succeeded", v
        cands = v["candidates"]
        assert set(cands) == set(auto_candidates("warn"))
        assert v["chosen_method"] == race_leader(cands)
        assert v["metrics"]["after"]["nll"] < v["metrics"]["before"]["nll"]
        assert v["metrics"]["before"]["n"] == 2000

        r = c.put(f"/v1/models/wrn/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]})
        assert r.status_code == 200, r.text

        probs, _ = cifar100.test
        x = probs[:1000]
        expected = calibrators.from_params(v["params"]).predict_proba(x, kind="probabilities")

        r = c.post("/v1/models/wrn/predict", json={"probabilities": x.tolist()})
        assert r.status_code == 200, r.text
        served = np.asarray(r.json()["probabilities"])
        assert served.shape == (1000, 100) and r.json()["version"] == v["version"]
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)

        buf = io.BytesIO()
        np.save(buf, x)
        r = c.post(
            "/v1/models/wrn/predict?kind=probabilities",
            content=buf.getvalue(),
            headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-welltempered-version"] == str(v["version"])
        np.testing.assert_allclose(np.load(io.BytesIO(r.content)), expected, rtol=0, atol=1e-6)
