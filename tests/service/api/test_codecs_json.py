"""JSON score bodies in process (service/api/codecs/json_body.py): the fast paths of small bodies
refuse what the careful paths refuse."""

import json

import numpy as np
import pytest

from service.api.codecs import json_body, rules
from service.errors import ContentTooLarge, InvalidInput

K = 4


def bounds(max_rows: int = 100) -> rules.Bounds:
    return rules.Bounds(K, "m", max_rows, 1 << 20, "predict")


@pytest.mark.parametrize("literal", ["true", "false", "null"])
@pytest.mark.parametrize("at", [0, 2, K - 1])
def test_a_literal_among_the_numbers_is_refused(literal, at):
    row = ["1.5", "-2", "0.25e-3", "7"]
    row[at] = literal
    body = f'{{"logits": [[{", ".join(row)}]]}}'.encode()
    with pytest.raises(InvalidInput, match="must be a numeric array"):
        json_body.scores_from_json(body, bounds())


def test_numbers_with_exponents_are_read_exactly():
    x = np.array([[1.5e-3, -2.0, 3.25e10, 0.0]])
    scores, kind = json_body.scores_from_json(json.dumps({"logits": x.tolist()}).encode(), bounds())
    assert kind == "logits" and scores.dtype == np.float64
    np.testing.assert_array_equal(scores, x)


def test_a_body_with_more_numbers_than_the_rows_allow_is_413_before_parsing(monkeypatch):
    """Short numbers ("0,") pack more values into a body than its length suggests: the
    count is skipped only when the body is too short to exceed the limit at all, and a
    body over it is refused before orjson builds its Python floats."""

    def no_parse(body):
        raise AssertionError("parsed a body that was over the limit")

    monkeypatch.setattr(json_body, "decode_json", no_parse)
    allowed = 2 * (K + 2) + 64  # what json_object allows for 2 rows
    rows = [[0] * K] * 40  # 160 numbers in ~500 bytes
    body = json.dumps({"logits": rows}, separators=(",", ":")).encode()
    assert len(body) > allowed
    with pytest.raises(ContentTooLarge):
        json_body.scores_from_json(body, bounds(max_rows=2))
