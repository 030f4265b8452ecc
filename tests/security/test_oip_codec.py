"""The Open Inference Protocol codec (service/api/codecs/oip.py), fuzzed directly: any
body is an InferRequest or a domain error, never another exception; and the answer
bound computed before the work is never below the answer actually encoded (the
property the answer budget stands on), whatever the outputs, top_k and names."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calibrators.validation import CalibrationInputError
from service.api.codecs import answers, oip, rules
from service.errors import ServiceError

K = 4
BOUNDS = rules.Bounds(num_classes=K, model="m", max_rows=64, max_bytes=1 << 20, what="predict")
REFUSALS = (ServiceError, CalibrationInputError)

_sizes = st.one_of(st.integers(-2, 70), st.sampled_from([2**31, 2**62, 2**64]),
                   st.floats(allow_nan=False), st.booleans(), st.none())
_outputs = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from([*oip.OUTPUT_DATATYPES, "nope"])},
        optional={"parameters": st.fixed_dictionaries(
            {}, optional={"binary_data": st.booleans()})},
    ),
    max_size=4,
)


_valid_outputs = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(list(oip.OUTPUT_DATATYPES))},
        optional={"parameters": st.fixed_dictionaries({}, optional={
            "binary_data": st.booleans()})},
    ),
    max_size=4,
    unique_by=lambda o: o["name"],
)


@st.composite
def requests(draw) -> tuple[bytes, int | None]:
    """Half of them well formed (their fields each drawn from what the protocol allows),
    the others with any field hostile."""
    hostile = draw(st.booleans())

    def pick(valid, other):
        return draw(st.one_of(valid, other) if hostile else valid)

    rows = draw(st.integers(0, 40))
    shape = pick(st.just([rows, K]), st.lists(_sizes, max_size=3))
    datatype = pick(st.sampled_from(list(oip.INPUT_DATATYPES)), st.sampled_from(["INT8", None]))
    binary = draw(st.booleans())
    tensor: dict = {"name": pick(st.just(oip.INPUT), st.just("x")), "shape": shape,
                    "datatype": datatype}
    raw = b""
    if binary:
        itemsize = oip.INPUT_DATATYPES.get(datatype, np.dtype("<f4")).itemsize
        n = rows * K * itemsize + pick(st.just(0), st.sampled_from([-1, 1]))
        raw = np.random.default_rng(rows).normal(size=max(n, 0)).astype("<f4").tobytes()[
            : max(n, 0)]
        size = pick(st.just(len(raw)), st.sampled_from([len(raw) + 4, 0]))
        tensor["parameters"] = {"binary_data_size": size}
    else:
        tensor["data"] = pick(st.lists(st.floats(-50, 50), min_size=rows * K,
                                       max_size=rows * K),
                              st.lists(st.floats(-50, 50), max_size=rows * K + 1))
    params: dict = {}
    if draw(st.booleans()):
        params["top_k"] = pick(st.integers(1, K), st.one_of(st.integers(-1, K + 2), st.booleans()))
    if draw(st.booleans()):
        params["binary_data_output"] = pick(st.booleans(), st.integers())
    if draw(st.booleans()):
        params["kind"] = pick(st.just("logits"), st.sampled_from(["probabilities", "bits"]))
    outputs = pick(_valid_outputs, _outputs)
    if "top_k" not in params and not hostile:
        outputs = [o for o in outputs if o["name"] not in oip.TOP_K_ONLY]
    body = {"inputs": [tensor], "parameters": params, "outputs": outputs,
            "id": pick(st.one_of(st.none(), st.text(max_size=20)), st.integers())}
    head = json.dumps(body).encode()
    if not binary:
        return head, None
    return head + raw, len(head) + pick(st.just(0), st.sampled_from([-3, 5]))


@given(requests(), st.lists(st.text(max_size=400), min_size=K, max_size=K), st.booleans())
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_any_body_is_a_request_or_a_domain_error_and_its_bound_holds(body, names, named):
    raw, head = body
    try:
        request = oip.parse_request(raw, head, BOUNDS, named)
    except REFUSALS:
        return
    n = request.scores.shape[0]
    top = min(request.top_k or 1, K)
    rng = np.random.default_rng(n)
    probs = rng.dirichlet(np.ones(K), size=n).astype(np.float32)
    # the widest values each output can hold: int64 labels of 19 digits and a sign
    out = {
        "probabilities": -probs,
        "confidence": np.full(n, -1.1754944e-38, np.float32),
        "label": np.full(n, -(2**63), np.int64),
        "entropy": np.full(n, -1.1754944e-38, np.float32),
        "top_k_indices": np.full((n, top), -(2**63), np.int64),
        "top_k_probabilities": np.full((n, top), -1.1754944e-38, np.float32),
    }
    class_names = np.array(names, object) if named else None
    if named:  # the name outputs index class_names with these
        out["label"] = np.zeros(n, np.int64)
        out["top_k_indices"] = np.zeros((n, top), np.int64)
    name_bytes = max((len(s.encode()) for s in names), default=0) if named else 0
    total, as_json = oip.answer_bytes(request, name_bytes)
    encoded = oip.encode("m", 7, class_names, request, out)
    # the JSON around the data: the same answer with no rows
    empty = oip.encode("m", 7, class_names, dataclasses.replace(request, scores=request.scores[:0]),
                       {name: arr[:0] for name, arr in out.items()})
    envelope = len(empty.head) + empty.binary_bytes
    fixed = answers.CONSTANT_BYTES + answers.json_string_bytes(len((request.id or "").encode()))
    assert envelope <= fixed
    # the envelope grows by the digits of each output's shape and binary_data_size
    digits = 64 * len(request.outputs)
    assert len(encoded.head) + encoded.binary_bytes - envelope <= total - fixed + digits
    assert as_json <= total - fixed


TOPK_K = 3
TOPK_BOUNDS = rules.Bounds(num_classes=50, model="lm", max_rows=64, max_bytes=1 << 20,
                           what="predict")


@st.composite
def topk_requests(draw) -> tuple[bytes, int | None]:
    """Infer bodies for a top-k version (k = 3 of V = 50): half well formed (distinct
    ids, log-probabilities of a sub-distribution), the others with any field hostile;
    the two inputs in either order, JSON or binary data."""
    hostile = draw(st.booleans())

    def pick(valid, other):
        return draw(st.one_of(valid, other) if hostile else valid)

    rows = draw(st.integers(0, 40))
    rng = np.random.default_rng(rows)
    arrays = {
        "topk_ids": np.argsort(rng.random((rows, 50)), axis=1)[:, :TOPK_K].astype("<i8"),
        "topk_logprobs": np.log(rng.dirichlet(np.ones(TOPK_K + 1), size=rows)[:, :TOPK_K]),
    }
    binary = draw(st.booleans())
    inputs, raw = [], b""
    for name in draw(st.permutations(list(oip.TOPK_INPUT_DATATYPES))):
        datatype = pick(st.sampled_from(list(oip.TOPK_INPUT_DATATYPES[name])),
                        st.sampled_from(["FP16", "INT32", None]))
        dtype = oip.TOPK_INPUT_DATATYPES[name].get(datatype, np.dtype("<f4"))
        arr = arrays[name].astype(dtype)
        tensor = {"name": pick(st.just(name), st.sampled_from(["logits", "x"])),
                  "shape": pick(st.just([rows, TOPK_K]), st.lists(_sizes, max_size=3)),
                  "datatype": datatype}
        if binary:
            data = arr.tobytes()[: max(arr.nbytes + pick(st.just(0), st.just(-1)), 0)]
            tensor["parameters"] = {
                "binary_data_size": pick(st.just(len(data)), st.sampled_from([0, 2**62]))}
            raw += data
        else:
            tensor["data"] = pick(st.just(arr.tolist()), st.lists(st.floats(-5, 5), max_size=9))
        inputs.append(tensor)
    if hostile and draw(st.booleans()):
        inputs = draw(st.lists(st.sampled_from(inputs), max_size=3))
    params = {}
    if draw(st.booleans()):
        params["binary_data_output"] = pick(st.booleans(), st.integers())
    if hostile and draw(st.booleans()):
        params[draw(st.sampled_from(["top_k", "kind"]))] = 2
    outputs = draw(st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from([*oip.TOPK_OUTPUT_DATATYPES,
                                  *(["label", "nope"] if hostile else [])])},
        optional={"parameters": st.fixed_dictionaries({}, optional={
            "binary_data": st.booleans()})}), max_size=3, unique_by=lambda o: o["name"]))
    body = {"inputs": inputs, "parameters": params, "outputs": outputs,
            "id": pick(st.one_of(st.none(), st.text(max_size=20)), st.integers())}
    head = json.dumps(body).encode()
    if not binary:
        return head, None
    return head + raw, len(head) + pick(st.just(0), st.sampled_from([-3, 5]))


@given(topk_requests())
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_any_top_k_body_is_rows_or_a_domain_error_and_its_bound_holds(body):
    raw, head = body
    try:
        request = oip.parse_request(raw, head, TOPK_BOUNDS, topk_k=TOPK_K, served="v")
    except REFUSALS:
        return
    n = request.rows.logprobs.shape[0]
    assert request.rows.ids.shape == (n, TOPK_K) and request.kind is None
    out = {  # the widest values each output can hold
        "probabilities": np.full((n, TOPK_K), -1.1754944e-38, np.float32),
        "topk_ids": np.full((n, TOPK_K), -(2**63), np.int64),
        "tail": np.full(n, -1.1754944e-38, np.float32),
    }
    total, as_json = oip.answer_bytes(request, 0)
    encoded = oip.encode("lm", 7, None, request, out)
    empty = oip.encode("lm", 7, None, request, {name: arr[:0] for name, arr in out.items()})
    envelope = len(empty.head) + empty.binary_bytes
    fixed = answers.CONSTANT_BYTES + answers.json_string_bytes(len((request.id or "").encode()))
    assert envelope <= fixed
    digits = 64 * len(request.outputs)  # as above: the shapes' and sizes' digits
    assert len(encoded.head) + encoded.binary_bytes - envelope <= total - fixed + digits
    assert as_json <= total - fixed
