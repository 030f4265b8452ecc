"""Text a tenant stores and the service echoes (class names, model and key
descriptions): one rule, service.vocabulary.check_text / check_names, applied on
write at the edge (the API's schemas, the CLI), on SQLite and PostgreSQL; rows
stored before the rule still load and serve; Served.max_name_bytes bounds a named
answer per row."""

from __future__ import annotations

import json
import unicodedata

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from service import cli, vocabulary
from service.storage.db import Model
from service.vocabulary import (
    MAX_CLASS_NAME_CHARS,
    MAX_CLASS_NAMES_BYTES,
    MAX_DESCRIPTION_CHARS,
    MAX_KEY_DESCRIPTION_CHARS,
    check_names,
    check_text,
    longest_name_bytes,
)
from tests.service.helpers import assert_problem, create_model, logits_data, promote, upload
from tests.strategies import REFUSED_TEXT_CHARACTERS, STORED_TEXT_CHARACTERS, stored_names

#: One character of each class the rule refuses, and the words of its message.
REFUSED = [
    ("\x00", "control character"),  # NUL: PostgreSQL cannot even store it
    ("\r", "control character"),
    ("\n", "control character"),
    ("\t", "control character"),
    ("\x7f", "control character"),
    ("\x85", "control character"),  # C1 next line
    ("\u2028", "line separator"),
    ("\u2029", "paragraph separator"),
    ("\ud800", "surrogate"),
    ("\u200b", "format character"),  # zero-width space
    ("\u00ad", "format character"),  # soft hyphen
    ("\ufeff", "format character"),  # byte order mark
    ("\U000e0041", "format character"),  # tag LATIN CAPITAL LETTER A: hidden text
    *[(c, "bidirectional") for c in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"],
    *[(c, "bidirectional") for c in "\u2066\u2067\u2068\u2069"],
]
#: Names any tenant may give: combining marks, CJK, emoji sequences (joined by U+200D),
#: Persian with a zero-width non-joiner, right-to-left text, spaces inside.
ACCEPTED = [
    "e\u0301cole",
    "Z\u0351\u036b\u0343\u036a",
    "猫",
    "ねこ / 貓",
    "\U0001f408\u200d\u2b1b",  # black cat
    "\U0001f469\u200d\U0001f52c",  # woman scientist
    "\U0001f1eb\U0001f1f7",  # a flag: two regional indicators
    "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
    "\u05d7\u05ea\u05d5\u05dc",
    "chat noir",
    "x" * MAX_CLASS_NAME_CHARS,
    "\U0001f408" * MAX_CLASS_NAME_CHARS,  # 128 characters, 512 bytes
]


def named(names: list[str]) -> dict:
    return {"name": "m", "num_classes": len(names), "class_names": names}


def send(client, method: str, path: str, body: dict):
    """``body`` as JSON with \\u escapes, so a lone surrogate can be sent (as any client
    may: json.loads reads "\\ud800")."""
    headers = {"content-type": "application/json"}
    return client.request(method, path, content=json.dumps(body), headers=headers)


def code_point(char: str) -> str:
    return f"U+{ord(char):04X}"


# ---------------------------------------------------------------------------
# the rule itself


def test_the_bidirectional_controls_are_those_of_cve_2021_42574():
    listed = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
    assert {ord(c) for c in vocabulary.BIDI_CONTROLS} == listed
    assert all(unicodedata.category(c) == "Cf" for c in vocabulary.BIDI_CONTROLS)
    assert vocabulary.ALLOWED_FORMAT_CHARACTERS == {"\u200c", "\u200d"}


@pytest.mark.parametrize(("char", "words"), REFUSED, ids=[code_point(c) for c, _ in REFUSED])
def test_each_refused_character_is_named_by_its_code_point(char, words):
    for text in (char, f"a{char}", f"ab{char}cd"):
        with pytest.raises(ValueError, match=words) as caught:
            check_text(text, "what", 128)
        assert code_point(char) in str(caught.value) and str(caught.value).startswith("what ")
        assert str(caught.value).endswith(".")


@given(
    st.text(STORED_TEXT_CHARACTERS, max_size=20),
    REFUSED_TEXT_CHARACTERS,
    st.text(STORED_TEXT_CHARACTERS, max_size=20),
)
def test_any_refused_character_anywhere_is_refused(before, char, after):
    with pytest.raises(ValueError, match=f"Got U\\+{ord(char):04X} at character {len(before)} "):
        check_text(before + char + after, "description", 1024)


@given(stored_names())
def test_any_name_of_printable_text_is_accepted(name):
    assert check_text(name, "class_names[0]", MAX_CLASS_NAME_CHARS, name=True) is name


@given(
    st.lists(
        stored_names(), min_size=1, max_size=20, unique_by=lambda s: unicodedata.normalize("NFC", s)
    )
)
def test_distinct_names_are_accepted_and_their_longest_is_measured(names):
    assert check_names(names) is names
    assert longest_name_bytes(names) == max(len(n.encode()) for n in names)


@pytest.mark.parametrize("blank", ["", " ", "\u3000", "  \u00a0 "])
def test_a_name_is_not_blank_but_a_description_may_be(blank):
    with pytest.raises(ValueError, match=r"must not be empty or only whitespace\. Got"):
        check_text(blank, "class_names[0]", 128, name=True)
    assert check_text(blank, "description", 1024) == blank


@pytest.mark.parametrize("padded", [" cat", "cat ", "cat\u00a0"])
def test_a_name_has_no_whitespace_at_its_ends(padded):
    with pytest.raises(ValueError, match="must not begin or end with whitespace"):
        check_text(padded, "class_names[0]", 128, name=True)


def test_lengths_are_counted_in_characters():
    check_text("\U0001f408" * 128, "n", 128, name=True)
    with pytest.raises(ValueError, match=r"at most 128 characters\. Got 129\.$"):
        check_text("\U0001f408" * 129, "n", 128, name=True)


def test_names_are_distinct_also_in_normal_form_c():
    with pytest.raises(ValueError, match=r"class_names\[2\] is class_names\[0\]\. Got 'cat'\."):
        check_names(["cat", "dog", "cat"])
    with pytest.raises(ValueError, match=r"normal form C\. Got '\\xe9' and 'e\\u0301'\."):
        check_names(["\u00e9", "e\u0301"])
    check_names(["\u00e9", "E\u0301"])  # case is a difference


def test_all_names_together_are_bounded_in_utf8_bytes():
    fits = [f"{i:04d}".ljust(MAX_CLASS_NAME_CHARS, "x") for i in range(512)]
    assert sum(len(n.encode()) for n in fits) == MAX_CLASS_NAMES_BYTES
    assert check_names(fits) is fits
    wide = [*fits[:-1], fits[-1][:-1] + "\u00e9"]  # as many characters, one byte more
    with pytest.raises(ValueError, match=rf"at most {MAX_CLASS_NAMES_BYTES} bytes .* Got 65537\."):
        check_names(wide)


def test_longest_name_bytes_of_nothing_is_zero():
    assert longest_name_bytes(None) == longest_name_bytes([]) == 0
    assert longest_name_bytes(["a", "\U0001f408", "ab"]) == 4


# ---------------------------------------------------------------------------
# through the HTTP API, on SQLite and PostgreSQL


@pytest.mark.parametrize(("char", "words"), REFUSED, ids=[code_point(c) for c, _ in REFUSED])
def test_the_api_refuses_each_character_class_in_every_stored_text(module_client, char, words):
    c = module_client
    bad = f"cat{char}"
    for r, field in [
        (send(c, "POST", "/v1/models", named(["dog", bad])), "class_names[1]"),
        (send(c, "POST", "/v1/models", {**named(["a", "b"]), "description": bad}), "description"),
        (send(c, "POST", "/v1/keys", {"scope": "predict", "description": bad}), "description"),
    ]:
        body = assert_problem(r, 422, field, words, code_point(char))
        assert body["errors"][0]["loc"][:2] == ["body", field.split("[")[0]]
    assert c.get("/v1/models/m").status_code == 404
    create_model(c, "kept", 2, class_names=["a", "b"], description="d")
    try:
        for patch in ({"class_names": ["a", bad]}, {"description": bad}):
            assert_problem(send(c, "PATCH", "/v1/models/kept", patch), 422, code_point(char))
        got = c.get("/v1/models/kept").json()
        assert (got["class_names"], got["description"]) == (["a", "b"], "d")
    finally:
        c.delete("/v1/models/kept")


@pytest.mark.parametrize(
    ("names", "words"),
    [
        (["a", ""], "class_names[1] must not be empty"),
        (["a", "   "], "class_names[1] must not be empty"),
        (["a ", "b"], "class_names[0] must not begin or end with whitespace"),
        (["a", "x" * (MAX_CLASS_NAME_CHARS + 1)], f"at most {MAX_CLASS_NAME_CHARS} characters"),
        (["a", "b", "a"], "class_names[2] is class_names[0]"),
        (["\u00e9", "e\u0301"], "normal form C"),
        ([f"{i:04d}".ljust(MAX_CLASS_NAME_CHARS, "x") for i in range(513)], "65536 bytes"),
    ],
)
def test_the_api_refuses_bad_class_names(module_client, names, words):
    assert_problem(module_client.post("/v1/models", json=named(names)), 422, words)
    assert module_client.get("/v1/models/m").status_code == 404


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"description": "x" * (MAX_DESCRIPTION_CHARS + 1)}, f"{MAX_DESCRIPTION_CHARS} char"),
        ({"scope": "predict", "description": "x" * (MAX_KEY_DESCRIPTION_CHARS + 1)}, "256 char"),
    ],
)
def test_the_api_bounds_descriptions(module_client, body, words):
    path = "/v1/keys" if "scope" in body else "/v1/models"
    body = body if "scope" in body else {**named(["a", "b"]), **body}
    assert_problem(module_client.post(path, json=body), 422, "description", words)


