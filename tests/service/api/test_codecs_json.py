"""JSON score bodies in process (service/api/codecs/json_body.py): the fast paths of small bodies
refuse what the careful paths refuse."""

import json

import numpy as np
import pytest

from calibrators.validation import CalibrationInputError
from service.api.codecs import json_body, rules
from service.errors import ContentTooLarge, InvalidInput
from service.serving import inference

K = 4


def bounds(max_rows: int = 100, k: int = K) -> rules.Bounds:
    return rules.Bounds(k, "m", max_rows, 1 << 20, "predict")


@pytest.mark.parametrize("literal", ["true", "false", "null"])
@pytest.mark.parametrize("at", [0, 2, K - 1])
def test_a_literal_among_the_numbers_is_refused(literal, at):
    row = ["1.5", "-2", "0.25e-3", "7"]
    row[at] = literal
    body = f'{{"logits": [[{", ".join(row)}]]}}'.encode()
    with pytest.raises(InvalidInput, match="must be a numeric array"):
        json_body.scores_from_json(body, bounds())


def test_numbers_with_exponents_are_read_exactly():
    """Probabilities exactly as float64; logits as the served graph takes them: float32,
    each the float64 number rounded once (what casting the float64 array gives)."""
    x = np.array([[1.5e-3, -2.0, 3.25e10, 0.1 + 1e-12, 1e-50, 0.0]])
    body = json.dumps({"logits": x.tolist()}).encode()
    scores, kind = json_body.scores_from_json(body, bounds(k=6))
    assert kind == "logits" and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, x.astype(np.float32))
    p = np.array([[0.1 + 1e-12, 0.2, 0.7 - 1e-12, 0.0, 0.0, 0.0]])
    body = json.dumps({"probabilities": p.tolist()}).encode()
    scores, kind = json_body.scores_from_json(body, bounds(k=6))
    assert kind == "probabilities" and scores.dtype == np.float64
    np.testing.assert_array_equal(scores, p)


def test_logits_past_float32s_range_stay_float64_for_the_serving_message():
    x = [[1.0, -2.0, 3.5e38, 0.0, 0.0, 0.0]]
    body = json.dumps({"logits": x}).encode()
    scores, kind = json_body.scores_from_json(body, bounds(k=6))
    assert scores.dtype == np.float64 and scores[0, 2] == 3.5e38
    with pytest.raises(CalibrationInputError, match="must fit in float32"):
        inference.as_onnx_input(scores, kind)


def test_a_row_with_a_negative_among_its_first_values_is_no_distribution_and_the_rest_summed():
    row = np.full((1, 40), 1 / 40)
    assert rules.every_row_a_distribution(row)
    row[0, 3] = -0.0125  # among the first values: decided there
    assert not rules.every_row_a_distribution(row)
    row[0, 3], row[0, 30] = 1 / 40, -1e-9  # past them: the first row's sum and the block
    assert not rules.every_row_a_distribution(row)


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
