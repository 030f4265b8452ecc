"""Every 4xx is RFC 9457 problem+json with a useful detail; no input gives a 500."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from calibrators import CalibrationInputError
from service import errors
from service.api.app import create_app
from service.server import problems
from service.vocabulary import DEFAULT_ALIAS, KINDS
from tests.service.helpers import (
    assert_problem,
    bodies,
    create_model,
    fit,
    logits_data,
    make_settings,
    npy,
    npz,
    upload,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def served(client):
    """Model 'm' (4 classes) with dataset 1 and version 1 given the default alias."""
    create_model(client, "m", 4)
    logits, labels = logits_data()
    ds = upload(client, "m", logits, labels)
    v = fit(client, "m", ds["id"])
    assert (
        client.put(
            f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": v["version"]}
        ).status_code
        == 200
    )
    return client


def test_model_errors(client):
    assert_problem(
        client.post("/v1/models", content=b"{nope", headers={"content-type": "application/json"}),
        400,
        "json",
    )
    assert_problem(
        client.post("/v1/models", json={"name": "a", "num_classes": 1}), 422, "num_classes"
    )
    assert_problem(client.post("/v1/models", json={"name": "a b", "num_classes": 3}), 422, "name")
    assert_problem(
        client.post("/v1/models", json={"name": "a", "num_classes": 3, "extra": 1}), 422, "extra"
    )
    assert_problem(
        client.post("/v1/models", json={"name": "a", "num_classes": 2, "class_names": ["x"]}),
        422,
        "class_names",
    )
    assert_problem(
        client.post("/v1/models", json={"name": "a", "num_classes": 2, "argmax_policy": "maybe"}),
        422,
    )
    assert_problem(
        client.post("/v1/models", content=b"name=a", headers={"content-type": "text/plain"}), 415
    )
    create_model(client, "a", 2)
    assert_problem(
        client.post("/v1/models", json={"name": "a", "num_classes": 5}), 409, "already exists"
    )
    assert_problem(client.get("/v1/models/nope"), 404, "nope")
    assert_problem(client.get("/v1/models/%00"), 404)
    assert_problem(client.get("/v1/nothing"), 404, "no route")
    assert_problem(client.delete("/v1/models"), 405, "DELETE")


def test_dataset_errors(client):
    create_model(client, "m", 3)
    post = lambda **kw: client.post("/v1/models/m/datasets", **kw)  # noqa: E731
    ok_logits = [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]
    assert_problem(
        client.post("/v1/models/zz/datasets", json={"logits": ok_logits, "labels": [0, 1]}),
        404,
        "zz",
    )
    assert_problem(
        post(json={"logits": [[1.0, 2.0], [3.0, 4.0]], "labels": [0, 1]}), 422, "3 columns"
    )
    assert_problem(post(json={"logits": [1.0, 2.0, 3.0], "labels": [0]}), 422, "2-D")
    assert_problem(
        post(json={"logits": [[1.0, 2.0, 3.0], [1.0]], "labels": [0, 1]}), 422, "rectangular"
    )
    assert_problem(post(json={"logits": ok_logits, "labels": [0, 3]}), 422, "labels", "row 1")
    assert_problem(post(json={"logits": ok_logits, "labels": [0]}), 422, "labels")
    assert_problem(
        post(json={"logits": ok_logits, "probabilities": ok_logits, "labels": [0, 1]}),
        422,
        "exactly one",
    )
    assert_problem(post(json={"probabilities": ok_logits, "labels": [0, 1]}), 422, "sum to 1")
    assert_problem(post(json={"logits": [["a", "b", "c"]], "labels": [0]}), 422, "numeric")
    assert_problem(post(json=[1, 2]), 422, "object")
    assert_problem(
        post(
            content=b'{"logits": [[1e999, 0, 0]], "labels": [0]}',
            headers={"content-type": "application/json"},
        ),
        422,
        "non-finite",
    )
    nan = np.array([[0.0, np.nan, 1.0]], dtype=np.float32)
    inf = np.array([[0.0, np.inf, 1.0]])
    octet = {"content-type": "application/octet-stream"}
    assert_problem(
        post(content=npz(logits=nan, labels=np.array([0])), headers=octet), 422, "finite", "row 0"
    )
    assert_problem(
        post(content=npz(logits=inf, labels=np.array([0])), headers=octet), 422, "finite"
    )
    assert_problem(
        post(content=npz(logits=np.zeros((2, 3)), labels=np.array(["a", "b"])), headers=octet),
        422,
        "labels",
    )
    assert_problem(post(content=b"not a zip", headers=octet), 400, "npz")
    good = npz(logits=np.zeros((2, 3)), labels=np.array([0, 1]))
    assert_problem(post(content=good[: len(good) // 2], headers=octet), 400)
    assert_problem(post(content=npy(np.zeros((2, 3))), headers=octet), 422, "npz")
    obj = io.BytesIO()
    np.savez(obj, logits=np.array([[1, "x"]], dtype=object), labels=np.array([0]))
    assert_problem(post(content=obj.getvalue(), headers=octet), 422, "object")
    assert_problem(post(content=b"a,b\n1,2", headers={"content-type": "text/csv"}), 415, "text/csv")
    assert_problem(post(content=b"x"), 415)
    assert_problem(post(files={"other": ("d.npz", good)}), 422, "file")
    assert_problem(
        post(content=b"--x\r\nbroken", headers={"content-type": "multipart/form-data; boundary=x"}),
        400,
    )
    assert_problem(
        post(content=b"", headers={"content-type": "multipart/form-data"}), 400, "boundary"
    )
    assert_problem(client.get("/v1/models/m/datasets/99"), 404, "99")
    assert_problem(client.get("/v1/models/m/datasets/99999999999999999999"), 422)


def test_fit_and_alias_errors(served):
    c = served
    fit_url = "/v1/models/m/calibrators"
    assert_problem(
        c.post(fit_url, json={"dataset_id": 42, "method": "temperature"}), 404, "dataset 42"
    )
    assert_problem(c.post(fit_url, json={"dataset_id": 1, "method": "platt"}), 422, "method")
    assert_problem(c.post(fit_url, json={"dataset_id": 1, "holdout": 0}), 422, "holdout")
    assert_problem(c.post(fit_url, json={"dataset_id": 1, "holdout": 0.999}), 422, "holdout")
    assert_problem(
        c.post(fit_url, json={"dataset_id": 1, "method": "temperature", "options": {"bogus": 1}}),
        422,
        "bogus",
    )
    assert_problem(
        c.post(fit_url, json={"dataset_id": 1, "method": "auto", "options": {"bogus": {}}}),
        422,
        "keyed by method",
    )
    # an integer beyond float64 (an OverflowError in math.isfinite, a 500 before)
    huge = {"dataset_id": 1, "method": "temperature", "options": {"tol": 10**400}}
    assert_problem(
        c.post(fit_url, json=huge),
        422,
        "tol must be a finite number",
    )
    # an integer option past its range: a 422 that gives the range (accepted before)
    huge = {"dataset_id": 1, "method": "matrix", "options": {"max_iter": 10**400}}
    assert_problem(
        c.post(fit_url, json=huge),
        422,
        "max_iter must be an integer >= 1 and <= 1000000. Got an integer of 401 digits.",
    )
    assert_problem(c.post(fit_url, json={"dataset_id": 1, "seed": -1}), 422, "seed")
    assert_problem(c.post(fit_url, json={"dataset_id": 10**40}), 422)
    create_model(c, "other", 4)
    assert_problem(c.post("/v1/models/other/calibrators", json={"dataset_id": 1}), 404, "dataset 1")
    assert_problem(c.get(f"{fit_url}/7"), 404, "version 7")
    assert_problem(c.get(f"{fit_url}/abc"), 422)
    assert_problem(c.get(f"{fit_url}/7/onnx"), 404)
    assert_problem(
        c.put(f"/v1/models/m/aliases/{DEFAULT_ALIAS}", json={"version": 7}), 404, "version 7"
    )
    assert_problem(c.put("/v1/models/m/aliases/bad%20name", json={"version": 1}), 422, "alias")
    assert_problem(c.put("/v1/models/m/aliases/x", json={"version": "one"}), 422, "version")
    assert_problem(c.get("/v1/models/m/aliases/nope"), 404, "nope")


def test_predict_errors(served):
    c = served
    url = "/v1/models/m/predict"
    x = [[0.1, 0.2, 0.3, 0.5]]  # not a probability row (tests/security: the kind mix-up)
    assert c.post(url, json={"logits": x}).status_code == 200
    assert_problem(c.post(url, json={"logits": [[0.1, 0.2]]}), 422, "4 columns")
    assert_problem(c.post(url, json={"logits": [[1e300, 0, 0, 0]]}), 422, "float32")
    assert_problem(c.post(url, json={"logits": x, "labels": [0]}), 422, "labels")
    assert_problem(c.post(url, json={"scores": x}), 422)
    assert_problem(c.post(url, json={"probabilities": [[0.5, 0.5, 0.5, 0.5]]}), 422, "sum to 1")
    assert_problem(
        c.post(url, json={"probabilities": [[-0.5, 0.5, 0.5, 0.5]]}), 422, "non-negative"
    )
    assert_problem(
        c.post(url, content=b"[[", headers={"content-type": "application/json"}), 400, "json"
    )
    assert_problem(c.post(url, content=b"1,2,3,4", headers={"content-type": "text/csv"}), 415)
    npy_h = {"content-type": "application/x-npy"}
    assert_problem(
        c.post(url, content=npy(np.array([[0.0, np.nan, 0.0, 0.0]])), headers=npy_h), 422, "finite"
    )
    assert_problem(c.post(url, content=npy(np.zeros((2, 2, 4))), headers=npy_h), 422, "2-D")
    assert_problem(c.post(url, content=npy(np.zeros((2, 3))), headers=npy_h), 422, "4 columns")
    assert_problem(c.post(url, content=b"\x93NUMPY garbage", headers=npy_h), 400, "npy")
    assert_problem(c.post(url, content=npy(np.zeros((2, 4)))[:-8], headers=npy_h), 400, "truncated")
    assert_problem(
        c.post(f"{url}?alias={DEFAULT_ALIAS}&version=1", json={"logits": x}), 422, "either"
    )
    assert_problem(c.post(f"{url}?alias=canary", json={"logits": x}), 404, "canary")
    assert_problem(c.post(f"{url}?version=9", json={"logits": x}), 404, "version 9")
    assert_problem(c.post(f"{url}?version=0", json={"logits": x}), 422)
    assert_problem(c.post("/v1/models/zz/predict", json={"logits": x}), 404, "zz")
    # The query is validated by the handler itself (not FastAPI's parameter solving):
    # the same 422 problem, naming the parameter.
    for query, field in (("version=abc", "version"), ("version=0", "version"), ("kind=x", "kind")):
        body = assert_problem(c.post(f"{url}?{query}", json={"logits": x}), 422, field)
        assert body["errors"][0]["loc"] == ["query", field], body


def test_predict_parameters_are_documented(client):
    """/predict declares its path and query parameters in the OpenAPI document."""
    op = client.get("/openapi.json").json()["paths"]["/v1/models/{model}/predict"]["post"]
    params = {(p["in"], p["name"]): p for p in op["parameters"]}
    assert set(params) == {
        ("path", "model"),
        ("query", "alias"),
        ("query", "version"),
        ("query", "kind"),
        ("query", "top_k"),
        ("query", "dtype"),
    }
    assert params["path", "model"]["required"]
    top_k = params["query", "top_k"]["schema"]["anyOf"][0]
    assert (top_k["type"], top_k["minimum"]) == ("integer", 1)
    version = params["query", "version"]["schema"]["anyOf"][0]
    assert (version["type"], version["minimum"]) == ("integer", 1)
    assert params["query", "kind"]["schema"]["anyOf"][0]["enum"] == list(KINDS)
    assert op["security"] == [{"bearer": []}]


def test_body_limits(database_url, tmp_path):
    s = make_settings(
        database_url, tmp_path, max_body_bytes=4096, max_json_bytes=1024, max_metadata_bytes=512
    )
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        create_model(c, "m", 3)
        big = npz(logits=np.zeros((400, 3)), labels=np.zeros(400, dtype=int))
        octet = {"content-type": "application/octet-stream"}
        assert_problem(c.post("/v1/models/m/datasets", content=big, headers=octet), 413, "4096")

        def chunks():  # no Content-Length: cut off while streaming
            for _ in range(100):
                yield b"x" * 1000

        assert_problem(c.post("/v1/models/m/datasets", content=chunks(), headers=octet), 413)
        rows = {"logits": [[0.0, 1.0, 2.0]] * 100, "labels": [0] * 100}
        assert_problem(c.post("/v1/models/m/datasets", json=rows), 413, "1024")
        small = npz(logits=np.eye(3)[[0, 1, 2] * 10] * 3.0, labels=np.array([0, 1, 2] * 10))
        r = c.post("/v1/models/m/datasets", content=small, headers=octet)
        assert r.status_code == 201, r.text
        fit(c, "m", r.json()["id"])
        assert_problem(c.post("/v1/models/m/predict?version=1", json=rows), 413)
        feedback = "/v1/models/m/feedback?version=1"
        assert_problem(c.post(feedback, content=big, headers=octet), 413, "4096")
        assert_problem(c.post(feedback, json=rows), 413, "1024")
        assert c.get("/v1/models/m/monitoring?version=1").json()["live"]["n"] == 0
        assert_problem(
            c.post(
                "/v1/models",
                json={"name": "n" * 100, "num_classes": 2, "class_names": ["y" * 600, "z"]},
            ),
            413,
        )
        # the service still works after refusing
        assert c.get("/v1/models/m").status_code == 200


# -- fuzz: garbage in, a 2xx or a problem out, never a 500 ------------------

targets = st.sampled_from(
    [
        ("POST", "/v1/models"),
        ("POST", "/v1/models/m/datasets"),
        ("POST", "/v1/models/m/calibrators"),
        ("PUT", f"/v1/models/m/aliases/{DEFAULT_ALIAS}"),
        ("POST", "/v1/models/m/predict"),
        ("POST", "/v1/models/m/predict?kind=probabilities"),
        ("POST", "/v1/models/m/predict?version=1"),
        ("POST", "/v1/models/m/feedback"),
        ("POST", "/v1/models/m/feedback?version=1"),
    ]
)


@settings(
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(target=targets, body=bodies)
def test_garbage_never_500(served, target, body):
    method, url = target
    content_type, content = body
    headers = {"content-type": content_type} if content_type else {}
    r = served.request(method, url, content=content, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/problem+json", r.headers
        assert r.json()["detail"]


# ---------------------------------------------------------------------------
# the one mapping of domain errors to problems


def _defined_errors() -> list[type[Exception]]:
    return [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ServiceError)
    ]


def test_every_domain_error_has_its_own_problem_type():
    """A new error class gets its own row of the table, not silently its base's status."""
    missing = [cls.__name__ for cls in _defined_errors() if cls not in problems.PROBLEM_TYPES]
    assert missing == []
    assert problems.problem_type(CalibrationInputError("bad")).status == 422


