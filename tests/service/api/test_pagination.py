"""Cursor pagination of every list route: pages in key order, next_cursor and the Link
header, a cursor that survives deletes and inserts, 422 for a cursor that is not one
of the list's; on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import json
import re

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.pagination import DEFAULT_LIMIT, MAX_LIMIT
from service.security import keys
from tests.service.helpers import (
    assert_problem,
    create_model,
    logits_data,
    make_settings,
    promote,
    upload,
)

LINK = re.compile(r'^<(?P<url>[^>]+)>; rel="next"$')


def walk(client: TestClient, url: str, field: str, **headers) -> list[list]:
    """Every page of a list, following the Link header; checks it agrees with the body."""
    pages = []
    while True:
        r = client.get(url, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        pages.append(body[field])
        link = r.headers.get("link")
        if body["next_cursor"] is None:
            assert link is None
            return pages
        url = LINK.match(link)["url"]
        assert f"cursor={body['next_cursor']}" in url


def test_models_in_pages_of_limit(client):
    for i in range(5):
        create_model(client, f"m{i}", 2)
    pages = walk(client, "/v1/models?limit=2", "models")
    assert [[m["name"] for m in p] for p in pages] == [["m0", "m1"], ["m2", "m3"], ["m4"]]
    whole = client.get("/v1/models").json()
    assert [m["name"] for m in whole["models"]] == [f"m{i}" for i in range(5)]
    assert whole["next_cursor"] is None and "link" not in client.get("/v1/models").headers
    # exactly a page's worth: no empty page after it
    assert len(walk(client, "/v1/models?limit=5", "models")) == 1


def test_a_cursor_neither_repeats_nor_skips_across_deletes_and_inserts(client):
    for i in range(4):
        create_model(client, f"m{i}", 2)
    r = client.get("/v1/models?limit=2")
    cursor = r.json()["next_cursor"]
    assert client.delete("/v1/models/m1").status_code == 200  # the page's last row
    assert client.delete("/v1/models/m2").status_code == 200  # the next page's first
    create_model(client, "m9", 2)
    rest = client.get(f"/v1/models?limit=2&cursor={cursor}").json()
    assert [m["name"] for m in rest["models"]] == ["m3", "m9"]


def test_every_list_of_a_model_pages(client):
    create_model(client, "m", 4)
    ids = [upload(client, "m", *logits_data(40, 4, seed=s))["id"] for s in range(3)]
    pages = walk(client, "/v1/models/m/datasets?limit=2", "datasets")
    assert [[d["id"] for d in p] for p in pages] == [ids[:2], ids[2:]]
    for ds in ids:
        promote(client, "m", ds)
    pages = walk(client, "/v1/models/m/calibrators?limit=2", "calibrators")
    assert [[v["version"] for v in p] for p in pages] == [[1, 2], [3]]
    for name in ("c", "a", "b"):
        client.put(f"/v1/models/m/aliases/{name}", json={"version": 1})
    pages = walk(client, "/v1/models/m/aliases?limit=2", "aliases")
    assert [[a["alias"] for a in p] for p in pages] == [["a", "b"], ["c", "production"]]


def test_keys_page(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, auth="on")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        with c.app.state.welltempered.sessions() as s:
            _, admin = keys.create_key(s, "team", "admin")
            for _ in range(3):
                keys.create_key(s, "team", "predict")
            keys.create_key(s, "elsewhere", "admin")
        pages = walk(c, "/v1/keys?limit=3", "keys", authorization=f"Bearer {admin}")
        assert [len(p) for p in pages] == [3, 1]
        ids = [k["id"] for p in pages for k in p]
        assert ids == sorted(ids) and {k["namespace"] for p in pages for k in p} == {"team"}


@pytest.fixture(scope="module")
def one_model(module_client) -> TestClient:
    """An app of each backend with model ``m``, for the refused requests below."""
    create_model(module_client, "m", 2)
    return module_client


def _raw(data) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "cursor",
    [
        "not-base64!",
        "AAAA",
        _raw([1, 2]),
        _raw({"list": "datasets", "after": 1}),  # another list's
        _raw({"list": "models", "after": -1}),
        _raw({"list": "models", "after": 2**80}),  # past any id (a driver error otherwise)
        _raw({"list": "models", "after": True}),
        _raw({"list": "models", "after": "m1"}),
        _raw({"list": "models", "after": 1, "more": 1}),
        "x" * 300,
    ],
)
def test_a_cursor_that_is_not_the_lists_is_a_422(one_model, cursor):
    assert_problem(one_model.get("/v1/models", params={"cursor": cursor}), 422)


@pytest.mark.parametrize(
    "cursor", [_raw({"list": "aliases", "after": "a\x00b"}), _raw({"list": "aliases", "after": 3})]
)
def test_an_alias_cursor_holds_an_alias_name(one_model, cursor):
    r = one_model.get("/v1/models/m/aliases", params={"cursor": cursor})
    assert_problem(r, 422, "cursor")


@pytest.mark.parametrize("limit", ["0", str(MAX_LIMIT + 1), "-1", "x", ""])
def test_limit_out_of_range_is_a_422(one_model, limit):
    assert_problem(one_model.get(f"/v1/models?limit={limit}"), 422)


def test_the_default_limit(database_url, tmp_path):
    settings = make_settings(database_url, tmp_path, quota_models=DEFAULT_LIMIT + 1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        for i in range(DEFAULT_LIMIT + 1):
            create_model(c, f"m{i}", 2)
        pages = walk(c, "/v1/models", "models")
        assert [len(p) for p in pages] == [DEFAULT_LIMIT, 1]
        assert pages[1][0]["name"] == f"m{DEFAULT_LIMIT}"


def test_a_page_ends_early_at_its_answer_budget(tmp_path, database_url):
    """A page is bounded in bytes too: GET /v1/models answers at most MAX_JSON_BYTES
    (150 KiB here), so models with about 60 KiB of class names each come two a page
    however large ?limit= is, and the listing still visits every model once."""
    settings = make_settings(database_url, tmp_path, max_json_bytes=150 * 1024)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        names = [f"{i:03d}" + "n" * 120 for i in range(480)]  # about 60 KiB
        for i in range(5):
            r = c.post("/v1/models", json={"name": f"m{i}", "num_classes": 480,
                                           "class_names": names})
            assert r.status_code == 201, r.text
        seen, url, pages_seen = [], "/v1/models?limit=1000", 0
        while url:
            r = c.get(url)
            assert r.status_code == 200, r.text
            assert len(r.content) <= settings.max_json_bytes
            body = r.json()
            seen += [m["name"] for m in body["models"]]
            pages_seen += 1
            url = f"/v1/models?limit=1000&cursor={body['next_cursor']}" if body[
                "next_cursor"] else None
        assert seen == [f"m{i}" for i in range(5)]
        assert pages_seen >= 3
