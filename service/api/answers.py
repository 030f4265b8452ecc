"""The size of a prediction's answer, known before it is computed.

/v1 predict and /v2 infer answer per row a few numbers, whole rows of K
probabilities, the k best classes, and class names: an answer can be far larger
than its request (a 400 KB .npy of 10,000 rows asking for ``top_k`` names of 104 KB
was once a 2.98 GB answer). Each route computes the most bytes its answer can take
from the request (rows, outputs, ``top_k``, the model's longest class name) and
refuses it before any work when it is over :class:`AnswerLimits`:

- the answer's numbers and names written as JSON: at most ``MAX_JSON_BYTES`` (422,
  naming the binary form or ``top_k`` that carries the same information);
- the whole answer: its data at most the route's declared answer limit, and at most
  ``MAX_JSON_BYTES`` or twice the request's decoded body, whichever is larger, plus
  :data:`CONSTANT_BYTES` around the data (413):
  a server holds an answer while it is sent, so an answer's memory is bounded by the
  request that asked for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from service.errors import ContentTooLarge, InvalidInput
from service.server import budget

#: Bytes one value may take in a JSON answer: the longest float32 orjson writes
#: ("-1.1754944e-38", 14) or int64 (20 characters), and a comma.
JSON_BYTES = {"FP32": 16, "INT64": 21}
#: Bytes of one value in a binary answer (.npy, binary tensor data).
BINARY_BYTES = {"FP32": 4, "INT64": 8}
#: The JSON around the data: keys, brackets, shapes, the model's name and version.
CONSTANT_BYTES = 4096


def json_string_bytes(utf8_bytes: int) -> int:
    """The most bytes a string of ``utf8_bytes`` takes in JSON: each byte escaped
    (``\\u00XX``, 6 bytes, for a control character of a name stored before they were
    refused), two quotes and a comma."""
    return 6 * utf8_bytes + 3


@dataclass(frozen=True)
class AnswerLimits:
    """The two limits of one request's answer (module docstring)."""

    total: int
    json: int

    @classmethod
    def of(cls, request: Request, max_json_bytes: int, body_bytes: int) -> AnswerLimits:
        """The limits of ``request``, whose body took ``body_bytes`` once decoded."""
        route = budget.limits_of(request.scope)
        declared = route.answer if route is not None else max_json_bytes
        data = min(declared, max(max_json_bytes, 2 * body_bytes))
        return cls(data + CONSTANT_BYTES, max_json_bytes)

    def check(self, total: int, as_json: int, fix: str) -> None:
        """Refuse an answer of ``total`` bytes, ``as_json`` of them JSON data; ``fix``
        says how to ask for the same information in fewer bytes."""
        if as_json > self.json:
            raise InvalidInput(
                f"The answer's JSON data could take {as_json:,} bytes, more than "
                f"MAX_JSON_BYTES ({self.json:,}). {fix}",
                fix=fix,
            )
        if total > self.total:
            raise ContentTooLarge(
                f"The answer could take {total:,} bytes, more than its limit of "
                f"{self.total:,} bytes (MAX_JSON_BYTES or twice the request's body, "
                f"whichever is larger). {fix}",
                answer_bytes=total,
                limit=self.total,
                fix=fix,
            )
