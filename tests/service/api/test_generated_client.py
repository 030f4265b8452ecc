"""A client generated from our OpenAPI document works unedited (issue 13, item 2).

openapi-python-client (a dev dependency) generates a package from /openapi.json
with no warning; the package imports whole, its operations have short names, and
it does the journey: create a model, upload a .npz, fit with typed options, poll,
alias, predict as JSON and as .npy, post feedback, read the monitoring, the SVG and
the ONNX model, page the models, patch one, import parameters. The generated client
talks to the app through a TestClient (an httpx.Client), with a real API key.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

import calibrators
from service.api.app import create_app
from service.security import keys
from tests.service.helpers import logits_data, make_settings, npy, npz

pytestmark = pytest.mark.process

GENERATOR = Path(sys.executable).with_name("openapi-python-client")
PACKAGE = "welltempered_api_client"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client")
    settings = make_settings(f"sqlite:///{tmp / 'r.sqlite3'}", tmp, auth="on")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        with c.app.state.welltempered.sessions() as s:
            _, key = keys.create_key(s, "team", "admin")
        c.headers["Authorization"] = f"Bearer {key}"
        yield c


def generate(served, out: Path, path: str) -> str:
    """Generate the client of ``served``'s document into ``out`` with ``path`` as PATH;
    the generator's output."""
    doc = out.parent / "openapi.json"
    doc.write_text(json.dumps(served.get("/openapi.json").json()))
    done = subprocess.run(
        [str(GENERATOR), "generate", "--path", str(doc), "--output-path", str(out),
         "--meta", "none"],
        capture_output=True, text=True, env={**os.environ, "PATH": path}, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@pytest.fixture(scope="module")
def generated(served, tmp_path_factory):
    if not GENERATOR.exists():
        pytest.fail(f"{GENERATOR} missing: install the dev extra (make test does)")
    tmp = tmp_path_factory.mktemp("generated")
    out = tmp / PACKAGE
    # ruff (the generator's post-hooks run it) on PATH: the dev extra's
    output = generate(served, out, f"{GENERATOR.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # no warning, no skipped post-hook: the document is complete for the generator
    assert "WARNING" not in output and "Unable" not in output and "Skipping" not in output, output
    sys.path.insert(0, str(tmp))
    try:
        package = importlib.import_module(PACKAGE)
        # every generated module imports (0.29.1 once failed with NameError: Unset)
        for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
            importlib.import_module(info.name)
        yield package
    finally:
        sys.path.remove(str(tmp))
        for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
            del sys.modules[name]
        shutil.rmtree(out, ignore_errors=True)


def test_without_ruff_the_only_warning_is_ruff(served, generated, tmp_path):
    """docs/api.md: without ruff on PATH the generator says so (its post-hooks format
    the code with it), and nothing else."""
    if shutil.which("ruff", path="/usr/bin:/bin"):
        pytest.skip("ruff is installed system-wide")
    output = generate(served, tmp_path / PACKAGE, "/usr/bin:/bin")
    said = {line.strip() for line in output.splitlines() if line.strip()}
    boilerplate = {line for line in said if line.startswith(("Generating ", "If you believe"))}
    assert said - boilerplate == {
        "Warning(s) encountered while generating. Client was generated, but some pieces may "
        "be missing",
        "Skipping Integration",
        "ruff is not in PATH",
    }, output
    assert (tmp_path / PACKAGE / "api" / "predict" / "predict_npy.py").exists()


def api(name: str):
    return importlib.import_module(f"{PACKAGE}.api.{name}")


def models():
    return importlib.import_module(f"{PACKAGE}.models")


def test_operation_ids_are_short_and_unique(served):
    ops = [
        op["operationId"]
        for item in served.get("/openapi.json").json()["paths"].values()
        for op in item.values()
        if isinstance(op, dict) and "operationId" in op
    ]
    assert len(ops) == len(set(ops))
    assert {"create_model", "upload_dataset", "start_fit", "predict", "post_feedback"} <= set(ops)
    assert max(len(op) for op in ops) <= 32, ops


def test_the_journey(served, generated):
    from importlib import import_module

    client_mod = import_module(f"{PACKAGE}.client")
    types = import_module(f"{PACKAGE}.types")
    m = models()
    client = client_mod.AuthenticatedClient(base_url="http://testserver", token="unused")
    client.set_httpx_client(served)  # the app, with the key in its headers

    create = import_module(f"{PACKAGE}.api.models.create_model")
    made = create.sync(client=client, body=m.ModelCreate(name="gen", num_classes=4))
    assert isinstance(made, m.ModelOut) and made.num_classes == 4

    z, y = logits_data(400, 4, seed=2)
    upload = import_module(f"{PACKAGE}.api.datasets.upload_dataset")
    body = types.File(payload=io.BytesIO(npz(logits=z, labels=y)), file_name="d.npz")
    ds = upload.sync("gen", client=client, body=body)
    assert isinstance(ds, m.DatasetOut) and (ds.n, ds.k) == (400, 4)
    again = upload.sync_detailed(
        "gen", client=client, body=types.File(payload=io.BytesIO(npz(logits=z, labels=y)))
    )
    assert again.status_code == 200 and again.parsed.id == ds.id  # a repeated upload parses
    other = npz(logits=z[:100], labels=y[:100])  # multipart, with a file field
    form = m.UploadDatasetFilesBody(file=types.File(payload=io.BytesIO(other), file_name="o.npz"))
    by_form = upload.sync_detailed("gen", client=client, body=form)
    assert by_form.status_code == 201 and by_form.parsed.n == 100

    start = import_module(f"{PACKAGE}.api.calibrators.start_fit")
    options = m.TemperatureOptions(max_passes=40)
    method = m.FitRequestMethod.TEMPERATURE
    fit_body = m.FitRequest(dataset_id=ds.id, method=method, options=options)
    accepted = start.sync("gen", client=client, body=fit_body)
    assert isinstance(accepted, m.FitAccepted), accepted
    get_version = import_module(f"{PACKAGE}.api.calibrators.get_version")

    def outcome(number: int):
        for _ in range(1200):  # a bound on polls, not a timed assertion
            version = get_version.sync("gen", number, client=client)
            if version.status.value not in ("queued", "running"):
                return version
            time.sleep(0.05)
        return version

    version = outcome(accepted.version)
    assert version.status.value == "succeeded", version
    assert version.options.to_dict()["max_passes"] == 40  # the typed options arrived

    alias = import_module(f"{PACKAGE}.api.aliases.put_alias")
    put = alias.sync("gen", "production", client=client, body=m.AliasPut(version=version.version))
    assert isinstance(put, m.AliasOut) and put.version == version.version

    predict = import_module(f"{PACKAGE}.api.predict.predict")
    cal = calibrators.from_params(version.params.to_dict())
    out = predict.sync("gen", client=client, body=m.PredictJsonBody(logits=z[:5].tolist()))
    assert isinstance(out, m.PredictOut)  # the schema's own name, not PredictPredictOut
    np.testing.assert_allclose(out.probabilities, cal.predict_proba(z[:5]), atol=1e-6)
    top = predict.sync("gen", client=client, body=m.PredictJsonBody(logits=z[:5].tolist()),
                       top_k=2)
    assert np.asarray(top.top_k_indices).shape == (5, 2)
    raw = predict.sync_detailed("gen", client=client, body=types.File(payload=npy(z[:5])))
    assert raw.status_code == 200 and raw.parsed.labels == out.labels  # .npy in, JSON out
    # .npy out (issue 24: predict's 200 was decoded as JSON, a UnicodeDecodeError)
    predict_npy = import_module(f"{PACKAGE}.api.predict.predict_npy")
    for body in (types.File(payload=npy(z[:5])), m.PredictNpyJsonBody(logits=z[:5].tolist())):
        answer = predict_npy.sync("gen", client=client, body=body)
        probabilities = np.load(answer.payload, allow_pickle=False)
        assert probabilities.dtype == np.float32
        np.testing.assert_allclose(probabilities, cal.predict_proba(z[:5]), atol=1e-6)
    records = np.load(predict_npy.sync("gen", client=client, body=types.File(payload=npy(z[:5])),
                                       top_k=2).payload, allow_pickle=False)
    np.testing.assert_array_equal(records["index"], np.asarray(top.top_k_indices))

    feedback = import_module(f"{PACKAGE}.api.monitoring.post_feedback")
    fb = feedback.sync_detailed(
        "gen", client=client,
        body=m.PostFeedbackJsonBody(logits=z[:50].tolist(), labels=y[:50].tolist()),
    )
    assert fb.status_code == 200, fb.content
    assert isinstance(fb.parsed, m.FeedbackOut) and (fb.parsed.rows, fb.parsed.version) == (
        50, version.version)
    monitoring = import_module(f"{PACKAGE}.api.monitoring.get_monitoring")
    watched = monitoring.sync("gen", client=client)
    assert isinstance(watched, m.MonitoringOut) and watched.live.n == 50
    assert watched.drift.verdict.value in ("ok", "drift", "insufficient_data")
    assert watched.live.ece_debiased_upper is not None and watched.holdout["smooth_ece"] >= 0

    svg = import_module(f"{PACKAGE}.api.monitoring.holdout_reliability_svg")
    picture = svg.sync("gen", version.version, client=client)
    assert picture.payload.read().startswith(b"<svg")
    onnx = import_module(f"{PACKAGE}.api.calibrators.get_onnx")
    assert onnx.sync("gen", version.version, client=client).payload.read() == cal.to_onnx()

    listed = import_module(f"{PACKAGE}.api.models.list_models").sync(client=client, limit=1)
    assert [x.name for x in listed.models] == ["gen"] and listed.next_cursor is None
    patch = import_module(f"{PACKAGE}.api.models.patch_model")
    patched = patch.sync("gen", client=client, body=m.ModelPatch.from_dict(
        {"class_names": ["a", "b", "c", "d"]}))
    assert patched.class_names == ["a", "b", "c", "d"]
    queued = import_module(f"{PACKAGE}.api.calibrators.import_params").sync(
        "gen", client=client,
        body=m.ParamsImport.from_dict({"dataset_id": ds.id, "params": cal.to_params()}),
    )
    assert isinstance(queued, m.FitAccepted), queued  # queued like a fit
    imported = outcome(queued.version)
    assert imported.status.value == "succeeded" and imported.source.value == "params"


def test_a_wrong_fit_option_is_a_problem_naming_the_valid_ones(served, generated):
    from importlib import import_module

    served.post("/v1/models", json={"name": "opts", "num_classes": 4})
    z, y = logits_data(100, 4)
    ds = served.post("/v1/models/opts/datasets", json={"logits": z.tolist(),
                                                        "labels": y.tolist()}).json()
    r = served.post("/v1/models/opts/calibrators",
                    json={"dataset_id": ds["id"], "method": "vector", "options": {"lambda": 1}})
    assert r.status_code == 422
    assert "reg_lambda" in r.json()["detail"] and "__init__" not in r.json()["detail"]
    m = models()
    assert set(m.VectorOptions().to_dict()) <= {"reg_lambda", "reg_mu", "grid", "n_folds",
                                                "seed", "max_iter", "tol"}
    assert import_module(f"{PACKAGE}.api.calibrators.start_fit")
