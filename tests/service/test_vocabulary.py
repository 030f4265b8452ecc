"""service.vocabulary: the closed lists are derived or written once, and every user
agrees with them (the tables' CHECK constraints, the API's schemas)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

import calibrators
from calibrators.validation import KINDS as CORE_KINDS
from service import vocabulary
from service.api.app import create_app
from service.storage.db import ApiKey, CalibratorVersion, Dataset, Model


def test_lists_are_derived_from_the_core():
    assert vocabulary.METHODS == (*calibrators.METHODS, vocabulary.AUTO)
    assert vocabulary.KINDS is CORE_KINDS
    assert set(vocabulary.UNFINISHED) | set(vocabulary.FITTED) < set(vocabulary.STATUSES)
    assert vocabulary.DEFAULT_ARGMAX_POLICY in vocabulary.ARGMAX_POLICIES


@pytest.mark.parametrize(
    ("table", "column", "values"),
    [
        (Model, "argmax_policy", vocabulary.ARGMAX_POLICIES),
        (Dataset, "kind", vocabulary.KINDS),
        (CalibratorVersion, "status", vocabulary.STATUSES),
        (ApiKey, "scope", vocabulary.SCOPES),
    ],
)
def test_check_constraints_name_the_lists(table, column, values):
    name = f"ck_{table.__tablename__}_{column}"  # the name the migrations use
    checks = [str(c.sqltext) for c in table.__table__.constraints if c.name == name]
    assert checks == [f"{column} IN ({', '.join(map(repr, values))})"]


def test_the_api_documents_the_same_lists(settings):
    doc = TestClient(create_app(settings)).get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert schemas["FitRequest"]["properties"]["method"]["enum"] == list(vocabulary.METHODS)
    assert schemas["FitRequest"]["properties"]["method"]["default"] == vocabulary.AUTO
    policy = schemas["ModelCreate"]["properties"]["argmax_policy"]
    assert policy["enum"] == list(vocabulary.ARGMAX_POLICIES)
    assert policy["default"] == vocabulary.DEFAULT_ARGMAX_POLICY
    # an admin creates tenant keys only; a metrics key is the operator's (the CLI's)
    assert schemas["KeyCreate"]["properties"]["scope"]["enum"] == list(vocabulary.TENANT_SCOPES)
    assert schemas["KeyOut"]["properties"]["scope"]["enum"] == list(vocabulary.SCOPES)
    assert vocabulary.SCOPES == (*vocabulary.TENANT_SCOPES, vocabulary.METRICS_SCOPE)
    assert schemas["VersionOut"]["properties"]["status"]["enum"] == list(vocabulary.STATUSES)


@given(st.integers(1, 9_999_999), st.sampled_from(sorted(vocabulary.DURATION_UNITS)))
def test_durations_round_trip(count, unit):
    seconds = vocabulary.parse_duration(f"{count}{unit}")
    assert seconds == count * vocabulary.DURATION_UNITS[unit]
    assert vocabulary.parse_duration(vocabulary.format_duration(seconds)) == seconds


@pytest.mark.parametrize("bad", ["", "h", "0h", "01h", "1", "1x", "1.5h", "-1h", "1 h", "1H", 3])
def test_a_malformed_duration_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"duration .* Got"):
        vocabulary.parse_duration(bad)
