"""One served app for the adversarial body tests: small limits, two fitted models.

The bodies are refused by the parsers before anything touches the database, so
these tests run on SQLite only (tests/service runs the routes on both backends).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from tests.service.helpers import create_model, logits_data, make_settings, promote, upload

#: The limits of the served app (the tests reach each of them).
LIMITS = {
    "max_predict_rows": 1000,
    "max_feedback_rows": 1000,
    "max_dataset_rows": 5000,
    "max_body_bytes": 4 << 20,
    "max_json_bytes": 2 << 20,
}


@pytest.fixture(scope="package")
def served(tmp_path_factory) -> Iterator[TestClient]:
    """Model ``m`` (4 classes) with a fitted default alias, on an app with :data:`LIMITS`."""
    tmp = tmp_path_factory.mktemp("security")
    settings = make_settings(f"sqlite:///{tmp / 'registry.sqlite3'}", tmp, **LIMITS)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        create_model(client, "m", 4, argmax_policy="off")
        z, y = logits_data(300, 4)
        promote(client, "m", upload(client, "m", z, y)["id"])
        yield client
