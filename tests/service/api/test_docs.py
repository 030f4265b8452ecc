"""/docs and /redoc work offline: every asset they reference is served by the app
itself (no other host), open without a key like /openapi.json, and Swagger UI's is a
version that renders our OpenAPI 3.1 document."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

import calibrators
from calibrators.options import Integer
from service.api.app import create_app
from service.api.fit_options import OPTION_MODELS
from tests.service.helpers import make_settings

#: src="...", href="...", ReDoc's spec-url="..." and Swagger UI's url: '...' in the pages.
REFERENCES = re.compile(
    r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|url:\s*["']([^"']+)["']"""
)
TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "json"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    settings = make_settings(f"sqlite:///{tmp / 'r.sqlite3'}", tmp, auth="on")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_a_docs_page_references_only_the_apps_own_assets(served, page):
    r = served.get(page)  # no key: the docs are open, as /openapi.json is
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    found = [a or b for a, b in REFERENCES.findall(r.text)]
    assert len(found) >= 3, found  # script, style or favicon, and the document
    assert not re.search(r"(?i)\b(?:https?:)?//", r.text), "an absolute URL in " + page
    for url in found:
        assert url.startswith("/"), url
        asset = served.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 0
        suffix = url[url.rfind(".") :]
        assert TYPES[suffix] in asset.headers["content-type"], (url, asset.headers)


def test_swagger_ui_renders_openapi_3_1(served):
    assert served.get("/openapi.json").json()["openapi"].startswith("3.1")
    bundle = served.get("/docs/static/swagger-ui-bundle.js").text
    assert "isOAS31" in bundle  # Swagger UI 5; 4.x shows 3.1 documents as invalid


def test_the_api_itself_still_needs_a_key(served):
    assert served.get("/v1/models").status_code == 401
    assert served.get("/docs/static/nothing.js").status_code == 404


def test_the_fit_options_show_the_integer_ranges_the_library_checks(served):
    schemas = served.get("/openapi.json").json()["components"]["schemas"]
    shown = 0
    for method, cls in calibrators.CALIBRATORS.items():
        properties = schemas[OPTION_MODELS[method].__name__]["properties"]
        for name, check in cls.option_checks.items():
            if isinstance(check, Integer):
                assert (properties[name]["minimum"], properties[name]["maximum"]) == (
                    check.minimum, check.maximum), (method, name)
                shown += 1
    assert shown >= 10
