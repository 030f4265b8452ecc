"""One answer per distribution through the service (issue 21, item 1): for every method,
fitted on either kind, /v1 predict and /v2 infer give the same probabilities for the
same rows as logits with random per-row constants and as probabilities, equal to the
library's; a version that cannot (vector or matrix params of format 1) refuses the
other kind with a 422 naming the kind it needs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import calibrators
from calibrators.base import PARAMS_FORMAT_1
from calibrators.validation import KINDS
from tests.oracles import softmax
from tests.service.helpers import (
    assert_problem,
    create_model,
    fit,
    import_params,
    logits_data,
    upload,
)
from tests.strategies import same_distribution

K = 4
#: The agreement the issue asks for.
ATOL = 1e-6


def model_name(kind: str) -> str:
    return f"fitted-on-{kind}"


@pytest.fixture(scope="module")
def versions(module_client) -> dict[tuple[str, str], dict]:
    """For each kind, a model (argmax policy off) with one version of every method fitted
    on a dataset of that kind: (kind, method) -> the version's JSON."""
    z, y = logits_data(300, K, scale=1.5)
    out = {}
    for kind in KINDS:
        name = model_name(kind)
        create_model(module_client, name, K, argmax_policy="off")
        scores = z if kind == "logits" else softmax(z)
        dataset = upload(module_client, name, scores, y, kind)["id"]
        for method in calibrators.METHODS:
            version = fit(module_client, name, dataset, method)
            assert version["status"] in ("succeeded", "rejected"), version
            assert version["kind"] == kind and version["params"]["kind"] == kind
            out[kind, method] = version
    return out


def v1(client, model: str, version: int, scores: np.ndarray, kind: str) -> np.ndarray:
    r = client.post(f"/v1/models/{model}/predict?version={version}",
                    json={kind: scores.tolist()})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["probabilities"])


def v2(client, model: str, version: int, scores: np.ndarray, kind: str) -> np.ndarray:
    body = {
        "parameters": {"kind": kind},
        "inputs": [{"name": "logits", "shape": list(scores.shape), "datatype": "FP64",
                    "data": scores.ravel().tolist()}],
        "outputs": [{"name": "probabilities"}],
    }
    r = client.post(f"/v2/models/{model}/versions/{version}/infer", json=body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    return np.asarray(out["data"]).reshape(out["shape"])


@pytest.mark.parametrize("method", calibrators.METHODS)
@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=same_distribution(min_classes=K, max_classes=K), fit_kind=st.sampled_from(KINDS))
def test_v1_and_v2_give_one_answer_per_distribution(versions, module_client, method, case,
                                                    fit_kind):
    _, _, z, shifted = case
    version = versions[fit_kind, method]
    expected = calibrators.from_params(version["params"]).predict_proba(z)
    model, number = model_name(fit_kind), version["version"]
    for route in (v1, v2):
        for scores, kind in ((shifted, "logits"), (softmax(shifted), "probabilities")):
            got = route(module_client, model, number, scores, kind)
            assert np.abs(got - expected).max() <= ATOL, (route.__name__, kind)


@pytest.mark.parametrize("method", ["vector", "matrix"])
@pytest.mark.parametrize("fit_kind", KINDS)
def test_format_1_versions_serve_their_kind_and_refuse_the_other(
    versions, module_client, method, fit_kind
):
    """Params of format 1 of vector and matrix scaling (raw logits) without a recorded
    kind, imported on a dataset of ``fit_kind``: taken as fitted on it, served for it as
    before, and the other kind refused at /v1 and /v2 with the kind needed."""
    rng = np.random.default_rng(3)
    weight = rng.uniform(0.8, 1.5, K)
    params = {"format": PARAMS_FORMAT_1, "method": method, "n_classes": K,
              "weight": (np.diag(weight) if method == "matrix" else weight).tolist(),
              "bias": (rng.normal(size=K) * 0.1).tolist()}
    model = model_name(fit_kind)
    dataset = module_client.get(f"/v1/models/{model}/datasets").json()["datasets"][0]
    assert dataset["kind"] == fit_kind
    version = import_params(module_client, model, dataset["id"], params)
    assert version["status"] in ("succeeded", "rejected"), version
    assert version["kind"] == fit_kind and version["params"]["kind"] == fit_kind
    assert version["params"]["format"] == PARAMS_FORMAT_1
    z = rng.normal(size=(3, K))
    scores = z if fit_kind == "logits" else softmax(z)
    raw = np.log(scores) if fit_kind == "probabilities" else scores
    expected = softmax(raw * weight + np.asarray(params["bias"]))  # format 1's map
    number = version["version"]
    for route in (v1, v2):
        got = route(module_client, model, number, scores, fit_kind)
        assert np.abs(got - expected).max() <= ATOL
    other = "probabilities" if fit_kind == "logits" else "logits"
    other_scores = softmax(z) if other == "probabilities" else z
    r = module_client.post(f"/v1/models/{model}/predict?version={number}",
                           json={other: other_scores.tolist()})
    assert_problem(r, 422, f"send {fit_kind}")
    r = module_client.post(
        f"/v2/models/{model}/versions/{number}/infer",
        json={"parameters": {"kind": other},
              "inputs": [{"name": "logits", "shape": [3, K], "datatype": "FP64",
                          "data": other_scores.ravel().tolist()}]},
    )
    assert r.status_code == 422 and f"send {fit_kind}" in r.json()["error"], r.text
    # The same params recording the other kind than the dataset's: refused at import.
    r = module_client.post(f"/v1/models/{model}/calibrators/import",
                           json={"dataset_id": dataset["id"], "params": {**params, "kind": other}})
    assert_problem(r, 422, f"give {other}")