def test_the_api_accepts_and_echoes_text_of_any_script(client):
    names = [*ACCEPTED, *[f"{i:04d}".ljust(MAX_CLASS_NAME_CHARS, "x") for i in range(400)]]
    description = "\u00e9t\u00e9 \u2014 \u732b \U0001f408\u200d\u2b1b " + "x" * 1000
    r = client.post("/v1/models", json={**named(names), "description": description})
    assert r.status_code == 201, r.text
    assert (r.json()["class_names"], r.json()["description"]) == (names, description)
    assert client.get("/v1/models/m").json()["class_names"] == names
    renamed = list(reversed(names))
    assert client.patch("/v1/models/m", json={"class_names": renamed}).json()["class_names"] == (
        renamed
    )
    r = client.post("/v1/keys", json={"scope": "predict", "description": "\u732b " * 128})
    assert r.status_code == 201, r.text


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    names=st.lists(
        stored_names(), min_size=2, max_size=6, unique_by=lambda s: unicodedata.normalize("NFC", s)
    )
)
def test_any_printable_names_round_trip_through_the_api(module_client, names):
    create_model(module_client, "rt", len(names), class_names=names)
    try:
        assert module_client.get("/v1/models/rt").json()["class_names"] == names
    finally:
        module_client.delete("/v1/models/rt")