@pytest.mark.parametrize(
    ("error", "status", "slug", "headers", "extra"),
    [
        (errors.NotFound("gone"), 404, "not-found", {}, {}),
        (
            errors.ArgmaxChanged("flipped", argmax={"changed": 3}),
            409,
            "argmax-changed",
            {},
            {"argmax": {"changed": 3}},
        ),
        (
            errors.NotReady("later", version_status="queued"),
            409,
            "not-ready",
            {},
            {"version_status": "queued"},
        ),
        (
            errors.Unauthorized("who"),
            401,
            "unauthorized",
            {"www-authenticate": 'Bearer realm="welltempered"'},
            {},
        ),
        (
            errors.TooManyRequests("slow down", retry_after=7, rate_limit_burst=2),
            429,
            "too-many-requests",
            {"retry-after": "7"},
            {"rate_limit_burst": 2},
        ),
        (errors.MalformedJSON("{"), 400, "malformed-json", {}, {}),
        (CalibrationInputError("NaN"), 422, "invalid-input", {}, {}),
        (
            errors.DatabaseUnavailable("lost", applied="no", retry_after=2),
            503,
            "database-unavailable",
            {"retry-after": "2"},
            {"applied": "no"},
        ),
        (errors.RequestTimeout("slow"), 408, "request-timeout", {}, {}),
    ],
)
def test_error_response_is_the_wire_format(error, status, slug, headers, extra):
    request = Request({"type": "http", "method": "GET", "path": "/v1/x", "headers": []})
    r = problems.error_response(request, error, headers={"Connection": "close"})
    assert r.status_code == status and r.media_type == problems.PROBLEM_JSON
    body = orjson.loads(r.body)
    detail = error.detail if isinstance(error, errors.ServiceError) else str(error)
    assert body == {
        "type": f"/problems/{slug}",
        "title": problems.PROBLEM_TYPES[type(error)].title,
        "status": status,
        "detail": detail,
        "instance": "/v1/x",
        **extra,
    }
    assert {k: r.headers[k] for k in headers} == headers and r.headers["connection"] == "close"
    assert "retry_after" not in body  # a header, not a member


NO_HTTP = ["service/errors.py", "service/vocabulary.py", "service/settings.py", "service/storage"]


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for name in NO_HTTP
        for p in ([ROOT / name] if name.endswith(".py") else (ROOT / name).glob("*.py"))
    ),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_layers_below_the_api_know_no_http(path):
    """Domain errors and storage raise their own errors; only the api maps them to HTTP."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            packages |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            packages.add(node.module.split(".")[0])
    assert not packages & {"fastapi", "starlette"}
