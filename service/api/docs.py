"""/docs (Swagger UI) and /redoc from assets the service itself serves, so both work
offline and never load a script from another host.

The assets are those of the PyPI package ``fastapi-offline`` (Swagger UI 5, which
renders OpenAPI 3.1, and ReDoc's standalone bundle), served from its package
directory under :data:`STATIC_PATH`; the pages are FastAPI's own, pointed at them.
Like /openapi.json, they need no key: they describe the API, no tenant's data.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.server.budget import OPEN, declare

STATIC_PATH = "/docs/static"
DOCS_PATH = "/docs"
REDOC_PATH = "/redoc"
#: Swagger UI's settings: FastAPI's, and no call to the public validator's host.
SWAGGER_PARAMETERS = {
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
    "validatorUrl": None,
}


def install(app: FastAPI) -> None:
    """Mount the assets and add the two pages; call it before auth is installed (the
    pages are open, as /openapi.json is), on an app made with ``docs_url=None`` and
    ``redoc_url=None``."""
    assets = files("fastapi_offline") / "static"
    app.mount(STATIC_PATH, StaticFiles(directory=str(assets)), name="docs-static")

    def static(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{STATIC_PATH}/{name}"

    @declare(OPEN)
    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=f"{request.scope.get('root_path', '')}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=static(request, "swagger-ui-bundle.js"),
            swagger_css_url=static(request, "swagger-ui.css"),
            swagger_favicon_url=static(request, "favicon.png"),
            swagger_ui_parameters=SWAGGER_PARAMETERS,
        )

    @declare(OPEN)
    @app.get(REDOC_PATH, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=f"{request.scope.get('root_path', '')}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=static(request, "redoc.standalone.js"),
            redoc_favicon_url=static(request, "favicon.png"),
            with_google_fonts=False,
        )
