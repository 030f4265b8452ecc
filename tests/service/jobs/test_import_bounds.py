"""The ``fit_info`` of posted parameters is bounded: size, nesting, strings and their
characters are a 422 at submission, nothing queued; what the service's own fits write
is far inside the bounds. On SQLite and PostgreSQL."""

from __future__ import annotations

import json

import orjson
import pytest

import calibrators
from service.jobs import evaluation
from service.jobs.evaluation import MAX_FIT_INFO_BYTES, MAX_FIT_INFO_DEPTH, MAX_FIT_INFO_STRING
from tests.service.helpers import assert_problem, create_model, import_params, logits_data, upload

IMPORT = "/v1/models/m/calibrators/import"


@pytest.fixture(scope="module")
def fitted() -> dict:
    z, y = logits_data(300, 4)
    return calibrators.create("vector").fit(z, y).to_params()


@pytest.fixture(scope="module")
def m_dataset(module_client) -> int:
    """Model ``m`` (K = 4, argmax policy off) with one dataset and no version: the refused
    imports must leave it so."""
    create_model(module_client, "m", 4, argmax_policy="off")
    return upload(module_client, "m", *logits_data(300, 4))["id"]


def nested(depth: int) -> dict:
    """A fit_info of ``depth`` levels of objects (itself the first)."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _padding(n_bytes: int) -> dict:
    """A fit_info of exactly ``n_bytes`` bytes of JSON, of strings under the length bound."""
    info, i = {}, 0
    while len(orjson.dumps(info)) < n_bytes - 1100:
        info[f"k{i:05d}"] = "x" * 1000
        i += 1
    info["last"] = ""
    info["last"] = "x" * (n_bytes - len(orjson.dumps(info)))
    assert len(orjson.dumps(info)) == n_bytes
    return info


@pytest.mark.parametrize(
    ("fit_info", "words"),
    [
        ({"blob": "x" * 5_000_000}, ["fit_info", "at most 65536 bytes", "5000011"]),
        ({"blob": "x" * (MAX_FIT_INFO_STRING + 1)}, ["at most 1024 characters", "fit_info.blob"]),
        (_padding(MAX_FIT_INFO_BYTES + 1), ["at most 65536 bytes", f"{MAX_FIT_INFO_BYTES + 1}"]),
        (nested(MAX_FIT_INFO_DEPTH + 1), ["8 deep"]),
        ({"a": [[[[[[[[1]]]]]]]]}, ["8 deep"]),
        ({"k" * (MAX_FIT_INFO_STRING + 1): 1}, ["1024 characters"]),
        ({"note": "ab\u202ecd"}, ["bidirectional", "U+202E", "fit_info.note"]),
        ({"note": "\u2066x\u2069"}, ["U+2066"]),
        ({"n\u200fote": 1}, ["U+200F"]),
        ({"list": ["ok", "line\nbreak"]}, ["control", "U+000A", "fit_info.list[1]"]),
        ({"esc": "\x1b[31m"}, ["U+001B"]),
        ({"c1": "\x85"}, ["U+0085"]),
        ({"nul": "\x00"}, ["U+0000"]),
        ({"big": 10**400}, ["fit_info", "64-bit"]),
        ({"big": [2**64]}, ["fit_info", "64-bit"]),
    ],
)
def test_unbounded_fit_info_is_refused(module_client, m_dataset, fitted, fit_info, words):
    # json.dumps: the request as a client sends it (10**400 is a JSON number).
    body = json.dumps({"dataset_id": m_dataset, "params": {**fitted, "fit_info": fit_info}})
    r = module_client.post(IMPORT, content=body, headers={"content-type": "application/json"})
    assert_problem(r, 422, *words)
    assert module_client.get("/v1/models/m/calibrators").json()["calibrators"] == []


def test_fit_info_at_the_bounds_is_imported(client, fitted):
    create_model(client, "m", 4, argmax_policy="off")
    ds = upload(client, "m", *logits_data(300, 4))["id"]
    for info in (
        _padding(MAX_FIT_INFO_BYTES),
        nested(MAX_FIT_INFO_DEPTH),
        {"k" * MAX_FIT_INFO_STRING: "v" * MAX_FIT_INFO_STRING, "unicode": "é→中 🙂", "n": 2**63},
    ):
        v = import_params(client, "m", ds, {**fitted, "fit_info": info})
        assert v["status"] == "succeeded", v
        assert v["params"]["fit_info"] == info


@pytest.mark.parametrize("method", calibrators.METHODS)
def test_every_methods_own_fit_info_is_far_inside_the_bounds(method):
    z, y = logits_data(400, 12)
    info = calibrators.create(method).fit(z, y).to_params()["fit_info"]
    evaluation.check_fit_info(info)
    assert len(orjson.dumps(info)) < MAX_FIT_INFO_BYTES // 16
