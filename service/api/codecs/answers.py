"""Prediction answers: their size, known before they are computed, and /v1's encoding.

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

import numpy as np

from service.errors import ContentTooLarge, InvalidInput

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
    def of(cls, declared: int, max_json_bytes: int, body_bytes: int) -> AnswerLimits:
        """The limits of a request to a route that declares answers of at most
        ``declared`` bytes, whose body took ``body_bytes`` once decoded."""
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


# -- /v1 predict's answer: JSON, or a .npy -------------------------------------

#: A .npy answer larger than this is sent as views of its array (header, then 1 MiB
#: slices), not copied into one buffer first; smaller ones take one write (the fast path).
STREAM_ANSWER_BYTES = 16 << 20

#: How to get whole rows without JSON, on /v1 predict.
NPY_ANSWER_FIX = "Ask for ?top_k=<k>, or for the whole rows as a .npy: Accept: application/x-npy."
TOP_K_ANSWER_FIX = "Ask for a smaller ?top_k, fewer rows, or a .npy: Accept: application/x-npy."


def predict_answer_bytes(n: int, k: int, top_k: int | None, want_npy: bool, name_bytes: int) -> int:
    """The most bytes of a predict answer for ``n`` rows of ``k`` classes, before it is
    computed; ``name_bytes``: the model's longest class name in UTF-8 (0: no names).
    Everything but :data:`CONSTANT_BYTES` is data, JSON unless ``want_npy``."""
    top = 0 if top_k is None else min(top_k, k)
    if want_npy:
        if top_k is None:  # float32 probabilities
            return n * k * BINARY_BYTES["FP32"]
        # records (index int64, probability float32, name <U: 4 bytes a character)
        record = BINARY_BYTES["INT64"] + BINARY_BYTES["FP32"] + 4 * name_bytes
        return n * top * record
    fp32, int64 = JSON_BYTES["FP32"], JSON_BYTES["INT64"]
    name = json_string_bytes(name_bytes) if name_bytes else 0
    per_row = int64 + 2 * fp32 + name  # label, confidence, entropy, label name
    per_row += k * fp32 if top_k is None else top * (int64 + fp32 + name)
    return n * per_row


#: The .npy answer of a ``top_k`` request: per row and rank, the class and its probability.
TOP_K_RECORD = np.dtype([("index", "<i8"), ("probability", "<f4")])


def top_k_records(out: dict[str, np.ndarray], class_names: np.ndarray | None) -> np.ndarray:
    """The (n, k) records of a ``top_k`` .npy answer: :data:`TOP_K_RECORD`, and when the
    model has class names a third field, ``name`` (``<U``, as wide as the longest name
    answered: numpy's fixed-width strings, which ``np.load`` reads without pickle).

    The whole-row answer has no such field: its columns are the classes in order, and
    their names are the model's (``GET /v1/models/{model}``).
    """
    index = out["top_k_indices"]
    fields = TOP_K_RECORD.descr
    if class_names is not None:
        names = class_names[index].astype(str)
        fields = [*fields, ("name", names.dtype.str)]
    body = np.empty(index.shape, np.dtype(fields))
    body["index"] = index
    body["probability"] = out["top_k_probabilities"]
    if class_names is not None:
        body["name"] = names
    return body
