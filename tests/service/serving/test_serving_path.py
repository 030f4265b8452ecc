"""The serving path: ONNX Runtime sessions, no torch, parity with the library."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import calibrators
from service.serving.inference import SessionCache, as_onnx_input, run
from service.vocabulary import DEFAULT_ALIAS, KINDS
from tests.oracles import softmax
from tests.service.helpers import logits_data

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.process
def test_serving_path_does_not_import_torch(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import time

        import numpy as np
        from fastapi.testclient import TestClient
        from service.api.app import create_app
        from service.settings import Settings

        s = Settings(database_url="sqlite:///{tmp_path / "r.sqlite3"}",
                     data_dir="{tmp_path / "data"}", fit_executor="thread", auth="off")
        rng = np.random.default_rng(0)
        z = rng.normal(size=(50, 3)) * 3
        y = z.argmax(1)
        with TestClient(create_app(s)) as c:
            c.post("/v1/models", json={{"name": "m", "num_classes": 3}})
            body = {{"logits": z.tolist(), "labels": y.tolist()}}
            ds = c.post("/v1/models/m/datasets", json=body).json()
            fit = {{"dataset_id": ds["id"], "method": "temperature"}}
            c.post("/v1/models/m/calibrators", json=fit)
            for _ in range(500):
                if c.get("/v1/models/m/calibrators/1").json()["status"] == "succeeded":
                    break
                time.sleep(0.02)
            r = c.put("/v1/models/m/aliases/{DEFAULT_ALIAS}", json={{"version": 1}})
            assert r.status_code == 200, r.text
            r = c.post("/v1/models/m/predict", json={{"logits": z[:3].tolist()}})
            assert r.status_code == 200, r.text
            # the fuse route, and the /v2 config
            from onnx import TensorProto, helper
            graph = helper.make_graph(
                [helper.make_node("Identity", ["x"], ["scores"])], "g",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
            r = c.post("/v1/models/m/calibrators/1/fuse", content=model.SerializeToString(),
                       headers={{"content-type": "application/octet-stream"}})
            assert r.status_code == 200, r.text
            assert c.get("/v2/models/m/config").status_code == 200
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not torch, torch
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_onnx_session_matches_predict_proba_and_is_cached():
    logits, labels = logits_data(n=500, k=5, seed=4)
    cal = calibrators.create("vector").fit(logits, labels)
    params = cal.to_params()
    cache = SessionCache(threads=1, size=2)
    loads = []

    def load():
        loads.append(1)
        return params

    session = cache.get(7, load)
    assert cache.get(7, load) is session and len(loads) == 1
    for kind in KINDS:
        x = logits[:64]
        if kind == "probabilities":
            x = softmax(x)
            x[0, 0] = 0.0  # a zero probability is floored, as in the library
            x[0] /= x[0].sum()
        out = run(session, as_onnx_input(x, kind))
        expected = cal.predict_proba(x, kind=kind)
        np.testing.assert_allclose(out["probabilities"], expected, atol=1e-6)
        np.testing.assert_array_equal(out["label"], expected.argmax(1))
    # LRU: a third version evicts the least recently used one
    cache.get(8, load)
    cache.get(9, load)
    assert cache.get(7, load) is not session and len(loads) == 4