# ---------------------------------------------------------------------------
# stored before the rule: still loaded and served; Served.max_name_bytes


def served(client, model: str):
    state = client.app.state.welltempered
    state.serving.invalidate(model, vocabulary.DEFAULT_NAMESPACE)
    return anyio.run(
        state.serving.get, model, vocabulary.DEFAULT_ALIAS, None, vocabulary.DEFAULT_NAMESPACE
    )


def test_served_measures_the_longest_name_in_bytes(client):
    create_model(client, "m", 3)
    z, y = logits_data(200, 3)
    promote(client, "m", upload(client, "m", z, y)["id"])
    assert served(client, "m").max_name_bytes == 0
    names = ["a", "\U0001f408\u200d\u2b1b", "\u732b\u732b"]  # 1, 10 and 6 bytes
    assert client.patch("/v1/models/m", json={"class_names": names}).status_code == 200
    got = served(client, "m")
    assert got.max_name_bytes == 10 and got.class_names.tolist() == names


def test_rows_stored_before_the_rule_still_load_and_serve(client):
    create_model(client, "m", 3)
    z, y = logits_data(200, 3)
    promote(client, "m", upload(client, "m", z, y)["id"])
    legacy = ["", "line\nbreak\u202e", "y" * 4000]  # refused today; stored by an older version
    state = client.app.state.welltempered
    with state.sessions() as session:
        session.execute(
            update(Model).where(Model.name == "m").values(class_names=legacy, description="\r")
        )
        session.commit()
    got = client.get("/v1/models/m").json()
    assert (got["class_names"], got["description"]) == (legacy, "\r")
    assert served(client, "m").max_name_bytes == 4000
    r = client.post("/v1/models/m/predict", json={"logits": z[:3].tolist()})
    assert r.status_code == 200, r.text
    assert r.json()["label_names"] == [legacy[i] for i in r.json()["labels"]]
    # changing something else leaves them; changing them applies the rule
    assert client.patch("/v1/models/m", json={"argmax_policy": "warn"}).status_code == 200
    assert client.get("/v1/models/m").json()["class_names"] == legacy
    assert_problem(client.patch("/v1/models/m", json={"class_names": legacy}), 422, "empty")


def test_the_cli_applies_the_rule_to_a_key_description(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WELLTEMPERED_DATABASE_URL", f"sqlite:///{tmp_path / 'k.sqlite3'}")
    create = ["keys", "--create-database", "create", "--namespace", "team", "--scope", "write"]
    assert cli.main([*create, "--description", "ops\u202ekey"]) == 2
    err = capsys.readouterr().err
    assert "--description must not contain a bidirectional" in err and "U+202E" in err
    assert cli.main([*create, "--description", "x" * (MAX_KEY_DESCRIPTION_CHARS + 1)]) == 2
    assert f"at most {MAX_KEY_DESCRIPTION_CHARS} characters" in capsys.readouterr().err
    assert cli.main([*create, "--description", "\u732b ops"]) == 0
